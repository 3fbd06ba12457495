"""The ``rollout`` section of a run config (:class:`RolloutConfig`): the inference servers, sampling,
the staleness bound and the rollout client's processes.

The class validates its own values in ``__post_init__`` (``ValueError`` naming the field); the
loader (``areal_fast.config``) adds the section path and the rules across sections. Torch-free.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, device_indices, option
from areal_fast.heap import period_from_env as heap_trim_period_from_env
from areal_fast.netutil import check_server_url  # the one check of a server address

__all__ = ["MIN_TEMPERATURE", "RESERVED_SERVER_ARGS", "AutoscaleConfig", "RolloutConfig", "check_server_url"]

MIN_TEMPERATURE = 0.01
"""Smallest sampling temperature of a run: SGLang samples greedily below 1e-6 while the trainer
would still divide its logits by the temperature, and logits / 1e-300 overflow to inf (NaN loss).
Below 0.01 sampling is greedy in all but name; RL needs samples that differ."""
RESERVED_SERVER_ARGS = ("--api-key", "--config")
"""Server options the launcher owns: the run's one API key reaches the servers in a private file
given with ``--config`` (``launch.base.server_key_file``)."""


DEFAULT_BUFFER_MEMORY_MB = 128.0
"""The default bound (``rollout.buffer_memory_mb``): finished columns the controller keeps in memory,
buffered groups and parked parts of running groups together. At 256 servers / 16,384 in flight with
long-tailed answers (median 4,000 tokens) the parts alone are ~50M tokens (~0.7 GB) and the batch
being trained ~0.65 GB; with this bound the peak RSS was 1.39 GB at 0.8M tokens/s (``docs/scale.md``).
Past the bound a finished episode costs a write and a read of its columns (~80 KB at 6k tokens), and
its group one more write and read; at short answers nothing spills."""

SERVERS = ("embedded", "sglang", "vllm")
"""Values of ``rollout.server``: the server programs the launcher starts."""
APIS = ("sglang", "vllm")
"""Values of ``rollout.api``: the inference APIs the client speaks."""
UNTRUNCATED = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
"""The sampling values that leave the distribution whole (no top-p, top-k or min-p truncation): the
only ones a training run samples with, as the trainer recomputes log-probs over the whole softmax."""
PAUSE_MODES = ("abort", "retract", "in_place")
"""The pause modes the client knows, SGLang's names (``rollout.client_control`` maps them onto vLLM's)."""
PAUSE_MODE_CHOICES = ("auto", *PAUSE_MODES)
"""Values of ``rollout.pause_mode``: ``auto`` picks per server release."""

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


SERVER_ENV_TAKEN = {"OMP_NUM_THREADS": "from threads_per_server", "MKL_NUM_THREADS": "from threads_per_server",
                    "VLLM_SERVER_DEV_MODE": "vLLM's control endpoints need it", "AREAL_FAST_API_KEY": "the run's key",
                    "VLLM_API_KEY": "the run's key travels in a private file"}


AUTOSCALE_MAX_SERVERS = 1024
"""The most servers ``rollout.autoscale.max_servers`` may name: the launcher's cap on a target
(``areal_fast.elastic.members.MAX_SERVERS``, the same number; this section sits below that layer)."""


@dataclass(kw_only=True, slots=True)
class AutoscaleConfig:
    """The policy that sets the number of launched inference servers while the run goes on
    (``areal_fast.rollout.autoscale``, ``docs/autoscale.md``). Off by default."""

    enabled: bool = False
    """Let the run add and remove its launched servers (through the launcher's target, as
    ``areal-fast servers set`` does) between ``min_servers`` and ``max_servers``."""
    min_servers: int = option(1, ge=1, le=AUTOSCALE_MAX_SERVERS)
    """Fewest servers."""
    max_servers: int | None = option(None, ge=1, le=AUTOSCALE_MAX_SERVERS)
    """Most servers (null: ``rollout.n_servers``). With ``rollout.gpus`` set, one GPU entry per server
    up to this count is needed (a slot past the list's end cannot start)."""
    settle_steps: int = option(2, ge=1)
    """Full steps measured after a change took effect (the pool at its target) before the next decision."""
    idle_high: float = option(0.08, gt=0, lt=1)
    """Trainer idle fraction (waiting for a batch / step time) above which servers are added."""
    idle_low: float = option(0.03, ge=0, lt=1)
    """Trainer idle fraction below which servers may be removed (with a full buffer and stale groups)."""
    buffer_high: float = option(2.0, gt=0)
    """Batches waiting when the trainer asks for one, at or above which generation runs ahead."""
    stale_high: float = option(0.9, gt=0, le=1)
    """Mean staleness of the trained groups, as a fraction of eta, at or above which generation runs ahead."""
    headroom: float = option(1.1, ge=1)
    """An increase sizes the generation rate to this factor of what the trainer consumes."""
    keep: float = option(1.05, ge=1)
    """A decrease keeps at least this factor of the consumption at the last measured rate per server
    (below ``headroom``: a decrease never undoes an increase that was just enough)."""
    down_fraction: float = option(0.1, gt=0, le=1)
    """Servers removed by one decrease, as a fraction of the count (one at least)."""
    max_step_fraction: float = option(0.5, gt=0)
    """Servers added by one increase, at most this fraction of the count (one at least)."""
    start_timeout_s: float = option(900.0, gt=0)
    """Seconds (of trainer steps) the policy waits for servers it added to join the pool; past it the
    increase is taken back (the target drops to the servers in the pool) and none follows for as long again."""

    def __post_init__(self):
        check_rules(self)
        if self.idle_low >= self.idle_high:
            raise ValueError(f"idle_low: must be below idle_high ({self.idle_high}), got {self.idle_low}")
        if self.keep > self.headroom:
            raise ValueError(f"keep: must be at most headroom ({self.headroom}), got {self.keep}")
        if self.max_servers is not None and self.max_servers < self.min_servers:
            raise ValueError(f"max_servers: must be >= min_servers ({self.min_servers}), got {self.max_servers}")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Inference servers, sampling and the staleness bound."""

    server: str = option("embedded", choices=SERVERS)
    """Which server program a launched server runs: 'embedded' (``python -m areal_fast.embedded``),
    'sglang', or 'vllm' (real vLLM servers, with ``api: vllm``; ``docs/vllm.md``)."""
    api: str = option("sglang", choices=APIS)
    """The inference API the servers speak: 'sglang', or 'vllm' (vLLM's OpenAI-compatible server, or the
    embedded engine launched as vLLM's twin; ``docs/vllm.md``)."""
    vllm_version: str = "0.33.0"  # the newest release read: backends/vllm/compat.py DEFAULT_VLLM_VERSION
    """With api 'vllm': the vLLM release the servers run (0.11.0 .. 0.33.0); what it cannot serve is
    refused at load, with the reason (``areal_fast.backends.vllm.compat``)."""
    servers: list[str] = field(default_factory=list)
    """Addresses of servers that are already running ('http://host:port'); empty = launch them."""
    n_servers: int = option(1, ge=0)
    """Servers to launch."""
    device: str = "cpu"
    """Device of launched embedded engines ('cpu', 'cuda' or 'cuda:N')."""
    server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for every launched server."""
    server_env: dict[str, str] = field(default_factory=dict)
    """Extra environment entries of every launched server (e.g. vLLM's CPU backend:
    ``{VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: nobind}``; ``docs/vllm.md``)."""
    server_python: str = ""
    """The Python interpreter of launched SGLang and vLLM servers (e.g. ``/opt/vllm-venv/bin/python``:
    a server's pins may need an environment of its own); empty: the run's own interpreter."""
    gpus: list[str] = field(default_factory=list)
    """CUDA_VISIBLE_DEVICES of each launched server, e.g. ["0", "1"] or ["0,1"] for tp 2 (empty: inherit)."""
    threads_per_server: int = option(1, ge=1)
    """torch CPU threads of each embedded engine (OMP_NUM_THREADS)."""
    group_size: int = option(8, ge=1)
    """n: samples per prompt, scored together as one group (GRPO)."""
    max_new_tokens: int = option(64, ge=1)
    """Generation budget per sample."""
    temperature: float = 1.0
    """Sampling temperature, set once for the run: the trainer recomputes log-probs at the same one."""
    top_p: float = option(1.0, gt=0, le=1)
    """Nucleus sampling, in (0, 1]. A training run refuses < 1: the trainer's log-probs are over the
    whole softmax, the truncated draw's are not, and every token's weight would be biased
    (``docs/config.md``, "Sampling in a training run")."""
    top_k: int = -1
    """Top-k sampling: -1 = off (the whole vocabulary), else >= 1 (SGLang refuses 0). A training run
    refuses any but -1, for top_p's reason."""
    max_staleness: int = option(4, ge=0)
    """eta: a sample may start at most eta versions before the one that trains on it. 0 = synchronous."""
    max_concurrent: int = option(64, ge=1)
    """Groups generating at once (across all servers)."""
    strict_staleness: bool = False
    """Drop a finished group any of whose tokens is older than version - eta (counted)."""
    request_timeout: float = option(600.0, gt=0)
    """Seconds for one /generate call before it is retried elsewhere."""
    control_timeout: float = option(60.0, gt=0)
    """Seconds for one control call to a server (pause, continue, abort, flush, its facts); a server
    that does not answer in time is checked for death or a hang (``docs/deadlines.md``)."""
    hang_timeout: float = option(30.0, gt=0)
    """Seconds a server's process may leave the liveness check (GET /model_info, or /version of a vLLM
    server: answered without the scheduler) unanswered before it is declared hung (SIGSTOPped,
    deadlocked) and dropped like a dead one, by the watchdog or by a control call that timed out."""
    pause_mode: str = option("auto", choices=PAUSE_MODE_CHOICES)
    """How servers pause for a weight update: 'auto' (per server: 'retract' on SGLang >= 0.5.19, whose
    per-token version spans label retracted requests, else 'abort'), 'retract', 'abort' or 'in_place'
    (requests keep running on their KV across the update; updates then never flush the cache:
    SGLang >= 0.5.19 launched with --disable-overlap-schedule --disable-radix-cache, or the embedded
    engine; ``docs/pause_modes.md``)."""
    health_timeout: float = option(300.0, gt=0)
    """Seconds to wait for launched servers to become healthy."""
    relaunch_servers: bool = True
    """A launched server that dies is started again; it joins at the next weight update, over a re-formed
    broadcast group, before it takes requests (``docs/elastic.md``). false: the run goes on with fewer."""
    empty_pool_timeout: float = option(600.0, gt=0)
    """Seconds the run waits for a server when its pool is empty (every server died or hung) and one can
    come back (relaunched: ``relaunch_servers``; a server of ``servers`` answering again): generation
    waits, and a server that joins gets the current weights at once (``docs/elastic.md``). Past it the
    run fails. Longer than ``health_timeout`` by default, so that a relaunch can finish starting."""
    keep_servers: bool = False
    """Launched servers outlive a run that fails (trainer or controller crash, kill -9) and a resume of the
    same output_dir reuses the healthy ones, their model and weight version checked against the checkpoint
    (``docs/elastic.md``). Keeps the servers' API key in <output_dir>/.secrets while they live."""
    workflow: str = "areal_fast.workflow.single_turn:single_turn"
    """The episode each of the group_size rollouts of a task runs: 'package.module:function', an
    async function (row, engine) -> list of trajectories (``docs/workflows.md``). The default is one
    completion and one reward. Resolved when the config is loaded."""
    workflow_args: dict = field(default_factory=dict)
    """Keyword arguments passed to every call of the workflow (e.g. a turn budget)."""
    tool_timeout: float = option(10.0, gt=0)
    """Seconds per tool call of a workflow; a tool that takes longer is killed (counted as tool/timeout)."""
    client_processes: int = option(1, ge=1)
    """Processes of the rollout client: 1 = the client runs in the controller's process; N > 1 = N worker
    processes, each with its own client over a disjoint share of the servers (``docs/scale.md``)."""
    buffer_memory_mb: float | None = option(DEFAULT_BUFFER_MEMORY_MB, ge=0)
    """MB of token columns the controller keeps in memory for finished groups waiting to be trained;
    groups beyond it wait in a temporary file in output_dir, read back when trained (0 = every group;
    null = no bound). The default (128) and why: ``DEFAULT_BUFFER_MEMORY_MB``."""
    return_routed_experts: bool = False
    """MoE models: every request asks for the experts each position was routed to, and launched servers
    record them (``--enable-return-routed-experts``: the embedded engine, vLLM >= 0.32, SGLang >= 0.5.23);
    the samples carry them (``Sample.routed_experts``) for ``train.ppo.routing_replay`` (``docs/moe.md``)."""
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    """The policy that sets the number of launched servers while the run goes on (``docs/autoscale.md``)."""

    def __post_init__(self):
        check_rules(self)
        if not re.match(r"^[\w.]+:[\w.]+$", self.workflow or ""):
            raise ValueError(f"workflow: expected 'package.module:function', got {self.workflow!r}")
        for i, url in enumerate(self.servers):
            check_server_url(url, f"servers[{i}]")
        for key, value in self.server_env.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", str(key)) or not isinstance(value, str | int | float):
                raise ValueError(f"server_env: {key!r}: {value!r} is not NAME: value (a string)")
            if key in SERVER_ENV_TAKEN:
                raise ValueError(f"server_env: {key} is set by the launcher ({SERVER_ENV_TAKEN[key]})")
        self.server_env = {str(k): str(v) for k, v in self.server_env.items()}
        if self.server_python:
            if self.server not in ("sglang", "vllm"):
                raise ValueError(f"server_python: names the interpreter of launched SGLang or vLLM servers; this run's "
                                 f"server is {self.server!r}")
            if not (os.path.isfile(self.server_python) and os.access(self.server_python, os.X_OK)):
                raise ValueError(f"server_python: {self.server_python!r} is not an executable file")
        for arg in self.server_args:
            if str(arg).split("=", 1)[0] in RESERVED_SERVER_ARGS:
                raise ValueError(f"server_args: {arg!r} is set by the launcher (the run's one API key reaches the "
                                 f"servers in a private file given with --config); remove it, and give the key of "
                                 f"servers you start yourself as api_key or $AREAL_FAST_API_KEY")
        if self.n_servers < 1 and not self.servers:
            raise ValueError(f"n_servers: must be >= 1, got {self.n_servers!r}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device: must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"temperature: must be >= {MIN_TEMPERATURE} for RL sampling (lower is greedy: SGLang "
                             f"switches to greedy below 1e-6, the trainer's logits / temperature overflow), got "
                             f"{self.temperature!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k: must be -1 (off) or >= 1, got {self.top_k!r}")
        # what the servers can serve (pause mode, API, release, routing) needs the backends' facts: the
        # assembler checks it (areal_fast.config -> areal_fast.backends.checks)
        n = len(self.servers) or self.n_servers
        if not isinstance(self.client_processes, int) or not 1 <= self.client_processes <= max(n, 1):
            raise ValueError(f"client_processes: must be >= 1 and <= the number of servers ({n}), "
                             f"got {self.client_processes!r}")
        heap_trim_period_from_env()  # AREAL_FAST_HEAP_TRIM_S: refused here, before any server starts
        a = self.autoscale
        if a.enabled:
            if a.max_servers is None:
                a.max_servers = max(self.n_servers, a.min_servers)
            if not a.min_servers <= self.n_servers <= a.max_servers:
                raise ValueError(f"n_servers: the run starts with {self.n_servers} servers, outside autoscale's "
                                 f"min_servers..max_servers ({a.min_servers}..{a.max_servers})")
            if self.gpus and len(self.gpus) != a.max_servers:
                raise ValueError(f"gpus: one entry per server the policy may start expected (autoscale.max_servers "
                                 f"= {a.max_servers}), got {len(self.gpus)}: {self.gpus!r}")
        elif self.gpus and not self.servers and len(self.gpus) != self.n_servers:
            raise ValueError(f"gpus: one entry per server expected ({self.n_servers}), got {self.gpus!r}")
        for i, g in enumerate(self.gpus):
            try:
                device_indices(g)
            except ValueError as e:
                raise ValueError(f"gpus[{i}]: {e}") from None
