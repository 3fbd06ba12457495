"""Which SGLang release the embedded engine behaves as, and every behaviour that depends on it.

One place holds the version gates (``docs/sglang.md`` has the same table in prose): the first
release of each behaviour (``*_SINCE``) and a named predicate of a ``Version`` for it. The engine
takes ``--sglang-version X.Y.Z`` (:class:`SGLangBehaviour`); the rollout client and the weight sync
ask the same predicates about the ``version`` field of a server's ``/server_info`` (any version,
also outside the supported range: ``Version("0")`` for a server that did not say).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from areal_fast.backends.releases import parse_supported_version

OLDEST_SUPPORTED = Version("0.5.6")
NEWEST_SUPPORTED = Version("0.5.23")
DEFAULT_SGLANG_VERSION = str(NEWEST_SUPPORTED)

# Load formats SGLang's /update_weights_from_disk and launch accept that the embedded engine serves
# (HF safetensors checkpoints; "dummy" = random weights at launch). Others are refused by name.
ENGINE_LOAD_FORMATS = ("auto", "safetensors", "dummy")

# Every key SGLang's sampling params know (0.5.6 .. 0.5.23). Another key is a 500 (TypeError, plain
# "Internal Server Error") before 0.5.22 and a schema 400 from 0.5.22, so the client refuses it first.
SGLANG_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed", "beam_width",
    "watermark", "choice",
})


# The first SGLang release with each version-gated behaviour.
PAUSE_MODE_SINCE = Version("0.5.6")  # /pause_generation takes {"mode": "abort" | "retract" | "in_place"}
ABORT_IN_WAITING_VERSION_SINCE = Version("0.5.9")  # a request aborted while waiting reports weight_version
WEIGHT_VERSION_SPANS_SINCE = Version("0.5.19")  # meta_info weight_versions spans; /server_info's is the launch value
WEIGHT_UPDATE_SESSIONS_SINCE = Version("0.5.21")  # /begin_weight_update and /end_weight_update, required
# init_weights_update_group keeps {group_name: group} on every TP worker (0.5.6 and 0.5.23 read; earlier
# releases were not read), and each group broadcasts from its rank 0: one group per trainer sender
NAMED_WEIGHT_GROUPS_SINCE = Version("0.5.6")
GENERATE_SCHEMA_400_SINCE = Version("0.5.22")  # unknown sampling keys: a schema 400 (a 500 TypeError before)
REFUSES_FLUSH_WITH_RUNNING_SINCE = Version("0.5.22")  # a flush with requests holding KV fails the call
CHECKS_BUCKET_ALIGNMENT_SINCE = Version("0.5.23")  # a misaligned flattened bucket is refused up front
# --enable-return-routed-experts, return_routed_experts / routed_experts_start_len, meta_info.routed_experts
# (0.5.6 has none; the releases between were not read: the first one read to have it)
ROUTED_EXPERTS_SINCE = Version("0.5.23")
IN_PLACE_UPDATES_SINCE = WEIGHT_VERSION_SPANS_SINCE  # in_place pause + update without flush, versions exact

# What an in_place pause needs of a real SGLang server for every token to keep the version of the
# weights that made it (docs/pause_modes.md): /server_info key -> the launch flag that sets it, and why.
IN_PLACE_SERVER_FLAGS = {
    "disable_overlap_schedule": ("--disable-overlap-schedule", (
        "with overlap scheduling the batch launched before the pause is processed only after continue, so "
        "each running request's token made by the old weights would be labelled with the new version")),
    "disable_radix_cache": ("--disable-radix-cache", (
        "an update without a flush leaves prefix-cache entries computed by the old weights, which later "
        "requests reuse with nothing in their versions saying so")),
}


def reported_gate(gate: Callable[[Version], bool], version: str | None) -> bool:
    """``gate`` (a predicate of this table) asked about the ``version`` a server reports in ``/server_info``:
    a server that does not say gets the oldest behaviour (False); one whose version is not a release
    number (a source build) is taken as a new server (True)."""
    if not version:
        return False
    try:
        return gate(Version(version))
    except InvalidVersion:
        return True


def supports_pause_mode(version: Version) -> bool:
    """``/pause_generation`` takes a mode (abort, retract, in_place); before, it only aborts."""
    return version >= PAUSE_MODE_SINCE


def reports_weight_version_spans(version: Version) -> bool:
    """An answer's meta_info carries ``weight_versions`` spans: each token labelled with the weights
    that made it, across in-place updates and retractions. Before, one weight_version per answer."""
    return version >= WEIGHT_VERSION_SPANS_SINCE


def server_info_reports_launch_version(version: Version) -> bool:
    """``/server_info``'s weight_version stays the launch value; the current one is in /model_info."""
    return version >= WEIGHT_VERSION_SPANS_SINCE


def needs_weight_update_sessions(version: Version) -> bool:
    """begin_weight_update / end_weight_update exist, and distributed and tensor updates need an open session."""
    return version >= WEIGHT_UPDATE_SESSIONS_SINCE


def keeps_weight_groups_by_name(version: Version) -> bool:
    """A server holds several weight-update groups at once, by name: several trainer senders, each the
    rank 0 of its own group (``weights.senders``)."""
    return version >= NAMED_WEIGHT_GROUPS_SINCE


def refuses_unknown_sampling_keys_with_400(version: Version) -> bool:
    """/generate bodies are checked against a schema first: an unknown sampling key is a 400. Before,
    the key reaches ``SamplingParams(**params)``: a TypeError, answered 500."""
    return version >= GENERATE_SCHEMA_400_SINCE


