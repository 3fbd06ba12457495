"""Run configuration: the whole tree (:class:`AppConfig`), YAML files and dotted overrides.

    areal-fast train examples/tiny_reverse.yaml train.optim.lr=1e-3 rollout.max_staleness=0

Each component owns its section, beside its code; this module puts them together, loads, checks
across sections and saves:

- ``rollout``: ``areal_fast/rollout/config.py``; ``reward``: ``areal_fast/reward/config.py``;
- ``data`` and ``model.warm_start``: ``areal_fast/data/config.py``;
- ``train`` (with ``train.ppo``, ``train.optim``): ``areal_fast/trainer/config.py``, and
  ``train.ppo.loss``: ``areal_fast/ops/loss_config.py``; ``weights``: ``areal_fast/weights/config.py``;
- the run's own sections, read by the launcher (``experiment``, ``model``, ``eval``,
  ``checkpoint``, ``log``, ``ray``): ``areal_fast/launch_config.py``;
- what they share (:class:`ConfigError`, the field rules, the one loader): ``areal_fast/configutil.py``.

Every section is a ``@dataclass(kw_only=True, slots=True)``: ranges and choices are declared
on its fields (``configutil.option``) and checked by ``configutil.check_rules`` first in its
``__post_init__``, which raises ``ValueError`` for what a rule cannot say. :func:`load_config`
builds the tree from plain dicts with the one loader (``configutil.Loader``, given this module's
:data:`DERIVED` and :data:`RENAMED` keys), checks each value against the field's type and turns
every problem into a :class:`ConfigError` that names the full dotted key (``unknown key
'train.optim.lrr'``, ``train.batch_size: must be >= 1``, ``rollout.engine: renamed to
rollout.server``).

What is checked, and when (``docs/config.md`` lists every key):

- :func:`load_config`: types, ranges (no NaN or infinity anywhere), cross-section rules, and the
  names resolved later (``reward.name``, ``eval.reward``, data sources, launcher and engine
  kinds), all without starting a process and without importing torch.
- :func:`check_machine` (``areal_fast/preflight.py``; ``areal-fast train`` and ``eval`` call it
  right after loading): what depends on this machine: the model and data files, CUDA devices and
  the GPU indices asked for, optional packages (sglang, ray, datasets).

:func:`save_config` writes the resolved config; :func:`load_config` of that file gives back an
equal config (trainer ranks read the run's config this way).

Every section class can still be imported from here; the machine checks are imported from
``areal_fast.preflight`` (which imports this module, not the other way round).
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_fast.configutil import ConfigError, Loader, check_rules, option
from areal_fast.data.config import WARM_START_LR_SCHEDULES, DataConfig, SyntheticTaskConfig, WarmStartConfig
from areal_fast.data.warm_start import Recipe
from areal_fast.diskutil import open_private_temp
from areal_fast.launch_config import (
    LAUNCHERS,
    MAX_SEED,
    CheckpointConfig,
    EvalConfig,
    ExperimentConfig,
    LogConfig,
    ModelConfig,
    RayConfig,
    SlurmConfig,
)
from areal_fast.metrics_config import METRICS_KEY_ENV, MetricsConfig, is_loopback
from areal_fast.ops.loss_config import PPOLossConfig
from areal_fast.reward.config import RewardConfig
from areal_fast.rollout.config import (
    MIN_TEMPERATURE,
    RESERVED_SERVER_ARGS,
    UNTRUNCATED,
    RolloutConfig,
    check_server_url,
)
from areal_fast.trainer.config import OptimConfig, PPOConfig, TrainerConfig, check_parallel_run, local_model_config
from areal_fast.weights.config import WeightSyncConfig, check_fp8_served_model, default_method

__all__ = [
    "DERIVED", "LAUNCHERS", "MAX_SEED", "MIN_TEMPERATURE", "RESERVED_SERVER_ARGS", "RESOLVED_HEADER",
    "WARM_START_LR_SCHEDULES", "AppConfig", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig",
    "ExperimentConfig", "LogConfig", "ModelConfig", "OptimConfig", "PPOConfig", "PPOLossConfig", "RayConfig",
    "RewardConfig", "RolloutConfig", "SlurmConfig", "SyntheticTaskConfig", "TrainerConfig", "WarmStartConfig",
    "WeightSyncConfig",
    "RENAMED", "check_names", "check_server_url", "from_dict", "load_config", "parse_override",
    "save_config", "to_dict",
]


@dataclass(kw_only=True, slots=True)
class AppConfig:
    """One training run."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(warm_start=WarmStartConfig(enabled=True)))
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer's own configuration (``areal_fast.trainer.config``); the keys in :data:`DERIVED`
    are filled from the sections named there."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """The weight-sync configuration (``areal_fast.weights.config``)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """W&B, MLflow and the Prometheus endpoint (``areal_fast.metrics_config``, docs/observability.md)."""
    api_key: str | None = field(default=None, repr=False)
    """The run's one API key: the bearer token of its servers (launched ones get it; give the key of
    servers you start yourself here), of the weight sync's calls and of a Prometheus endpoint off
    loopback. null: $AREAL_FAST_API_KEY when set. Never written to disk (`save_config`)."""
    launcher: str = option("local", choices=LAUNCHERS)
    """'local' (subprocesses and torchrun on this machine), 'ray' (a Ray cluster, see ``ray``) or 'slurm'
    (job steps of a Slurm allocation, see ``slurm``)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where the Ray launcher connects and how it places servers and trainer ranks."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Which allocations the Slurm launcher's steps run in and their sizes (``launch/slurm.py``)."""

    def __post_init__(self):
        check_rules(self)
        last_seed = self.experiment.seed + (0 if self.rollout.servers else self.rollout.n_servers - 1)
        if last_seed > MAX_SEED:
            raise ValueError(f"experiment.seed: launched server i gets seed + i; {self.experiment.seed!r} + "
                             f"{self.rollout.n_servers - 1} is past {MAX_SEED}")
        if self.train.ppo.reward_scale == 0:
            raise ValueError("train.ppo.reward_scale: must not be 0 (every reward would be the bias: every "
                             "advantage 0, nothing learned), got 0")
        if self.weights.method is None:  # null: chosen for the run, never over a value the user gave
            self.weights.method = default_method(lora=self.train.lora is not None)
        from areal_fast.backends.checks import check_rollout_servers

        check_rollout_servers(self.rollout, self.weights.method)  # the one check of what the servers serve
        if self.rollout.api == "vllm":
            if self.rollout.client_processes > 1:
                raise ValueError("rollout.client_processes > 1 with rollout.api 'vllm': the vLLM adapter is not run "
                                 "in worker processes yet (the sharded client is tested with SGLang's); use 1 "
                                 "(docs/vllm.md)")
            args = self.rollout.server_args
            dummy = any(a == "--load-format=dummy" or a == "--load-format" and args[i + 1:i + 2] == ["dummy"]
                        for i, a in enumerate(args))
            if dummy and self.rollout.server == "vllm" and self.weights.method == "disk":
                raise ValueError("rollout.server_args: --load-format dummy with weights.method 'disk': vLLM cannot "
                                 "reload a dummy-loaded model from disk (its dummy loader reads no weights); use "
                                 "weights.method 'distributed' or another load format")
        if _TRAINING.get():
            check_untruncated_sampling(self.rollout)
        if self.train.ppo.routing_replay and not self.rollout.return_routed_experts:
            raise ValueError("train.ppo.routing_replay: replays the routing the servers record; set "
                             "rollout.return_routed_experts: true as well (docs/moe.md)")
        ws = self.model.warm_start
        if self.rollout.return_routed_experts and ws.enabled and ws.arch == "qwen2":
            raise ValueError("rollout.return_routed_experts: the warm-started model (model.warm_start.arch "
                             "'qwen2') is dense: no routing to record; use arch 'qwen3_moe' (docs/moe.md)")
        if self.train.lora is not None:
            from areal_fast.lora_config import check_run

            check_run(self)
        if (self.weights.quantize is not None and not self.rollout.servers
                and "--quantization" not in self.rollout.server_args):
            raise ValueError(f"weights.quantize {self.weights.quantize!r}: the launched servers must serve the FP8 "
                             f"layout: add \"--quantization\", \"fp8\" to rollout.server_args (SGLang and vLLM also "
                             f"need model.path to be an FP8 checkpoint: weights.fp8.write_fp8_checkpoint; "
                             f"docs/mismatch.md)")
        check_parallel_run(self.train.parallel, self.model.warm_start, self.model.path)  # ep / cp against the model
        if self.weights.quantize is not None and not self.rollout.servers and self.rollout.server in ("sglang", "vllm"):
            if ws.enabled:
                check_fp8_served_model(ws.moe_intermediate_size if ws.arch == "qwen3_moe" else None,
                                       f"the warm-started model (model.warm_start.arch {ws.arch!r})")
            else:
                where, mcfg = local_model_config(self.model.path)
                if mcfg is not None:
                    check_fp8_served_model(mcfg.get("moe_intermediate_size"), where)
        if self.weights.flush_cache and self.rollout.pause_mode == "in_place":
            raise ValueError("weights.flush_cache: true flushes the servers' prefix cache with each update, which "
                             "rollout.pause_mode 'in_place' cannot do (the kept requests hold their KV); set "
                             "weights.flush_cache to false or null (null: flush unless the pause mode is in_place)")
        self._fill_derived()
        prom = self.metrics.prometheus
        if (prom.enabled and not is_loopback(prom.host) and not self.weights.resolved_api_key
                and not os.environ.get(METRICS_KEY_ENV)):
            raise ValueError(f"metrics.prometheus.host {prom.host!r} is not a loopback address, so every scrape must "
                             f"carry a bearer key: set ${METRICS_KEY_ENV}, api_key or $AREAL_FAST_API_KEY "
                             f"(docs/observability.md)")
        if self.model.warm_start.enabled and not self.data.train.startswith("synthetic:"):
            raise ValueError(f"model.warm_start.enabled: only available with data.train = 'synthetic:reverse', "
                             f"got data.train = {self.data.train!r}")

    def _fill_derived(self) -> None:
        """Set the trainer's copies of values that have one home elsewhere (:data:`DERIVED`)."""
        t = self.train
        for key, value in (("model_path", self.model.path), ("seed", self.experiment.seed),
                           ("sampling_temperature", self.rollout.temperature)):
            setattr(t, key, value)
        if t.ppo.loss.temperature != self.rollout.temperature:
            t.ppo.loss = dataclasses.replace(t.ppo.loss, temperature=self.rollout.temperature)
        self.weights.api_key = self.api_key
        if self.weights.flush_cache is None:  # requests kept in place hold their KV: a flush would fail
            self.weights.flush_cache = self.rollout.pause_mode != "in_place"
        if t.optim.total_steps == 0 and t.optim.lr_schedule != "constant":  # a decay needs the run's length
            t.optim.total_steps = self.experiment.total_steps

    def warm_start_recipe(self) -> Recipe:
        """The sections the warm start reads (``areal_fast.data.warm_start``, below this assembler)."""
        return Recipe(warm_start=self.model.warm_start, task=self.data.synthetic, seed=self.experiment.seed,
                      max_new_tokens=self.rollout.max_new_tokens, out=self.experiment.out / "warm_start")


