"""The data sections of a run config: ``data`` (:class:`DataConfig`), ``data.synthetic``
(:class:`SyntheticTaskConfig`) and ``model.warm_start`` (:class:`WarmStartConfig`, the supervised
start on the synthetic task, built by ``areal_fast.data.warm_start``).

Each class validates its own values in ``__post_init__`` (``ValueError`` naming the field); the
loader (``areal_fast.config``) adds the section path. Torch-free, and nothing here imports the
loader: the data package sits below the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, option
from areal_fast.data.tiny_task import SyntheticTaskConfig

__all__ = ["FILE_SUFFIXES", "SYNTHETIC_TASKS", "WARM_START_LR_SCHEDULES", "DataConfig", "SyntheticTaskConfig",
           "WarmStartConfig", "check_source"]

SYNTHETIC_TASKS = ("reverse",)
"""The tasks a ``synthetic:NAME`` source may name."""
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
"""The file kinds a data source may name."""


def check_source(source: str) -> None:
    """Check the form of a data source name without reading it; raises ValueError saying why."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"must name a data source, got {source!r}")
    if source.startswith("synthetic:"):
        kind = source.split(":", 1)[1]
        if kind not in SYNTHETIC_TASKS:
            raise ValueError(f"unknown synthetic task {source!r}; available: "
                             f"{', '.join('synthetic:' + k for k in SYNTHETIC_TASKS)}")
        return
    if source.startswith("hf:"):
        if not source[len("hf:"):].split(":")[0]:
            raise ValueError(f"{source!r}: expected 'hf:NAME' or 'hf:NAME:CONFIG'")
        return
    if not source.endswith(FILE_SUFFIXES):
        raise ValueError(f"data file {source!r}: expected a name ending in {', '.join(FILE_SUFFIXES)} "
                         "(or 'synthetic:reverse', 'hf:NAME[:CONFIG]')")


WARM_START_ARCHS = ("qwen2", "qwen3_moe")
WARM_START_LR_SCHEDULES = ("constant", "linear")


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """Build a tiny Qwen2 (or Qwen3-MoE) from a config and fine-tune it briefly on the synthetic task (supervised),
    so RL starts from a policy that is sometimes right. Cached under ``<output_dir>/warm_start``."""

    enabled: bool = False
    """Build the model this way instead of loading ``model.path``."""
    steps: int = option(150, ge=0)
    """Supervised steps of the warm start (cross-entropy on the task's answers) before RL begins."""
    batch_size: int = option(64, ge=1)
    """Sequences per supervised step."""
    lr: float = option(3e-3, gt=0)
    """AdamW learning rate of the warm start."""
    lr_schedule: str = option("constant", choices=WARM_START_LR_SCHEDULES)
    """'constant', or 'linear' (decay from ``lr`` to 0 over ``steps``: the model ends settled, so a
    later RL run at a small learning rate does not improve it merely by annealing it)."""
    mistake_fraction: float = option(0.0, ge=0, lt=1)
    """Imperfect demonstrations: this fraction (in [0, 1)) of the supervised examples whose string has
    at least ``mistake_min_len`` characters carry a systematic mistake, their answer's last character
    dropped (as truncated answers in real fine-tuning data). The warm-started policy then often
    samples the right answer but often decodes the truncated one greedily; RL with the reward turns
    the first into the second. 0 = clean demonstrations."""
    mistake_min_len: int = option(1, ge=1)
    """Shortest string whose demonstrations may carry the mistake (>= 1)."""
    hidden_size: int = option(128, ge=1)
    """Qwen2 hidden size."""
    intermediate_size: int = option(256, ge=1)
    """Qwen2 MLP size."""
    num_hidden_layers: int = option(2, ge=1)
    """Decoder blocks."""
    num_attention_heads: int = option(4, ge=1)
    """Query heads."""
    num_key_value_heads: int = option(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    arch: str = option("qwen2", choices=WARM_START_ARCHS)
    """'qwen2' (dense), or 'qwen3_moe': a Qwen3-MoE whose every block's MLP is ``num_experts``
    experts of size ``moe_intermediate_size``, ``num_experts_per_tok`` of them routed per token
    (docs/moe.md). The head size is ``hidden_size / num_attention_heads`` for both."""
    num_experts: int = option(4, ge=1)
    """MoE experts per block (``arch: qwen3_moe`` only)."""
    num_experts_per_tok: int = option(2, ge=1)
    """Experts routed per token (top-k, at most ``num_experts``; ``arch: qwen3_moe`` only)."""
    moe_intermediate_size: int = option(128, ge=1)
    """MLP size of one expert (``arch: qwen3_moe`` only)."""

    def __post_init__(self):
        check_rules(self)  # mistake_fraction < 1: at 1 the right answer is never shown, nothing for RL to find
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok: must be <= num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size: must be a multiple of num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: must divide num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.num_key_value_heads}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompts and their verifiable answers."""

    train: str = "synthetic:reverse"
    """'synthetic:reverse', a local .jsonl / .jsonl.gz / .parquet file, or 'hf:NAME[:CONFIG]' (needs
    `datasets`)."""
    eval: str | None = None
    """Held-out set, same forms; None = the synthetic held-out split, or no evaluation for files."""
    split: str = option("train", nonempty=True)
    """Split name for 'hf:' sources (eval uses eval_split)."""
    eval_split: str = option("test", nonempty=True)
    """Split name of an 'hf:' eval source."""
    prompt_key: str = option("prompt", nonempty=True)
    """Field holding the prompt text."""
    answer_key: str = option("answer", nonempty=True)
    """Field holding the reference answer (math-style rewards); passed to the reward as 'answer'."""
    tests_key: str = option("tests", nonempty=True)
    """Field holding test cases (code rewards); passed to the reward as 'tests'."""
    prompt_template: str = "{prompt}"
    """Python format string applied to the prompt ({prompt} is the field; write '{{' for a brace)."""
    chat_template: bool = False
    """Wrap the prompt with the tokenizer's chat template (user turn + generation prompt)."""
    max_prompt_tokens: int = option(1024, ge=1)
    """Longer prompts are skipped (and counted) rather than truncated."""
    shuffle: bool = True
    """Seeded permutation of the training rows."""
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    """Parameters of the 'synthetic:reverse' task."""

    def __post_init__(self):
        check_rules(self)
        for key in ("train", "eval"):
            source = getattr(self, key)
            if source is None and key == "eval":
                continue
            try:
                check_source(source)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        if self.synthetic.growth.rows:  # the schedule is the training order of the synthetic rows
            if not self.train.startswith("synthetic:"):
                raise ValueError(f"synthetic.growth.rows: lengths grow only on a synthetic training set, and "
                                 f"train is {self.train!r}; set it to 0")
            if self.shuffle:
                raise ValueError("shuffle: must be false with synthetic.growth.rows > 0 (the training order is "
                                 "the growth schedule; each row is already random)")
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template: must contain '{{prompt}}', got {self.prompt_template!r}")
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"prompt_template: not a format string with only {{prompt}} ({e!r}); write '{{{{' "
                             f"and '}}}}' for literal braces, got {self.prompt_template!r}") from None
