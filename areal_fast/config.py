"""Run configuration: dataclasses with a docstring per field, YAML files and dotted overrides.

    areal-fast train examples/tiny_reverse.yaml train.optim.lr=1e-3 rollout.max_staleness=0

Every section is a ``@dataclass(kw_only=True, slots=True)`` whose ``__post_init__`` raises
``ValueError`` on a bad value. :func:`load_config` builds the tree from plain dicts, checks
each value against the field's type and turns every problem into a :class:`ConfigError`
that names the full dotted key (``unknown key 'train.optim.lrr'``, ``train.batch_size: must
be >= 1``). The PPO objective and optimizer sections are the trainer's own dataclasses
(``areal_fast.trainer.config``), so their validation is shared, not copied.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_fast.launch.ray_launcher import RayConfig
from areal_fast.trainer.config import OptimConfig, PPOConfig

__all__ = [
    "AppConfig", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "ExperimentConfig",
    "LogConfig", "ModelConfig", "OptimConfig", "PPOConfig", "RayConfig", "RewardConfig", "RolloutConfig",
    "SyntheticTaskConfig", "TrainConfig", "WarmStartConfig", "WeightSyncConfig", "from_dict",
    "load_config", "parse_override", "to_dict",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


@dataclass(kw_only=True, slots=True)
class ExperimentConfig:
    """Where a run writes and how long it lasts."""

    name: str = "run"
    """Run name, used in the default output directory."""
    output_dir: str = "runs/{name}"
    """Directory for checkpoints, metrics, logs and plots ('{name}' is replaced)."""
    seed: int = 1
    """Seed of the data order, the sampling seeds and the model initialisation."""
    total_steps: int = 100
    """Trainer steps (= weight versions) of the run."""
    resume: bool = True
    """Continue from the newest complete checkpoint in output_dir when there is one."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.total_steps < 1:
            raise ValueError(f"total_steps: must be >= 1, got {self.total_steps!r}")

    @property
    def out(self) -> Path:
        return Path(self.output_dir.replace("{name}", self.name))


