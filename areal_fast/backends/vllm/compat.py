"""Which vLLM release a server behaves as, and every behaviour of vLLM's HTTP API that depends on it.

The vLLM sibling of ``backends/sglang/compat.py`` (SGLang's table): one place holds the version gates, read from
vLLM's own sources (``docs/vllm.md`` has the same table in prose, with how each was found). The
embedded engine takes ``--api vllm --vllm-version X.Y.Z`` (:class:`VLLMBehaviour`); the config
loader refuses a version or a combination of options it cannot serve (:func:`vllm_refusal`); the
vLLM request builders (``backends/vllm/requests.py``) ask the same predicates.

Torch-free: the config loader imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from areal_fast.backends.releases import parse_supported_version
from areal_fast.rollout.config import APIS

OLDEST_SUPPORTED = Version("0.11.0")
NEWEST_SUPPORTED = Version("0.33.0")
DEFAULT_VLLM_VERSION = str(NEWEST_SUPPORTED)
CONTRACT_VERSIONS = ("0.11.0", "0.33.0")
"""The releases whose own request types judge our bodies in the contract tests (the oldest we
serve, before the pause and weight-transfer endpoints, and the newest)."""

# The first vLLM release with each gated behaviour (each release between two gates was read too:
# docs/vllm.md lists which releases' sources were checked for every row).
PAUSE_SINCE = Version("0.12.0")  # POST /pause, /resume, GET /is_paused (dev mode)
ABORT_REQUESTS_SINCE = Version("0.26.0")  # POST /abort_requests mounted by default (0.12-0.25: only with
# --tokens-only, whose empty list aborts nothing): before, a request is aborted by closing its connection
PAUSE_MODES_SINCE = Version("0.16.0")  # /pause?mode=abort|wait|keep (before: ?wait_for_inflight_requests=)
WEIGHT_TRANSFER_SINCE = Version("0.16.0")  # /init_weight_transfer_engine, /update_weights (dev mode)
RELOAD_FROM_PATH_SINCE = Version("0.16.0")  # collective_rpc reload_weights(weights_path=...)
WEIGHT_UPDATE_SESSIONS_SINCE = Version("0.21.0")  # /start_weight_update ... /finish_weight_update
WEIGHT_VERSION_LABEL_SINCE = Version("0.27.0")  # /update_weight_version, GET /weight_info
ROUTED_EXPERTS_ANSWER_SINCE = Version("0.27.0")  # --enable-return-routed-experts, choices[].routed_experts
ROUTED_EXPERTS_PROMPT_START_SINCE = Version("0.32.0")  # the completion request's routed_experts_prompt_start
TOKEN_WEIGHT_VERSIONS_SINCE = Version("0.33.0")  # return_weight_versions: per-choice weight_versions spans
KEEP_CLEARS_CACHE_SINCE = Version("0.20.0")  # /pause?mode=keep with clear_cache=true (the default) preempts
# the kept requests: their KV is dropped and recomputed at /resume by the weights of then (SGLang's retract)
PAUSED_REFUSES_SINCE = Version("0.33.0")  # a completion sent during an abort/wait pause is answered 503;
# before, it is queued and runs after /resume
TRANSFER_SHUTDOWN_SINCE = Version("0.32.0")  # POST /shutdown_weight_transfer_engine (read in 0.32.0 and 0.33.0;
# not in 0.11.0; releases between were not read for it, so it is sent only from here)
MODEL_ALIASES_SINCE = Version("0.32.0")  # a completion naming an unknown model: the 404 lists the served names
# ("Valid aliases: ..."; read in 0.32.0 and 0.33.0, not in 0.27.0)
IS_PAUSED_MISSES_KEEP = (Version("0.16.0"), Version("0.17.0"))  # 0.16.x: /is_paused says false in a keep pause
SPARSE_TRANSFER_SINCE = Version("0.32.0")  # --weight-transfer-config {"backend": "sparse_nccl"} takes patches in
# checkpoint coordinates (checkpoint names, full shapes, int32 flat indices, applied through the model's own loader
# with NaN marking unchanged elements: model_loader/checkpoint_weight_patch.py); read in 0.32.0 and 0.33.0 (the
# same receive code). 0.27.0's sparse_nccl patches the runtime parameters by their runtime names, tp 1 only: a
# different wire, not used; 0.28-0.31 were not read
M2N_TRANSFER_SINCE = Version("0.33.0")  # backend "nccl_m2n": every trainer rank sends its own shard (trainer ranks
# [0, T), workers after them, one nccl.m2n.reshard per parameter); needs NVIDIA's nccl.m2n runtime on both sides
# and the trainer's DTensor placements; not in 0.32.0 or earlier read releases. Not used (docs/vllm.md says why)
TRANSFER_BACKENDS = ("nccl", "sparse_nccl")
"""The weight-transfer backends (``--weight-transfer-config {"backend": ...}``, fixed at launch) our sender
speaks: the dense broadcast (every tensor whole) and the sparse one (deltas)."""

VLLM_PAUSE_MODES = ("abort", "wait", "keep")
"""vLLM's pause modes: abort in-flight requests, wait for them to finish, or keep them frozen with
their KV on the server (they go on at /resume; SGLang's in_place)."""
TWIN_TRANSFER_GROUP = "vllm_weight_transfer"
"""The name (and store prefix) of the gloo group the embedded twin joins at /init_weight_transfer_engine
on CPU; real vLLM joins a prefix-less StatelessProcessGroup and builds NCCL on it (docs/vllm.md)."""
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""vLLM mounts the pause, abort, collective_rpc and weight-transfer endpoints only with this set to 1."""


def parse_vllm_version(value: str | Version) -> Version:
    """'0.33.0' -> Version; ValueError naming the value when unparseable or outside the supported range."""
    return parse_supported_version(value, "vllm_version", "vLLM", OLDEST_SUPPORTED, NEWEST_SUPPORTED,
                                   see=" (docs/vllm.md)")


def served_release(reported: str) -> tuple[Version, str | None]:
    """The release whose behaviours a server that reports ``reported`` on ``GET /version`` gets, and
    a warning when that is not the reported one.

    Servers report local builds, nightlies and newer releases: ``0.33.0+cu126`` is 0.33.0,
    ``0.33.1.dev12+g1234`` is 0.33.1's base, and anything newer than the newest release read
    (``NEWEST_SUPPORTED``) behaves as that one (a warning says so: what changed since was not
    read). Older than ``OLDEST_SUPPORTED``, or not a version at all: ValueError naming it."""
    try:
        v = Version(str(reported).strip())
    except InvalidVersion:
        raise ValueError(f"vLLM server reports version {reported!r}, which is not a version") from None
    base = Version(v.base_version)
    if base < OLDEST_SUPPORTED:
        raise ValueError(f"vLLM server reports version {reported}: supported releases are {OLDEST_SUPPORTED} to "
                         f"{NEWEST_SUPPORTED} (docs/vllm.md)")
    if base > NEWEST_SUPPORTED:
        return NEWEST_SUPPORTED, (f"vLLM server reports version {reported}, newer than the newest release read "
                                  f"({NEWEST_SUPPORTED}): it is driven as {NEWEST_SUPPORTED}")
    return base, None


@dataclass(frozen=True)
class VLLMBehaviour:
    """The version-gated behaviours of one vLLM release (docs/vllm.md, "Version table")."""

    version: Version

    @classmethod
    def of(cls, value: str | Version) -> VLLMBehaviour:
        return cls(parse_vllm_version(value))

    @property
    def has_pause(self) -> bool:
        """/pause, /resume and /is_paused exist (dev mode); before, the server cannot be paused.
        /abort_requests comes later (:attr:`has_abort_requests`)."""
        return self.version >= PAUSE_SINCE

    @property
    def has_abort_requests(self) -> bool:
        """/abort_requests is mounted (dev mode) without --tokens-only; before, a request is aborted
        by closing its connection."""
        return self.version >= ABORT_REQUESTS_SINCE

    @property
    def keep_clears_cache(self) -> bool:
        """``/pause?mode=keep`` takes ``clear_cache`` (default true) and, true, drops the kept
        requests' KV (recomputed at /resume): an in-place keep needs ``clear_cache=false``."""
        return self.version >= KEEP_CLEARS_CACHE_SINCE

    @property
    def refuses_during_pause(self) -> bool:
        """A completion that arrives during an abort or wait pause is answered 503; before, it is
        queued and runs after /resume (under the weights of then)."""
        return self.version >= PAUSED_REFUSES_SINCE

    @property
    def has_transfer_shutdown(self) -> bool:
        """/shutdown_weight_transfer_engine releases the server's transfer group (the next
        /init_weight_transfer_engine makes a new one)."""
        return self.version >= TRANSFER_SHUTDOWN_SINCE

    @property
    def is_paused_misses_keep(self) -> bool:
        """``GET /is_paused`` answers false while the server is paused in keep mode (0.16.x)."""
        return IS_PAUSED_MISSES_KEEP[0] <= self.version < IS_PAUSED_MISSES_KEEP[1]

    @property
    def names_model_aliases(self) -> bool:
        """The 404 of a completion naming an unknown model ends with ``Valid aliases: <served names>.``"""
        return self.version >= MODEL_ALIASES_SINCE

    @property
    def has_pause_modes(self) -> bool:
        """/pause takes ``mode`` (abort, wait, keep) as a query parameter; before, a boolean
        ``wait_for_inflight_requests`` (false = abort)."""
        return self.version >= PAUSE_MODES_SINCE

    @property
    def returns_routed_experts(self) -> bool:
        """A server launched with ``--enable-return-routed-experts`` answers each choice's
        ``routed_experts`` (the releases between 0.11 and 0.27 were not read)."""
        return self.version >= ROUTED_EXPERTS_ANSWER_SINCE

    @property
    def has_routed_experts_prompt_start(self) -> bool:
        """The completion request takes ``routed_experts_prompt_start`` (0.27 answers routing without it)."""
        return self.version >= ROUTED_EXPERTS_PROMPT_START_SINCE

    @property
    def has_weight_transfer(self) -> bool:
        """/init_weight_transfer_engine and /update_weights (NCCL or CUDA IPC) exist."""
        return self.version >= WEIGHT_TRANSFER_SINCE

    @property
    def reloads_from_path(self) -> bool:
        """``collective_rpc`` method ``reload_weights`` takes ``weights_path``; before, it takes no
        argument and a new path is set first with method ``update_config`` (model_config.model)."""
        return self.version >= RELOAD_FROM_PATH_SINCE

    @property
    def has_sparse_transfer(self) -> bool:
        """The ``sparse_nccl`` backend takes checkpoint-coordinate patches (names, full shapes, flat
        indices): what a delta update sends (``backends/vllm/sparse.py``)."""
        return self.version >= SPARSE_TRANSFER_SINCE

    @property
    def has_m2n_transfer(self) -> bool:
        """The ``nccl_m2n`` backend (several trainer senders, each its own shard) exists; it needs
        NVIDIA's ``nccl.m2n`` runtime, which our sender does not use (docs/vllm.md)."""
        return self.version >= M2N_TRANSFER_SINCE

    @property
    def weight_update_sessions(self) -> bool:
        """/update_weights must sit between /start_weight_update and /finish_weight_update."""
        return self.version >= WEIGHT_UPDATE_SESSIONS_SINCE

    @property
    def labels_weight_version(self) -> bool:
        """/update_weight_version sets the label, GET /weight_info reads it (finish_weight_update takes
        ``weight_version`` too where sessions exist)."""
        return self.version >= WEIGHT_VERSION_LABEL_SINCE

    @property
    def token_weight_versions(self) -> bool:
        """/v1/completions takes ``return_weight_versions``: each choice carries ``weight_versions``
        spans ({version, start, end}) labelling every output token, across kept pauses."""
        return self.version >= TOKEN_WEIGHT_VERSIONS_SINCE


def check_twin_transfer_backend(backend: str, behaviour: VLLMBehaviour | None) -> str:
    """``backend`` of the embedded twin's ``--weight-transfer-config`` (``behaviour``: the twin's release,
    None when it serves SGLang's API), or ValueError naming the flag."""
    if behaviour is None:
        if backend != "nccl":
            raise ValueError(f"--weight-transfer-config backend {backend!r}: a vLLM flag, served with --api vllm only")
        return backend
    if backend not in TRANSFER_BACKENDS:
        raise ValueError(f"--weight-transfer-config backend {backend!r}: the twin speaks {TRANSFER_BACKENDS}")
    if backend == "sparse_nccl" and not behaviour.has_sparse_transfer:
        raise ValueError(f"--weight-transfer-config backend 'sparse_nccl': vLLM {behaviour.version} takes no "
                         f"checkpoint-coordinate patches (from {SPARSE_TRANSFER_SINCE})")
    return backend


# our rollout.pause_mode -> vLLM's /pause mode
PAUSE_MODE_TO_VLLM = {"abort": "abort", "in_place": "keep"}


def vllm_refusal(version: str, *, pause_mode: str, weights_method: str) -> str | None:
    """Why a run cannot be served by vLLM ``version`` with these options, or None.

    - ``pause_mode`` 'retract' is SGLang's (vLLM has no retraction); 'in_place' needs vLLM's keep
      mode AND per-token weight-version spans (a kept request's tokens straddle an update, and
      without spans the client could not label them): 0.33.0 on;
    - ``weights_method`` 'distributed' needs the weight-transfer endpoints (0.16.0 on; the sender is
      ``backends/vllm/transfer.py``);
    - a run needs the server's weight label (0.27.0 on) to tag tokens with their version; so a
      distributed run is served from 0.27.0 on too (its updates end with /finish_weight_update,
      0.21.0 on, which carries the label).
    The request builders, the client adapter and the embedded twin serve the whole range; these
    are the rules of a training run.
    """
    try:
        b = VLLMBehaviour.of(version)
    except ValueError as e:
        return str(e)
    if pause_mode == "retract":
        return "rollout.pause_mode 'retract' is SGLang's; vLLM pauses with abort, wait or keep (use 'abort', " \
               "'in_place' = vLLM's keep, or 'auto')"
    if pause_mode == "in_place" and not b.token_weight_versions:
        return (f"rollout.pause_mode 'in_place' (vLLM's keep) needs per-token weight versions, which vLLM returns "
                f"from {TOKEN_WEIGHT_VERSIONS_SINCE} (return_weight_versions); {b.version} would label a kept "
                f"request's tokens wrongly")
    why = []  # both can apply (a release before the transfer is before the label too): name each
    if weights_method == "distributed" and not b.has_weight_transfer:
        why.append(f"weights.method 'distributed' needs vLLM's weight-transfer endpoints "
                   f"(/init_weight_transfer_engine, from {WEIGHT_TRANSFER_SINCE}); vLLM {b.version} has none")
    if not b.labels_weight_version:
        why.append(f"a training run labels every token with the weights that made it, and vLLM {b.version} cannot "
                   f"be told its weight version (/update_weight_version, from {WEIGHT_VERSION_LABEL_SINCE})")
    return "; and ".join(why) or None


def auto_vllm_pause_mode(version: str | Version) -> str:
    """What rollout.pause_mode 'auto' means on a vLLM server: 'in_place' (keep) where per-token
    weight versions label the kept tokens, else 'abort'."""
    return "in_place" if VLLMBehaviour.of(version).token_weight_versions else "abort"


def vllm_pause_mode(mode: str, version: str | Version) -> str:
    """``mode`` (a ``rollout.pause_mode``) as a vLLM ``version`` server pauses: 'auto' resolved."""
    return auto_vllm_pause_mode(version) if mode == "auto" else mode


SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's ``--scheduling-policy`` values (first come first served, its default; by request priority)."""


def check_rollout_backend(api: str, server: str, external: bool, vllm_version: str) -> None:
    """Which servers may serve which API (ValueError naming the ``rollout`` key and the reason):
    ``api`` is 'sglang' or 'vllm'; vLLM servers are given in ``servers``, launched as real vLLM
    (``server: vllm``, which needs api 'vllm') or as the embedded engine's vLLM twin (``server:
    embedded``), never as SGLang; ``vllm_version`` is a release we read. What that release serves
    with the run's options is :func:`vllm_refusal`'s (``backends/checks.py`` asks both, once)."""
    if api not in APIS:
        raise ValueError(f"api: must be one of {APIS}, got {api!r}")
    if api != "vllm":
        if server == "vllm" and not external:
            raise ValueError(f"server: launched vLLM servers speak vLLM's API; set api 'vllm' (got {api!r})")
        return
    if server == "sglang" and not external:
        raise ValueError("api: 'vllm' cannot be served by launched SGLang servers (server: 'sglang'); use "
                         "server 'vllm' (real vLLM servers), 'embedded' (the embedded engine's vLLM twin) or give "
                         "running vLLM servers in servers")
    try:
        VLLMBehaviour.of(vllm_version)
    except ValueError as e:
        raise ValueError(f"vllm_version: {e}") from None
