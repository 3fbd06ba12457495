"""Which SGLang release the embedded engine behaves as, and every behaviour that depends on it.

One place holds the version gates (``docs/sglang.md`` has the same table in prose). The engine
takes ``--sglang-version X.Y.Z``; the client keys the same gates off the ``version`` field of a
server's ``/server_info``.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

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


def parse_sglang_version(value: str | Version) -> Version:
    """'0.5.23' -> Version; ValueError naming the value when unparseable or outside 0.5.6..0.5.23."""
    try:
        v = value if isinstance(value, Version) else Version(str(value))
    except InvalidVersion:
        raise ValueError(f"--sglang-version {value!r} is not a version like 0.5.23") from None
    if not OLDEST_SUPPORTED <= v <= NEWEST_SUPPORTED:
        raise ValueError(f"--sglang-version {value}: supported SGLang releases are "
                         f"{OLDEST_SUPPORTED} to {NEWEST_SUPPORTED}")
    return v


@dataclass(frozen=True)
class SGLangBehaviour:
    """The version-gated behaviours of one SGLang release (see docs/sglang.md, "Version table")."""

    version: Version

    @classmethod
    def of(cls, value: str | Version) -> SGLangBehaviour:
        return cls(parse_sglang_version(value))

    def _since(self, v: str) -> bool:
        return self.version >= Version(v)

    @property
    def weight_version_spans(self) -> bool:
        """meta_info carries ``weight_versions`` spans (per-token versions across in-place updates)."""
        return self._since("0.5.19")

    @property
    def server_info_weight_version_is_launch_value(self) -> bool:
        """``/server_info``'s weight_version stays the launch value; the current one is in /model_info."""
        return self._since("0.5.19")

    @property
    def weight_update_sessions(self) -> bool:
        """begin_weight_update / end_weight_update exist and distributed updates need an open session."""
        return self._since("0.5.21")

    @property
    def generate_schema_400(self) -> bool:
        """/generate bodies are checked against a schema first: unknown sampling keys are a 400.

        Before, the unknown key reaches ``SamplingParams(**params)``: a TypeError, answered 500.
        """
        return self._since("0.5.22")

    @property
    def refuses_flush_with_running(self) -> bool:
        """An update with flush_cache while requests hold KV fails the call (the weights did load).

        Before, the scheduler asserts on the failed flush and dies.
        """
        return self._since("0.5.22")

    @property
    def checks_bucket_alignment(self) -> bool:
        """A flattened bucket whose tensor starts at a byte offset not divisible by its dtype size is
        refused before anything is received (earlier releases fail when viewing the received bytes)."""
        return self._since("0.5.23")

    @property
    def abort_in_waiting_has_weight_version(self) -> bool:
        """Requests aborted while waiting (e.g. retracted) report weight_version (missing in 0.5.6-0.5.8)."""
        return self._since("0.5.9")