@dataclass(kw_only=True, slots=True)
class SyntheticTaskConfig:
    """The procedurally generated reversal task (``areal_fast.data.tiny_task``)."""

    alphabet: str = "abcdefghij"
    """Characters of the strings to reverse."""
    min_len: int = 2
    """Shortest string."""
    max_len: int = 24
    """Longest string (the tail of the log-normal length distribution is cut here)."""
    log_mean: float = 1.0
    """mu of the log-normal part of the length: len = min_len + floor(exp(N(mu, sigma)))."""
    log_std: float = 0.75
    """sigma of the log-normal part of the length (larger = longer tail)."""
    n_train: int = 20000
    """Training prompts (the order is a seeded permutation; the run cycles through it)."""
    n_eval: int = 128
    """Held-out prompts (a disjoint seed)."""

    def __post_init__(self):
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError(f"alphabet: must be non-empty distinct characters, got {self.alphabet!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"min_len/max_len: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.log_std < 0:
            raise ValueError(f"log_std: must be >= 0, got {self.log_std!r}")
        if self.n_train < 1 or self.n_eval < 0:
            raise ValueError("n_train must be >= 1 and n_eval >= 0")


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """Build a tiny Qwen2 from a config and fine-tune it briefly on the synthetic task (supervised),
    so RL starts from a policy that is sometimes right. Cached in ``<output_dir>/warm_start``."""

    enabled: bool = False
    """Build the model this way instead of loading ``model.path``."""
    steps: int = 150
    """Supervised steps (about 0.1 s each for the default model on one CPU core)."""
    batch_size: int = 64
    """Sequences per supervised step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    hidden_size: int = 128
    """Qwen2 hidden size."""
    intermediate_size: int = 256
    """Qwen2 MLP size."""
    num_hidden_layers: int = 2
    """Decoder blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError("steps must be >= 0 and batch_size >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size: must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy."""

    path: str | None = None
    """Local Hugging Face model directory (config.json + safetensors + tokenizer). None only with
    warm_start.enabled."""
    tokenizer: str | None = None
    """Tokenizer directory when it differs from ``path``."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Build and warm-start a tiny model instead (the shipped example)."""

    def __post_init__(self):
        if self.path is None and not self.warm_start.enabled:
            raise ValueError("path: a model directory is required unless warm_start.enabled is true")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompts and their verifiable answers."""

    train: str = "synthetic:reverse"
    """'synthetic:reverse', a local .jsonl/.parquet file, or 'hf:NAME[:CONFIG]' (needs `datasets`)."""
    eval: str | None = None
    """Held-out set, same forms; None = the synthetic held-out split, or no evaluation for files."""
    split: str = "train"
    """Split name for 'hf:' sources (eval uses eval_split)."""
    eval_split: str = "test"
    """Split name of an 'hf:' eval source."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    answer_key: str = "answer"
    """Field holding the reference answer (math-style rewards)."""
    tests_key: str = "tests"
    """Field holding test cases (code rewards); used when present."""
    prompt_template: str = "{prompt}"
    """Python format string applied to the prompt ({prompt} is the field)."""
    chat_template: bool = False
    """Wrap the prompt with the tokenizer's chat template (user turn + generation prompt)."""
    max_prompt_tokens: int = 1024
    """Longer prompts are skipped (and counted) rather than truncated."""
    shuffle: bool = True
    """Seeded permutation of the training rows."""
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    """Parameters of the 'synthetic:reverse' task."""

    def __post_init__(self):
        if not self.train:
            raise ValueError("train: must name a data source")
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template: must contain '{{prompt}}', got {self.prompt_template!r}")
        if self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens: must be >= 1")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Inference servers, sampling and the staleness bound."""

    engine: str = "embedded"
    """'embedded' (``python -m areal_fast.rollout.engine``) or 'sglang'."""
    servers: list[str] = field(default_factory=list)
    """Addresses of servers that are already running ('http://host:port'); empty = launch them."""
    n_servers: int = 1
    """Servers to launch."""
    device: str = "cpu"
    """Device of launched embedded engines ('cpu' or 'cuda')."""
    server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for every launched server."""
    gpus: list[str] = field(default_factory=list)
    """CUDA_VISIBLE_DEVICES of each launched server, e.g. ["0", "1"] or ["0,1"] for tp 2 (empty: inherit)."""
    threads_per_server: int = 1
    """torch CPU threads of each embedded engine (OMP_NUM_THREADS)."""
    group_size: int = 8
    """n: samples per prompt, scored together as one group (GRPO)."""
    max_new_tokens: int = 64
    """Generation budget per sample."""
    temperature: float = 1.0
    """Sampling temperature (the trainer recomputes log-probs at the same one)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_staleness: int = 4
    """eta: a sample may start at most eta versions before the one that trains on it. 0 = synchronous."""
    max_concurrent: int = 64
    """Groups generating at once (across all servers)."""
    strict_staleness: bool = False
    """Drop a finished group any of whose tokens is older than version - eta (counted)."""
    request_timeout: float = 600.0
    """Seconds for one /generate call before it is retried elsewhere."""
    health_timeout: float = 300.0
    """Seconds to wait for launched servers to become healthy."""

    def __post_init__(self):
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"engine: must be 'embedded' or 'sglang', got {self.engine!r}")
        if self.n_servers < 1 and not self.servers:
            raise ValueError("n_servers: must be >= 1")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0 for RL sampling, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness!r}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be >= 1, got {self.max_concurrent!r}")
        if self.threads_per_server < 1:
            raise ValueError("threads_per_server: must be >= 1")
        if self.gpus and len(self.gpus) != self.n_servers:
            raise ValueError(f"gpus: one entry per server expected ({self.n_servers}), got {self.gpus!r}")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The verifiable reward (``areal_fast.reward``)."""

    name: str = "math"
    """'math', 'code', or 'module:function' for a custom reward."""
    timeout: float = 10.0
    """Seconds per call; a timeout scores 0 and is counted."""
    workers: int | None = None
    """Processes of the reward pool (None = from the CPU count)."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: must not be empty")
        if not self.timeout > 0:
            raise ValueError(f"timeout: must be > 0, got {self.timeout!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError("workers: must be >= 1 or null")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The PPO actor (``areal_fast.trainer``)."""

    batch_size: int = 8
    """B: groups (prompts) per trainer step."""
    world_size: int = 1
    """Trainer ranks (torchrun); 1 = the trainer runs inside the controller process."""
    threads: int = 1
    """torch CPU threads per trainer rank."""
    device: str | None = None
    """'cuda', 'cpu' or None (cuda when available)."""
    gpus: str | None = None
    """CUDA_VISIBLE_DEVICES of the trainer ranks, e.g. "4,5,6,7" (None: inherit; may share the servers' GPUs)."""
    max_tokens_per_mb: int = 16384
    """Token budget of one packed micro-batch."""
    attn_impl: str = "auto"
    """Attention over packed sequences (see TrainerConfig.attn_impl)."""
    param_dtype: str = "bfloat16"
    """Compute dtype on GPU (CPU computes in float32)."""
    gradient_checkpointing: bool = False
    """Activation checkpointing per decoder block."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The decoupled PPO objective and advantages."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {self.world_size!r}")
        if self.threads < 1:
            raise ValueError("threads: must be >= 1")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device: must be 'cpu', 'cuda' or null, got {self.device!r}")


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How new weights reach the servers after each step (``areal_fast.weights``)."""

    method: str = "distributed"
    """'distributed' (NCCL / gloo broadcast in flattened buckets) or 'disk' (safetensors + reload)."""
    bucket_bytes: int = 256 << 20
    """Largest flattened bucket of the broadcast path."""
    timeout: float = 600.0
    """Seconds for one sync before it fails."""

    def __post_init__(self):
        if self.method not in ("distributed", "disk"):
            raise ValueError(f"method: must be 'distributed' or 'disk', got {self.method!r}")
        if self.bucket_bytes < 1 << 10:
            raise ValueError(f"bucket_bytes: must be >= 1024, got {self.bucket_bytes!r}")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Greedy evaluation on the held-out set."""

    every_steps: int = 10
    """Evaluate after every this many steps (0 = never); also at the start and the end."""
    size: int | None = None
    """Held-out prompts to use (None = all)."""
    max_new_tokens: int | None = None
    """Generation budget (None = rollout.max_new_tokens)."""
    at_start: bool = True
    """Evaluate the initial policy before training."""
    reward: str | None = None
    """Reward of the evaluation when it differs from training (e.g. exact match while training on a
    dense partial-credit reward); None = reward.name."""

    def __post_init__(self):
        if self.every_steps < 0:
            raise ValueError("every_steps: must be >= 0")
        if self.size is not None and self.size < 1:
            raise ValueError("size: must be >= 1 or null")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints that hold the trainer and the controller state (resumable after kill -9)."""

    every_steps: int = 10
    """Save after every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept on disk."""
    save_hf: bool = True
    """Also export the final policy as a Hugging Face directory (<output_dir>/final)."""

    def __post_init__(self):
        if self.every_steps < 0:
            raise ValueError("every_steps: must be >= 0")
        if self.keep_last < 1:
            raise ValueError("keep_last: must be >= 1")


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """Metrics and progress display."""

    progress: bool = True
    """tqdm progress bar."""
    tensorboard: bool = True
    """Also write TensorBoard events when `tensorboard` (or tensorboardX) is installed."""
    plots: bool = True
    """PNG plots of reward, throughput and staleness at the end (needs matplotlib)."""
    level: str = "INFO"
    """Python logging level of the controller."""
    samples: bool = False
    """Write every trained group (decoded text, rewards, token versions) to samples.jsonl."""

    def __post_init__(self):
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"level: must be DEBUG/INFO/WARNING/ERROR, got {self.level!r}")