_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("areal_fast_training_config", default=True)
"""False while :func:`load_config` loads for a command that trains nothing (``areal-fast eval``)."""


def check_untruncated_sampling(r: RolloutConfig) -> None:
    """A training run samples from the whole distribution: ``rollout.top_p`` < 1 and ``rollout.top_k``
    other than -1 are refused. The servers draw each token from the distribution top-p / top-k
    truncated and renormalised (vLLM's ``processed_logprobs`` reports that one's log-prob, SGLang's
    the full softmax's), while the trainer recomputes log-probs over the whole softmax (the proximal
    policy and the loss): every token's importance weight is then off by the mass the truncation cut
    (``bench/bench_top_p_bias.py``, ``docs/config.md`` "Sampling in a training run")."""
    for key, off in UNTRUNCATED.items():
        value = getattr(r, key, off)  # min_p is not a rollout option: asked per turn only (workflow.engine)
        if value != off:
            raise ValueError(
                f"rollout.{key}: {value!r} is refused in a training run (use {off}): the servers sample from the "
                f"distribution top-p / top-k truncate, while the trainer recomputes log-probs over the whole "
                f"softmax, so every token's importance weight would be biased by the probability mass the "
                f"truncation cut (docs/config.md, 'Sampling in a training run')")


DERIVED = {
    "train.model_path": "model.path",
    "train.seed": "experiment.seed",
    "train.sampling_temperature": "rollout.temperature",
    "train.ppo.loss.temperature": "rollout.temperature",
    "weights.api_key": "api_key",
}
"""Keys of the sections that a run config does not set: each is filled from the key it maps to (one
home per value; the launcher replaces ``model.path`` by the warm-start directory)."""


