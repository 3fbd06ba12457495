"""Process helpers shared by every layer that starts child processes (launchers, trainer ranks,
rollout client workers)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL this child when the process that started it dies, even by kill -9 (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - other OSes: shutdown() still cleans up on a normal exit
        pass