@dataclass(kw_only=True, slots=True)
class AppConfig:
    """One training run."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(warm_start=WarmStartConfig(enabled=True)))
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launcher: str = "local"
    """'local' (subprocesses and torchrun on this machine) or 'ray' (a Ray cluster, see ``ray``)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where the Ray launcher connects and how it places servers and trainer ranks."""

    def __post_init__(self):
        if self.launcher not in ("local", "ray"):
            raise ValueError(f"launcher: must be 'local' or 'ray', got {self.launcher!r}")
        if abs(self.train.ppo.temperature - self.rollout.temperature) > 1e-12:
            raise ValueError(
                f"train.ppo.temperature ({self.train.ppo.temperature}) must equal rollout.temperature "
                f"({self.rollout.temperature}): the trainer recomputes log-probs at the sampling temperature"
            )
        if self.model.warm_start.enabled and not self.data.train.startswith("synthetic:"):
            raise ValueError("model.warm_start: only available with data.train = 'synthetic:reverse'")


# ----------------------------------------------------------------------------- loading


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, key: str):
    """Check ``value`` against the annotation ``tp``; returns the (possibly converted) value."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (section {tp.__name__}), got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads '1e-5' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; every error names the dotted key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"unknown key '{key}' (valid keys{' under ' + repr(prefix) if prefix else ''}: "
                              f"{', '.join(names)})")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e)
        # Section validators name their field first ("lr: must be ..."); add the section path.
        # The trainer's own sections already write "optim.lr ..."; keep just the last part.
        if prefix and not msg.startswith(prefix):
            tail = prefix.rsplit(".", 1)[-1]
            if msg.startswith(tail + "."):
                msg = msg[len(tail) + 1:]
            msg = f"{prefix}.{msg}"
        raise ConfigError(msg) from e


def to_dict(cfg) -> dict:
    """The config as plain data (YAML/JSON-able), the inverse of :func:`from_dict`."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a','b','c'], value); the value is parsed as YAML (1e-5, true, [1,2], null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.optim.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # e.g. an unbalanced quote: take the text as it is
    if isinstance(value, dict | list) and not raw.strip().startswith(("{", "[")):
        value = raw  # 'Q: {prompt}' is a template string, not a YAML mapping
    return key.split("."), value


def _apply(tree: dict, path: list[str], value) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {'.'.join(path)}: '{'.'.join(path[:i + 1])}' is not a section")
        node = nxt
    node[path[-1]] = value


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> AppConfig:
    """Read a YAML file (or start from defaults when ``path`` is None) and apply dotted overrides.

    Relative paths inside the file (model.path, data.train, data.eval) are resolved against the
    YAML file's directory when they exist there, so a config works from any working directory.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping")
        _resolve_relative(tree, p.parent)
    for ov in overrides:
        keys, value = parse_override(ov)
        _apply(tree, keys, value)
    return from_dict(AppConfig, tree)


def _resolve_relative(tree: dict, base: Path) -> None:
    for section, key in (("model", "path"), ("model", "tokenizer"), ("data", "train"), ("data", "eval")):
        sec = tree.get(section)
        if not isinstance(sec, dict):
            continue
        v = sec.get(key)
        if isinstance(v, str) and v and not os.path.isabs(v) and ":" not in v.split("/")[0]:
            cand = base / v
            if cand.exists() and not Path(v).exists():
                sec[key] = str(cand)
