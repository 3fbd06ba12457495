"""The value every reward returns, and the coercion of user return values into it."""

from __future__ import annotations

import math
from dataclasses import dataclass

STATUSES = ("ok", "timeout", "error")
_MAX_DETAIL = 2000  # characters; details travel through a pipe per call and into logs

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CONTROLS = {c: _NAMED.get(chr(c), f"\\x{c:02x}") for c in [*range(0x20), *range(0x7f, 0xa0)]}
_CONTROLS.update({c: f"\\u{c:04x}" for c in [0x2028, 0x2029, *range(0x202a, 0x202f), *range(0x2066, 0x206a)]})


def escape_controls(text: str) -> str:
    """``text`` with every control character shown as an escape, for a log line or a stored detail
    that holds what a program, a model or a reward function wrote: C0 controls (below 0x20: ``\\n``,
    ``\\r``, ``\\t`` and ``\\x..``), DEL and the C1 controls 0x80-0x9f (``\\x..``), so that no
    terminal escape sequence (ESC, CSI) reaches a terminal and no text starts a log line of its own;
    also the Unicode line and paragraph separators and the bidirectional overrides and isolates
    (``\\u....``), which reorder or break what a reader sees. Everything else is kept, backslashes
    included. Linear (``str.translate``)."""
    return text.translate(_CONTROLS)


@dataclass(slots=True)
class RewardResult:
    """One reward. ``status``: ok (the reward was computed; value may be 0 for a wrong answer),
    timeout (the reward or the program it ran took too long; value 0), error (the reward
    function raised, its worker died, or the program under test crashed; value 0)."""

    value: float
    status: str = "ok"
    detail: str = ""
    elapsed: float = 0.0
    """Seconds from dispatch to result (the service fills it in; queueing time not included)."""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"RewardResult.status must be one of {STATUSES}, got {self.status!r}")
        if len(self.detail) > _MAX_DETAIL:
            self.detail = self.detail[:_MAX_DETAIL] + "...[truncated]"


def coerce_result(out: object, name: str) -> RewardResult:
    """Turn what a reward function returned (float, int, bool or RewardResult) into a RewardResult."""
    if isinstance(out, RewardResult):
        res = out
    elif isinstance(out, (bool, int, float)):
        res = RewardResult(float(out), "ok")
    else:
        return RewardResult(0.0, "error", f"reward {name!r} returned {type(out).__name__}, expected a float "
                                          "or RewardResult")
    if not math.isfinite(res.value):
        return RewardResult(0.0, "error", f"reward {name!r} returned a non-finite value {res.value!r}")
    if res.status != "ok":
        res.value = 0.0  # timeouts and errors always score 0
    return res
