"""The value every reward returns, and the coercion of user return values into it."""

from __future__ import annotations

import math
from dataclasses import dataclass

STATUSES = ("ok", "timeout", "error")
_MAX_DETAIL = 2000  # characters; details travel through a pipe per call and into logs


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