# ----------------------------------------------------------------------------- loading


RENAMED = {
    "weights.api_key": "api_key",
    "weights.backend": "weights.collective",
    "rollout.backend": "rollout.api",
    "rollout.engine": "rollout.server",
    "train.loss_backend": "train.loss_impl",
    "train.ppo.loss.behav_weight_cap": "train.ppo.loss.token_mis_upper (behav_weight_mode 'mask') or "
                                       "train.ppo.loss.tis_cap (behav_weight_mode 'clamp')",
    "train.ppo.loss.behav_weight_mode": "train.ppo.loss.token_mis_upper (mode 'mask') or train.ppo.loss.tis_cap "
                                        "(mode 'clamp')",
}
"""Keys a run config may no longer use, and what replaced each: loading one is an error naming the
new key (one meaning per word: ``backend`` is the op dispatcher's word alone, ``areal_fast/dispatch.py``)."""

_LOADER = Loader(derived=DERIVED, renamed=RENAMED)


def from_dict(cls, data: dict | None, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict (``configutil.Loader`` with this config's
    :data:`DERIVED` and :data:`RENAMED` keys); every error names the dotted key."""
    return _LOADER.build(cls, data, prefix)


def to_dict(cfg, prefix: str = "") -> dict:
    """The config as plain data (YAML/JSON-able), the inverse of :func:`from_dict` (the keys in
    :data:`DERIVED` are left out: they are filled again from their home)."""
    out = {}
    for f in dataclasses.fields(cfg):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if key in DERIVED:
            continue
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v, key)
        elif isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, list):
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


RESOLVED_HEADER = "# areal-fast resolved configuration"
"""First line of a file written by :func:`save_config`; its paths are taken as they are."""


def _read_yaml(p: Path) -> tuple[dict, bool]:
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist" if not p.exists()
                          else f"config file {str(p)!r} is not a regular file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping, got {type(tree).__name__}")
    return tree, text.startswith(RESOLVED_HEADER)


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (), *,
                training: bool = True) -> AppConfig:
    """Read a YAML file (or start from defaults when ``path`` is None), apply dotted overrides,
    validate every value and resolve every name (:func:`check_names`). ``training=False`` (a command
    that trains nothing: ``areal-fast eval``, which samples greedily) leaves out the rules that guard
    training only (:func:`check_untruncated_sampling`).

    Relative paths inside the file (model.path, model.tokenizer, data.train, data.eval) are resolved
    against the YAML file's directory when they exist there, so a config works from any working
    directory (not in a file written by :func:`save_config`, whose paths are already resolved).
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        tree, resolved = _read_yaml(p)
        if not resolved:
            _resolve_relative(tree, p.parent)
    for ov in overrides:
        keys, value = parse_override(ov)
        _apply(tree, keys, value)
    token = _TRAINING.set(training)
    try:
        cfg = from_dict(AppConfig, tree)
    finally:
        _TRAINING.reset(token)
    check_names(cfg)
    return cfg


def save_config(cfg: AppConfig, path: str | os.PathLike) -> Path:
    """Write ``cfg`` as YAML so that ``load_config(path) == cfg`` (written to a temporary file and
    renamed, so a reader never sees half a file), readable by this user only (0600). The one value
    left out is ``api_key`` (written as null): a key never goes to disk. Returns the path."""
    p = Path(path)
    d = to_dict(cfg)
    d["api_key"] = None  # never on disk: the key reaches processes in their environment only
    text = f"{RESOLVED_HEADER} (load_config reads it back exactly)\n" + yaml.safe_dump(d, sort_keys=False)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        fd = open_private_temp(tmp)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"cannot write the run config {str(p)!r}: {e.strerror or e}") from e
    return p


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


