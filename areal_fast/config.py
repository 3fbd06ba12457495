"""Run configuration: dataclasses with a docstring per field, YAML files and dotted overrides.

    areal-fast train examples/tiny_reverse.yaml train.optim.lr=1e-3 rollout.max_staleness=0

Every section is a ``@dataclass(kw_only=True, slots=True)`` whose ``__post_init__`` raises
``ValueError`` on a bad value. :func:`load_config` builds the tree from plain dicts, checks
each value against the field's type and turns every problem into a :class:`ConfigError`
that names the full dotted key (``unknown key 'train.optim.lrr'``, ``train.batch_size: must
be >= 1``). The trainer's sections are the trainer's own dataclasses
(``areal_fast.trainer.config``), so their validation is shared, not copied.

What is checked, and when (``docs/config.md`` lists every key):

- :func:`load_config`: types, ranges (no NaN or infinity anywhere), cross-section rules, and the
  names resolved later (``reward.name``, ``eval.reward``, data sources, launcher and engine
  kinds), all without starting a process and without importing torch.
- :func:`check_machine` (``areal-fast train`` and ``eval`` call it right after loading): what
  depends on this machine: the model and data files, CUDA devices and the GPU indices asked for,
  optional packages (sglang, ray, datasets).

:func:`save_config` writes the resolved config; :func:`load_config` of that file gives back an
equal config (trainer ranks read the run's config this way).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_fast.buffer import DEFAULT_MEMORY_MB as DEFAULT_BUFFER_MEMORY_MB
from areal_fast.data.datasets import check_source
from areal_fast.data.tiny_task import SEPARATOR as _TASK_SEPARATOR
from areal_fast.heap import period_from_env as heap_trim_period_from_env
from areal_fast.ops.loss_config import PPOLossConfig
from areal_fast.trainer.config import OptimConfig, PPOConfig, TrainerConfig
from areal_fast.weights.config import WeightSyncConfig

__all__ = [
    "DERIVED", "AppConfig", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "ExperimentConfig",
    "LogConfig", "ModelConfig", "OptimConfig", "PPOConfig", "PPOLossConfig", "RayConfig", "RewardConfig",
    "RolloutConfig", "SyntheticTaskConfig", "TrainerConfig", "WarmStartConfig", "WeightSyncConfig",
    "check_machine", "check_names", "from_dict", "gpu_count", "load_config", "parse_override", "save_config",
    "to_dict",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


MAX_SEED = 2**32 - 1
"""Largest seed: SGLang seeds numpy with the server's seed (``np.random.seed`` takes < 2**32), and
launched server i gets ``experiment.seed + i``."""
MIN_TEMPERATURE = 0.01
"""Smallest sampling temperature of a run: SGLang samples greedily below 1e-6 while the trainer
would still divide its logits by the temperature, and logits / 1e-300 overflow to inf (NaN loss).
Below 0.01 sampling is greedy in all but name; RL needs samples that differ."""
RESERVED_SERVER_ARGS = ("--api-key", "--config")
"""Server options the launcher owns: the run's one API key reaches the servers in a private file
given with ``--config`` (``launch.base.server_key_file``)."""


def check_server_url(name: str, url) -> None:
    """Refuse a server address that would fail later (or leak): 'http(s)://host[:port][/path]' with
    no space, no user:password@, and a port in 1..65535."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url) or any(c.isspace() for c in url):
        raise ValueError(f"{name}: expected 'http://host:port' without spaces, got {url!r}")
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise ValueError(f"{name}: no user:password@ in a server address (it would travel in the Host header); "
                         f"the servers' key is weights.api_key or $AREAL_FAST_API_KEY, got {url!r}")
    try:
        port = parts.port  # ValueError: not a number, or out of 0..65535
    except ValueError as e:
        raise ValueError(f"{name}: bad port in {url!r} ({e})") from None
    if not parts.hostname or port == 0:
        raise ValueError(f"{name}: expected 'http://host:port' with a host and a port in 1..65535, got {url!r}")


