"""Is a server ready, alive, gone or hung? The launchers' start-up wait (:func:`server_ready`), and
the watchdog's, the elastic supervisor's and the pool watcher's one liveness check
(``docs/deadlines.md``), all through the one health check of ``rollout.calls``.

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


def server_ready(url: str, timeout: float = 2.0) -> bool:
    """The start-up wait's question, the one health check's probe (``rollout.calls``): GET /health
    answers 200 within ``timeout``."""
    return health_now(url, liveness=False, probe_timeout_s=timeout).state == "ok"


def server_alive(url: str, timeout: float = 2.0) -> bool:
    """The watchdog's question, the one health check's liveness half: the server's process answers
    HTTP (any status, a 401 or the 503 of a server paused for a weight update included), or is
    connected and busy; False for a refused, reset or timed-out connection."""
    return health_now(url, probe=False, timeout_s=timeout).alive