# ----------------------------------------------------------------------------- names and this machine


def check_names(cfg: AppConfig) -> None:
    """Resolve what is otherwise looked up only inside worker processes: ``reward.name``,
    ``eval.reward`` and ``rollout.workflow`` (registry names are checked against the registry, 'module:function' is
    imported and must be callable). Raises :class:`ConfigError` naming the key."""
    from areal_fast.reward.registry import get_reward_fn

    for key, name in (("reward.name", cfg.reward.name), ("eval.reward", cfg.eval.reward)):
        if name is None:
            continue
        try:
            get_reward_fn(name)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a user module that fails to import for any reason
            raise ConfigError(f"{key}: importing {name!r} failed: {type(e).__name__}: {e}") from None
    from areal_fast.workflow.api import load_workflow

    try:
        workflow = load_workflow(cfg.rollout.workflow)
    except ValueError as e:
        raise ConfigError(f"rollout.workflow: {e}") from None
    except Exception as e:  # noqa: BLE001 - a user module that fails to import for any reason
        raise ConfigError(f"rollout.workflow: importing {cfg.rollout.workflow!r} failed: "
                          f"{type(e).__name__}: {e}") from None
    check_args = getattr(workflow, "check_args", None)  # a workflow that checks its workflow_args (the agent's)
    if callable(check_args):
        try:
            check_args(dict(cfg.rollout.workflow_args))
        except ValueError as e:
            raise ConfigError(str(e)) from None