def _positive_seconds(name: str, value: float) -> None:
    if not value > 0:  # NaN and infinity never get here: the loader refuses non-finite numbers
        raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")


def _device_indices(text: str) -> list[int] | None:
    """'4,5' -> [4, 5]; None when the list names devices by UUID (not checkable by index)."""
    parts = [p.strip() for p in str(text).split(",")]
    if any(not p for p in parts):
        raise ValueError(f"empty entry in the device list {text!r}")
    if all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    if all(p.startswith(("GPU-", "MIG-")) for p in parts):
        return None
    raise ValueError(f"expected comma-separated GPU indices (e.g. '0,1') or GPU UUIDs, got {text!r}")


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
        if not self.output_dir:
            raise ValueError("output_dir: must not be empty")
        if self.total_steps < 1:
            raise ValueError(f"total_steps: must be >= 1, got {self.total_steps!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed: must be in [0, {MAX_SEED}] (numpy seeds the servers with it), got {self.seed!r}")

    @property
    def out(self) -> Path:
        return Path(self.output_dir.replace("{name}", self.name))


@dataclass(kw_only=True, slots=True)
class SyntheticTaskConfig:
    """The procedurally generated reversal task (``areal_fast.data.tiny_task``)."""

    alphabet: str = "abcdefghij"
    """Characters of the strings to reverse (distinct, without the separator '=')."""
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
        if _TASK_SEPARATOR in self.alphabet:
            raise ValueError(f"alphabet: must not contain the separator {_TASK_SEPARATOR!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"min_len/max_len: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.log_std < 0:
            raise ValueError(f"log_std: must be >= 0, got {self.log_std!r}")
        if self.n_train < 1:
            raise ValueError(f"n_train: must be >= 1, got {self.n_train!r}")
        if self.n_eval < 0:
            raise ValueError(f"n_eval: must be >= 0, got {self.n_eval!r}")


WARM_START_LR_SCHEDULES = ("constant", "linear")


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """Build a tiny Qwen2 from a config and fine-tune it briefly on the synthetic task (supervised),
    so RL starts from a policy that is sometimes right. Cached under ``<output_dir>/warm_start``."""

    enabled: bool = False
    """Build the model this way instead of loading ``model.path``."""
    steps: int = 150
    """Supervised steps (about 0.1 s each for the default model on one CPU core)."""
    batch_size: int = 64
    """Sequences per supervised step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    lr_schedule: str = "constant"
    """'constant', or 'linear' (decay from ``lr`` to 0 over ``steps``: the model ends settled, so a
    later RL run at a small learning rate does not improve it merely by annealing it)."""
    mistake_fraction: float = 0.0
    """Imperfect demonstrations: this fraction (in [0, 1)) of the supervised examples whose string has
    at least ``mistake_min_len`` characters carry a systematic mistake, their answer's last character
    dropped (as truncated answers in real fine-tuning data). The warm-started policy then often
    samples the right answer but often decodes the truncated one greedily; RL with the reward turns
    the first into the second. 0 = clean demonstrations."""
    mistake_min_len: int = 1
    """Shortest string whose demonstrations may carry the mistake (>= 1)."""
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
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps!r}")
        for key in ("batch_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr!r}")
        if self.lr_schedule not in WARM_START_LR_SCHEDULES:
            raise ValueError(f"lr_schedule: must be one of {WARM_START_LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.mistake_fraction < 1:  # at 1 the right answer is never shown: nothing for RL to find
            raise ValueError(f"mistake_fraction: must be in [0, 1), got {self.mistake_fraction!r}")
        if self.mistake_min_len < 1:
            raise ValueError(f"mistake_min_len: must be >= 1, got {self.mistake_min_len!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size: must be a multiple of num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: must divide num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.num_key_value_heads}")


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
        if not self.path and not self.warm_start.enabled:
            raise ValueError("path: a local model directory is required unless warm_start.enabled is true")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompts and their verifiable answers."""

    train: str = "synthetic:reverse"
    """'synthetic:reverse', a local .jsonl / .jsonl.gz / .parquet file, or 'hf:NAME[:CONFIG]' (needs
    `datasets`)."""
    eval: str | None = None
    """Held-out set, same forms; None = the synthetic held-out split, or no evaluation for files."""
    split: str = "train"
    """Split name for 'hf:' sources (eval uses eval_split)."""
    eval_split: str = "test"
    """Split name of an 'hf:' eval source."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    answer_key: str = "answer"
    """Field holding the reference answer (math-style rewards); passed to the reward as 'answer'."""
    tests_key: str = "tests"
    """Field holding test cases (code rewards); passed to the reward as 'tests'."""
    prompt_template: str = "{prompt}"
    """Python format string applied to the prompt ({prompt} is the field; write '{{' for a brace)."""
    chat_template: bool = False
    """Wrap the prompt with the tokenizer's chat template (user turn + generation prompt)."""
    max_prompt_tokens: int = 1024
    """Longer prompts are skipped (and counted) rather than truncated."""
    shuffle: bool = True
    """Seeded permutation of the training rows."""
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    """Parameters of the 'synthetic:reverse' task."""

    def __post_init__(self):
        for key in ("train", "eval"):
            source = getattr(self, key)
            if source is None and key == "eval":
                continue
            try:
                check_source(source)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template: must contain '{{prompt}}', got {self.prompt_template!r}")
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"prompt_template: not a format string with only {{prompt}} ({e!r}); write '{{{{' "
                             f"and '}}}}' for literal braces, got {self.prompt_template!r}") from None
        for key in ("prompt_key", "answer_key", "tests_key", "split", "eval_split"):
            if not getattr(self, key):
                raise ValueError(f"{key}: must not be empty")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens!r}")


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


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
    """Device of launched embedded engines ('cpu', 'cuda' or 'cuda:N')."""
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
    """Sampling temperature, set once for the run: the trainer recomputes log-probs at the same one."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling: -1 = off (the whole vocabulary), else >= 1 (SGLang refuses 0)."""
    max_staleness: int = 4
    """eta: a sample may start at most eta versions before the one that trains on it. 0 = synchronous."""
    max_concurrent: int = 64
    """Groups generating at once (across all servers)."""
    strict_staleness: bool = False
    """Drop a finished group any of whose tokens is older than version - eta (counted)."""
    request_timeout: float = 600.0
    """Seconds for one /generate call before it is retried elsewhere."""
    pause_mode: str = "auto"
    """How servers pause for a weight update: 'auto' (per server: 'retract' on SGLang >= 0.5.19, whose
    per-token version spans label retracted requests, else 'abort'), 'retract' or 'abort' (``docs/scale.md``)."""
    health_timeout: float = 300.0
    """Seconds to wait for launched servers to become healthy."""
    workflow: str = "areal_fast.workflow.single_turn:single_turn"
    """The episode each of the group_size rollouts of a task runs: 'package.module:function', an
    async function (row, engine) -> list of trajectories (``docs/workflows.md``). The default is one
    completion and one reward. Resolved when the config is loaded."""
    workflow_args: dict = field(default_factory=dict)
    """Keyword arguments passed to every call of the workflow (e.g. a turn budget)."""
    tool_timeout: float = 10.0
    """Seconds per tool call of a workflow; a tool that takes longer is killed (counted as tool/timeout)."""
    client_processes: int = 1
    """Processes of the rollout client: 1 = the client runs in the controller's process; N > 1 = N worker
    processes, each with its own client over a disjoint share of the servers (``docs/scale.md``)."""
    buffer_memory_mb: float | None = DEFAULT_BUFFER_MEMORY_MB
    """MB of token columns the controller keeps in memory for finished groups waiting to be trained;
    groups beyond it wait in a temporary file in output_dir, read back when trained (0 = every group;
    null = no bound). The default (128) and why: ``areal_fast.buffer.DEFAULT_MEMORY_MB``."""

    def __post_init__(self):
        if not re.match(r"^[\w.]+:[\w.]+$", self.workflow or ""):
            raise ValueError(f"workflow: expected 'package.module:function', got {self.workflow!r}")
        _positive_seconds("tool_timeout", self.tool_timeout)
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"engine: must be 'embedded' or 'sglang', got {self.engine!r}")
        for i, url in enumerate(self.servers):
            check_server_url(f"servers[{i}]", url)
        for arg in self.server_args:
            if str(arg).split("=", 1)[0] in RESERVED_SERVER_ARGS:
                raise ValueError(f"server_args: {arg!r} is set by the launcher (the run's one API key reaches the "
                                 f"servers in a private file given with --config); remove it, and give the key of "
                                 f"servers you start yourself as weights.api_key or $AREAL_FAST_API_KEY")
        if self.n_servers < 1 and not self.servers:
            raise ValueError(f"n_servers: must be >= 1, got {self.n_servers!r}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device: must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.threads_per_server < 1:
            raise ValueError(f"threads_per_server: must be >= 1, got {self.threads_per_server!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"temperature: must be >= {MIN_TEMPERATURE} for RL sampling (lower is greedy: SGLang "
                             f"switches to greedy below 1e-6, the trainer's logits / temperature overflow), got "
                             f"{self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k: must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness!r}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be >= 1, got {self.max_concurrent!r}")
        _positive_seconds("request_timeout", self.request_timeout)
        if self.pause_mode not in ("auto", "retract", "abort"):
            raise ValueError(f"pause_mode: must be 'auto', 'retract' or 'abort', got {self.pause_mode!r}")
        _positive_seconds("health_timeout", self.health_timeout)
        n = len(self.servers) or self.n_servers
        if not isinstance(self.client_processes, int) or not 1 <= self.client_processes <= max(n, 1):
            raise ValueError(f"client_processes: must be >= 1 and <= the number of servers ({n}), "
                             f"got {self.client_processes!r}")
        mb = self.buffer_memory_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 <= mb < float("inf")):
            raise ValueError(f"buffer_memory_mb: must be a number of MB >= 0, or null for no bound, got {mb!r}")
        heap_trim_period_from_env()  # AREAL_FAST_HEAP_TRIM_S: refused here, before any server starts
        if self.gpus and not self.servers and len(self.gpus) != self.n_servers:
            raise ValueError(f"gpus: one entry per server expected ({self.n_servers}), got {self.gpus!r}")
        for i, g in enumerate(self.gpus):
            try:
                _device_indices(g)
            except ValueError as e:
                raise ValueError(f"gpus[{i}]: {e}") from None


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The verifiable reward (``areal_fast.reward``)."""

    name: str = "math"
    """'math', 'code', or 'package.module:function' for a custom reward (resolved when the config
    is loaded)."""
    timeout: float = 10.0
    """Seconds per call; a timeout scores 0 and is counted."""
    workers: int | None = None
    """Processes of the reward pool (None = from the CPU count)."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: must not be empty")
        _positive_seconds("timeout", self.timeout)
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers: must be >= 1 or null, got {self.workers!r}")


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
    dense partial-credit reward); None = reward.name. Resolved when the config is loaded."""

    def __post_init__(self):
        if self.every_steps < 0:
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps!r}")
        if self.size is not None and self.size < 1:
            raise ValueError(f"size: must be >= 1 or null, got {self.size!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1 or null, got {self.max_new_tokens!r}")
        if self.reward is not None and not self.reward:
            raise ValueError("reward: must be a reward name or null")


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
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps!r}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last: must be >= 1, got {self.keep_last!r}")


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


_RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(kw_only=True, slots=True)
class RayConfig:
    """Where and how the Ray launcher places the run (``launcher: ray``)."""

    address: str | None = None
    """Cluster to join: 'auto', 'HOST:6379' or 'ray://HOST:10001'. None = the RAY_ADDRESS environment
    variable, or a local single-node Ray started (and stopped) by the launcher."""
    num_cpus: int | None = None
    """CPUs of a local Ray started by the launcher (None = all)."""
    server_strategy: str = "SPREAD"
    """Placement strategy of the server bundles: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    trainer_strategy: str = "PACK"
    """Placement strategy of the trainer-rank bundles (PACK keeps NCCL traffic inside nodes)."""
    cpus_per_server: float | None = None
    """Logical CPUs per server bundle (None = rollout.threads_per_server)."""
    gpus_per_server: int | None = None
    """GPUs per server bundle (None = the --tp-size of server_args for SGLang, 1 for a CUDA embedded
    engine, 0 otherwise)."""
    cpus_per_rank: float | None = None
    """Logical CPUs per trainer-rank bundle (None = train.threads)."""
    host: str | None = None
    """Address servers bind and ranks meet on (None = 127.0.0.1 on a one-node cluster, else each
    node's IP)."""
    placement_timeout: float = 300.0
    """Seconds to wait for the placement groups (and autoscaled nodes) before failing."""
    grace: float = 10.0
    """Seconds between SIGTERM and SIGKILL at teardown."""

    def __post_init__(self):
        for key in ("server_strategy", "trainer_strategy"):
            if getattr(self, key) not in _RAY_STRATEGIES:
                raise ValueError(f"{key}: must be one of {_RAY_STRATEGIES}, got {getattr(self, key)!r}")
        for key in ("cpus_per_server", "cpus_per_rank"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ValueError(f"{key}: must be > 0 or null, got {v!r}")
        if self.gpus_per_server is not None and self.gpus_per_server < 0:
            raise ValueError(f"gpus_per_server: must be >= 0 or null, got {self.gpus_per_server!r}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus: must be >= 1 or null, got {self.num_cpus!r}")
        _positive_seconds("placement_timeout", self.placement_timeout)
        if self.grace < 0:
            raise ValueError(f"grace: must be >= 0 seconds, got {self.grace!r}")


LAUNCHERS = ("local", "ray")


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
    launcher: str = "local"
    """'local' (subprocesses and torchrun on this machine) or 'ray' (a Ray cluster, see ``ray``)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where the Ray launcher connects and how it places servers and trainer ranks."""

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher: must be one of {LAUNCHERS}, got {self.launcher!r}")
        last_seed = self.experiment.seed + (0 if self.rollout.servers else self.rollout.n_servers - 1)
        if last_seed > MAX_SEED:
            raise ValueError(f"experiment.seed: launched server i gets seed + i; {self.experiment.seed!r} + "
                             f"{self.rollout.n_servers - 1} is past {MAX_SEED}")
        if self.train.ppo.reward_scale == 0:
            raise ValueError("train.ppo.reward_scale: must not be 0 (every reward would be the bias: every "
                             "advantage 0, nothing learned), got 0")
        self._fill_derived()
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
        if t.optim.total_steps == 0 and t.optim.lr_schedule != "constant":  # a decay needs the run's length
            t.optim.total_steps = self.experiment.total_steps


DERIVED = {
    "train.model_path": "model.path",
    "train.seed": "experiment.seed",
    "train.sampling_temperature": "rollout.temperature",
    "train.ppo.loss.temperature": "rollout.temperature",
}
"""Keys of the trainer's configuration that a run config does not set: each is filled from the key
it maps to (one home per value; the launcher replaces ``model.path`` by the warm-start directory)."""


# ----------------------------------------------------------------------------- loading


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
    if value is None:
        raise ConfigError(f"{key}: must not be null")
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
        number = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads '1e-5' (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):  # "no limit" is written null where a field allows it
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return number
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
    if hasattr(cls, "migrate_options"):  # deprecated aliases of a section (PPOLossConfig's behav_weight_cap)
        data = cls.migrate_options(data, f"{prefix}." if prefix else "")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if key in DERIVED:
            raise ConfigError(f"{key}: set from {DERIVED[key]} (one setting per value); set {DERIVED[key]} instead")
        if k not in names:
            valid = [n for n in names if f"{prefix}.{n}" not in DERIVED]
            raise ConfigError(f"unknown key '{key}' (valid keys{' under ' + repr(prefix) if prefix else ''}: "
                              f"{', '.join(valid)})")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(_with_prefix(str(e), prefix)) from e


def _with_prefix(msg: str, prefix: str) -> str:
    """Section validators name their field first ("lr: must be ..."); add the section path. The
    trainer's own sections already write "optim.lr ..."; keep only the part below the prefix."""
    if not prefix or msg.startswith(prefix + ".") or msg.startswith(prefix + ":"):
        return msg
    tail = prefix.rsplit(".", 1)[-1]
    if msg.startswith(tail + "."):
        msg = msg[len(tail) + 1:]
    return f"{prefix}.{msg}"


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


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> AppConfig:
    """Read a YAML file (or start from defaults when ``path`` is None), apply dotted overrides,
    validate every value and resolve every name (:func:`check_names`).

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
    cfg = from_dict(AppConfig, tree)
    check_names(cfg)
    return cfg


def save_config(cfg: AppConfig, path: str | os.PathLike) -> Path:
    """Write ``cfg`` as YAML so that ``load_config(path) == cfg`` (written to a temporary file and
    renamed, so a reader never sees half a file), readable by this user only (0600). The one value
    left out is ``weights.api_key`` (written as null): a key never goes to disk. Returns the path."""
    p = Path(path)
    d = to_dict(cfg)
    d["weights"]["api_key"] = None  # never on disk: the key reaches processes in their environment only
    text = f"{RESOLVED_HEADER} (load_config reads it back exactly)\n" + yaml.safe_dump(d, sort_keys=False)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        load_workflow(cfg.rollout.workflow)
    except ValueError as e:
        raise ConfigError(f"rollout.workflow: {e}") from None
    except Exception as e:  # noqa: BLE001 - a user module that fails to import for any reason
        raise ConfigError(f"rollout.workflow: importing {cfg.rollout.workflow!r} failed: "
                          f"{type(e).__name__}: {e}") from None


def gpu_count() -> int:
    """NVIDIA devices on this machine, counted without importing torch or initialising CUDA (the
    driver lists one directory per device under /proc/driver/nvidia/gpus; device nodes otherwise)."""
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    return sum(1 for d in Path("/dev").glob("nvidia[0-9]*") if d.name[len("nvidia"):].isdigit())


def _visible(physical: int) -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return physical
    entries = [e for e in env.split(",") if e.strip()]
    if any(e.strip().startswith("-") for e in entries):  # '-1' hides every device
        return 0
    return min(len(entries), physical)


def check_machine(cfg: AppConfig, *, gpus: int | None = None) -> None:
    """What the config asks of this machine, checked before any process starts: the model and
    tokenizer directories, the data files (read once: encoding, JSON, row shape, the prompt field),
    CUDA devices and the GPU indices in ``train.gpus`` / ``rollout.gpus``, and optional packages.
    ``gpus`` overrides the detected device count (tests). With ``launcher: ray`` the servers and
    ranks run on other machines: only the Ray package is checked here."""
    import importlib.util

    def need(module: str, key: str, why: str) -> None:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}: {why} needs the `{module}` package, which is not installed")

    if cfg.launcher == "ray":
        need("ray", "launcher", "launcher 'ray'")
        return
    _check_writable_dir("experiment.output_dir", cfg.experiment.out)
    if not cfg.model.warm_start.enabled:
        _check_model_dir("model.path", cfg.model.path)
    if cfg.model.tokenizer:
        _check_model_dir("model.tokenizer", cfg.model.tokenizer, weights=False)
    for key in ("train", "eval"):
        source = getattr(cfg.data, key)
        if source and source.startswith("hf:"):
            need("datasets", f"data.{key}", f"source {source!r}")
        elif source and not source.startswith("synthetic:"):
            from areal_fast.data.datasets import build_prompts, read_rows

            try:
                rows = build_prompts(read_rows(source, cfg.data, key, cfg.experiment.seed), cfg.data, None, source)
            except (ValueError, KeyError, OSError) as e:
                raise ConfigError(f"data.{key}: {e.args[0] if isinstance(e, KeyError) else e}") from None
            _check_row_rewards(f"data.{key}", source, rows)
    physical = gpu_count() if gpus is None else gpus
    visible = physical if gpus is not None else _visible(physical)
    r, t = cfg.rollout, cfg.train
    launching = not r.servers
    server_gpus = physical if r.gpus else visible  # rollout.gpus replaces what the servers inherit
    if launching and r.engine == "sglang":
        need("sglang", "rollout.engine", "engine 'sglang'")
        if server_gpus == 0:
            raise ConfigError("rollout.engine: 'sglang' servers need a CUDA device and this machine has none "
                              "(use rollout.engine=embedded)")
    if launching and r.engine == "embedded" and r.device.startswith("cuda") and server_gpus == 0:
        raise ConfigError(f"rollout.device: {r.device!r} asked for, but this machine has no CUDA device")
    train_gpus = physical if t.gpus else visible
    if t.device and t.device.startswith("cuda") and train_gpus == 0:
        raise ConfigError(f"train.device: {t.device!r} asked for, but this machine has no CUDA device "
                          "(use train.device=cpu)")
    for key, lists in (("rollout.gpus", r.gpus if launching else []), ("train.gpus", [t.gpus] if t.gpus else [])):
        for i, text in enumerate(lists):
            indices = _device_indices(text) or []
            bad = [g for g in indices if g >= physical]
            if bad:
                where = f"{key}[{i}]" if key == "rollout.gpus" else key
                raise ConfigError(f"{where}: GPU {bad[0]} asked for, but this machine has {physical} GPU(s) "
                                  f"(indices 0..{physical - 1})" if physical else
                                  f"{where}: GPU {bad[0]} asked for, but this machine has no GPU")
    uses_cuda = (t.device or "").startswith("cuda") or (t.device is None and train_gpus > 0)
    if uses_cuda and t.world_size > 1:
        have = len(_device_indices(t.gpus) or [None] * t.world_size) if t.gpus else train_gpus
        if have < t.world_size:
            raise ConfigError(f"train.world_size: {t.world_size} GPU ranks asked for, but "
                              f"{'train.gpus lists' if t.gpus else 'this machine has'} {have} GPU(s)")


def _check_row_rewards(key: str, source: str, rows) -> None:
    """A row may name its own reward ('reward' field); each distinct name must resolve like reward.name."""
    from areal_fast.reward.registry import get_reward_fn

    first: dict = {}
    for row in rows:
        name = row.task.get("reward")
        if name is not None and name not in first:
            first[name] = row.index
    for name, index in first.items():
        try:
            get_reward_fn(name)
        except Exception as e:  # noqa: BLE001 - ValueError from the registry, anything from a user module
            raise ConfigError(f"{key}: {source} row {index}: field 'reward' = {name!r} does not resolve: {e}") from None


def _check_writable_dir(key: str, path: Path) -> None:
    """``path`` is a directory we can write in, or can be created (its nearest existing ancestor is)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} cannot be a directory: {str(p)!r} is a file")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {str(path)!r} is not writable (no write permission on {str(p)!r})")


def _check_model_dir(key: str, path: str | None, weights: bool = True) -> None:
    p = Path(path or "")
    if not p.exists():
        raise ConfigError(f"{key}: local directory {str(p)!r} does not exist (models are loaded from a local "
                          f"directory, not downloaded by name)")
    if not p.is_dir():
        raise ConfigError(f"{key}: {str(p)!r} is not a directory")
    if weights and not (p / "config.json").is_file():
        raise ConfigError(f"{key}: {str(p)!r} has no config.json (expected a Hugging Face model directory)")
