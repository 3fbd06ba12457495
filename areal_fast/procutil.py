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


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to the process group ``pgid`` (a child started with ``start_new_session``: its
    pid); False when the group is gone or not ours to signal."""
    import os

    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open descriptors (RLIMIT_NOFILE) to its hard limit, as
    SGLang does at start: every connection of a listener is a descriptor, and the soft limit (often
    1024, or less in a container) is far below what the hard limit allows. Children inherit it.
    Returns the (soft, hard) limits in force; where they cannot be read or set, they stay as they are."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. macOS refuses an unlimited soft limit for files
            pass
    return soft, hard
