"""Errors of writes that name what was being written: a full disk otherwise surfaces as torch's
"unexpected pos" or a bare ENOSPC with no path."""

from __future__ import annotations

import shutil
from pathlib import Path


class WriteFailed(RuntimeError):
    """Writing ``path`` failed; the message names the path, the cause and the free space left."""


def write_failed(path: str | Path, exc: BaseException) -> WriteFailed:
    """A :class:`WriteFailed` for ``path`` (raise it ``from exc``)."""
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**20:,.0f} MiB free on that file system"
    except OSError:
        free = "free space unknown"
    return WriteFailed(f"writing {path} failed ({free}): {type(exc).__name__}: {exc}")
