"""Writes that name what was being written (a full disk otherwise surfaces as torch's "unexpected
pos" or a bare ENOSPC with no path), and files of a run opened without following a symlink: a file
another user planted as a symlink in the run's directory is refused, never followed
(``launch.run_dir`` checks the directory itself)."""

from __future__ import annotations

import os
import shutil
import stat
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


class UnsafeOutputDir(RuntimeError):
    """The output directory belongs to another user or every user may write into it, or a file we
    write there is a symlink or not ours."""


def open_private(path: str | os.PathLike, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """A descriptor on ``path``, created 0600 when missing; a symlink at ``path`` is refused
    (:class:`UnsafeOutputDir`) rather than followed, and so is a file of another user or a
    non-regular file. An existing
    file of ours with wider permissions is narrowed to 0600 (logs may hold what a server prints)."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeOutputDir(f"{path} is a symlink; refusing to follow it (remove it if it is yours)") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeOutputDir(f"{path}: not a regular file of this user; refusing to write to it")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    return fd


def open_private_temp(path: str | os.PathLike, flags: int = os.O_WRONLY) -> int:
    """A descriptor on a new file at ``path`` (a temporary, renamed into place when written), created
    0600 with ``O_EXCL`` and ``O_NOFOLLOW`` (:func:`open_private`): a leftover regular file of ours (an
    earlier write that died) is removed first; a symlink there is refused, never followed."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    return open_private(path, flags | os.O_EXCL)


def write_private(path: str | os.PathLike, data: bytes) -> None:
    """Replace the contents of ``path`` with ``data`` (:func:`open_private`: a symlink there is refused)."""
    fd = open_private(path, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
