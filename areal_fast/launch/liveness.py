"""Is a server alive, gone or hung? The watchdog's, the elastic supervisor's and the pool
watcher's one liveness check (``docs/deadlines.md``).

A SIGSTOPped or deadlocked server still has its listening socket, so the kernel accepts our
connection: only a deadline on an answer tells it from a live one.
"""

from __future__ import annotations

from areal_fast.rollout.calls import health_now

DEFAULT_HANG_TIMEOUT_S = 30.0  # rollout.hang_timeout's default (a run passes its own)


def server_state(url: str, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> str:
    """The one health check's liveness half (GET /model_info, answered without the scheduler):
    "alive" for any HTTP answer (a 401, a 503 while paused), "refused" when no connection could be
    made (or it broke), "hung" when the connection was taken and nothing answered within
    ``hang_timeout_s`` (a SIGSTOPped or deadlocked process: its kernel still accepts connections)."""
    h = health_now(url, probe=False, timeout_s=hang_timeout_s)
    if h.state == "down":
        return "refused"
    return "hung" if h.state == "unhealthy" and not h.key_refused else "alive"


def server_is_dead(url: str, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> bool:
    """A server whose connection is refused (or reset) is gone, and so is one that took the
    connection and did not answer within ``hang_timeout_s`` (:func:`server_state`)."""
    return server_state(url, hang_timeout_s) != "alive"
