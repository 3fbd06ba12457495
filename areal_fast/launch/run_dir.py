"""The output directory of a run: one live run at a time, and a fresh start that keeps the old run.

- :class:`RunLock`: an exclusive ``fcntl.flock`` on ``<output_dir>/.lock`` held for the life of the
  run. The kernel drops it when the process ends, however it ends (kill -9 included), so a crash
  never leaves a stale lock; a second live run on the same directory is refused with the first
  one's pid and command line.
- :func:`move_previous_run_aside`: ``experiment.resume=false`` moves everything an earlier run left
  (checkpoints, metrics, summary, final model, plots, logs...) to ``<output_dir>.previous-<time>``
  and says so, instead of deleting part of it and overwriting the rest.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_FILE = ".lock"
KEPT_ON_FRESH_START = ("warm_start",)  # a cache keyed by its own signature, not a result of the run


class RunDirBusy(RuntimeError):
    """Another live run holds the output directory."""


class RunLock:
    """``with RunLock(output_dir):`` refuses (RunDirBusy) while another process holds the directory."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise RunDirBusy(f"experiment.output_dir {self.out} is in use by another live run ({holder}); wait "
                             f"for it to finish, stop it, or choose another experiment.output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {_cmdline()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race a new run)
            self._fd = None


def _cmdline() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def move_previous_run_aside(out: Path, say=print) -> Path | None:
    """Move what an earlier run left in ``out`` to a sibling ``<out>.previous-<time>`` (same filesystem:
    renames, nothing copied or deleted). The lock file and the warm-start cache stay. Returns the new
    directory, or None when there was nothing to move."""
    out = Path(out)
    if not out.is_dir():
        return None
    entries = sorted(p for p in out.iterdir() if p.name != LOCK_FILE and p.name not in KEPT_ON_FRESH_START)
    if not entries:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = out.with_name(f"{out.name}.previous-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = out.with_name(f"{out.name}.previous-{stamp}-{n}")
    aside.mkdir()
    for p in entries:
        os.rename(p, aside / p.name)
    say(f"experiment.resume=false: moved the previous run ({', '.join(p.name for p in entries)}) from {out} "
        f"to {aside}; nothing was deleted")
    return aside