def returns_routed_experts(version: Version) -> bool:
    """MoE routing per position: the server argument ``--enable-return-routed-experts``, the request
    fields ``return_routed_experts`` and ``routed_experts_start_len``, ``meta_info["routed_experts"]``."""
    return version >= ROUTED_EXPERTS_SINCE


def in_place_refusal(version: Version) -> str | None:
    """Why a server of SGLang ``version`` cannot take in_place pauses in training, or None.

    From 0.5.19 an answer's ``weight_versions`` spans label each token with the weights that made it
    across an in-place update. Before, an answer has one weight_version (the one at its end), so
    every token made before the update would carry the new version; 0.5.6-0.5.8 also lose the
    requests of a prefill batch in flight when paused (its batch is dropped without being merged)."""
    if version >= IN_PLACE_UPDATES_SINCE:
        return None
    return (f"SGLang {version} answers one weight_version per request, so tokens made before an in-place update "
            f"would be labelled with the new version (per-token spans from {IN_PLACE_UPDATES_SINCE})")


EMBEDDED_ENGINE_NAME = "areal_fast.embedded"
"""/server_info's ``engine`` field of the embedded engine: it has neither an overlap scheduler (a
step's tokens are appended before the next command runs) nor a prefix cache (every prefill is
computed afresh), so it needs none of :data:`IN_PLACE_SERVER_FLAGS`."""


def in_place_server_refusal(info: dict, version: Version) -> str | None:
    """Why the server described by ``info`` (its /server_info) cannot take in_place pauses, or None."""
    why = in_place_refusal(version)
    if why or info.get("engine") == EMBEDDED_ENGINE_NAME:
        return why
    for key, (flag, reason) in IN_PLACE_SERVER_FLAGS.items():
        if not info.get(key):
            return f"it runs without {flag} ({key} is not true in /server_info): {reason}"
    return None


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a command line ('--x v' or '--x=v'), the last one winning; None if absent."""
    value = None
    for i, a in enumerate(args):
        a = str(a)
        if a == flag and i + 1 < len(args):
            value = str(args[i + 1])
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def in_place_launch_refusal(engine: str, server_args: list[str], installed_sglang: str | None = None) -> str | None:
    """Why servers launched as ``engine`` with ``server_args`` cannot take in_place pauses, or None.

    The embedded engine behaves as its ``--sglang-version`` (default the newest); a real SGLang needs
    the flags of :data:`IN_PLACE_SERVER_FLAGS` and, when known here, an installed release from
    0.5.19. Servers the run does not launch are checked by the client before its first pause."""
    args = [str(a) for a in server_args]
    if engine == "embedded":
        v = _flag_value(args, "--sglang-version")
        try:
            version = parse_sglang_version(v or DEFAULT_SGLANG_VERSION)
        except ValueError:
            return None  # the engine refuses the bad value itself, naming it
        return in_place_refusal(version)
    for _key, (flag, reason) in IN_PLACE_SERVER_FLAGS.items():
        if flag not in args:
            return f"needs {flag} in rollout.server_args: {reason}"
    if installed_sglang:
        try:
            return in_place_refusal(Version(installed_sglang))
        except InvalidVersion:
            return None
    return None


def parse_sglang_version(value: str | Version) -> Version:
    """'0.5.23' -> Version; ValueError naming the value when unparseable or outside 0.5.6..0.5.23."""
    return parse_supported_version(value, "--sglang-version", "SGLang", OLDEST_SUPPORTED, NEWEST_SUPPORTED)


@dataclass(frozen=True)
class SGLangBehaviour:
    """The version-gated behaviours of one SGLang release (see docs/sglang.md, "Version table")."""

    version: Version

    @classmethod
    def of(cls, value: str | Version) -> SGLangBehaviour:
        return cls(parse_sglang_version(value))

    @property
    def weight_version_spans(self) -> bool:
        """meta_info carries ``weight_versions`` spans (per-token versions across in-place updates)."""
        return reports_weight_version_spans(self.version)

    @property
    def server_info_weight_version_is_launch_value(self) -> bool:
        """``/server_info``'s weight_version stays the launch value; the current one is in /model_info."""
        return server_info_reports_launch_version(self.version)

    @property
    def weight_update_sessions(self) -> bool:
        """begin_weight_update / end_weight_update exist and distributed updates need an open session."""
        return needs_weight_update_sessions(self.version)

    @property
    def generate_schema_400(self) -> bool:
        """/generate bodies are checked against a schema first: unknown sampling keys are a 400.

        Before, the unknown key reaches ``SamplingParams(**params)``: a TypeError, answered 500.
        """
        return refuses_unknown_sampling_keys_with_400(self.version)

    @property
    def refuses_flush_with_running(self) -> bool:
        """An update with flush_cache while requests hold KV fails the call (the weights did load).

        Before, the scheduler asserts on the failed flush and dies.
        """
        return self.version >= REFUSES_FLUSH_WITH_RUNNING_SINCE

    @property
    def checks_bucket_alignment(self) -> bool:
        """A flattened bucket whose tensor starts at a byte offset not divisible by its dtype size is
        refused before anything is received (earlier releases fail when viewing the received bytes)."""
        return self.version >= CHECKS_BUCKET_ALIGNMENT_SINCE

    @property
    def abort_in_waiting_has_weight_version(self) -> bool:
        """Requests aborted while waiting (e.g. retracted) report weight_version (missing in 0.5.6-0.5.8)."""
        return self.version >= ABORT_IN_WAITING_VERSION_SINCE
