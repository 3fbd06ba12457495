"""The output directory of a run: one live run at a time, and a fresh start that keeps the old run.

- :class:`RunLock`: an exclusive ``fcntl.flock`` on ``<output_dir>/.lock`` held for the life of the
  run. The kernel drops it when the process ends, however it ends (kill -9 included), so a crash
  never leaves a stale lock; a second live run on the same directory is refused with the first
  one's pid and command line.
- :func:`move_previous_run_aside`: ``experiment.resume=false`` moves everything an earlier run left
  (checkpoints, metrics, summary, final model, plots, logs...) to ``<output_dir>.previous-<time>``
  and says so, instead of deleting part of it and overwriting the rest. Only a directory that looks
  like a run (our ``config.yaml``, or nothing but what a run writes) is moved; one holding a
  repository or a home directory (``.git``, ``src``, ``.ssh``...) is refused (:class:`NotARunDir`).

Other users: :func:`check_output_dir` refuses an output directory that is not owned by this user or
that its group or every user may write to (another user could plant a symlink or a file there), a
run directory or file in it (every entry a run writes: ``checkpoints``, ``logs``, ``final``, ``slurm``,
``tracking``... and everything below them) that is a symlink, not ours, or writable by others;
:class:`RunLock` then makes the run create its files and directories writable by their owner alone
whatever the umask; and the files we write in it (the
lock, every log, metrics, samples, the summary: ``diskutil.open_private``; temporaries:
``diskutil.open_private_temp``, ``O_EXCL`` too) are opened with ``O_NOFOLLOW`` and mode 0600, so a planted
symlink is refused, never followed.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import stat
import time
from pathlib import Path

from areal_fast.checkpoint import CHECKPOINTS_DIR
from areal_fast.diskutil import UnsafeOutputDir, open_private
from areal_fast.elastic.members import SERVERS_DIR
from areal_fast.launch.base import SBATCH_OUTPUT, SECRETS_DIR, STEPS_DIR, TRAINER_CONFIG_FILE
from areal_fast.metrics.services import TRACKING_DIR

LOCK_FILE = ".lock"
KEPT_ON_FRESH_START = ("warm_start",)  # a cache keyed by its own signature, not a result of the run
RUN_CONFIG = "config.yaml"  # written by every run first thing (``launch.train``), with config.RESOLVED_HEADER
# what a run writes in its output directory (a run that died before writing config.yaml is one still);
# each is checked at the start of a run (check_output_dir), with LOCK_FILE, the warm-start cache and
# sbatch's output files (SBATCH_OUTPUT, whose names hold the job id: matched by RUN_PRODUCT_PATTERNS)
RUN_PRODUCTS = frozenset({RUN_CONFIG, TRAINER_CONFIG_FILE, CHECKPOINTS_DIR, "logs", "metrics.jsonl", "samples.jsonl",
                          "summary.json", "final", "plots", "tensorboard", "weights_sync", SECRETS_DIR, "eval",
                          SERVERS_DIR, STEPS_DIR, TRACKING_DIR})
RUN_PRODUCT_PATTERNS = (SBATCH_OUTPUT.replace("%j", "*"),)  # fnmatch patterns of names a run's job writes
# never in a run's output directory: a repository, a source tree, a home directory
NOT_A_RUN = frozenset({".git", ".hg", ".svn", "src", "setup.py", "pyproject.toml", "Makefile", "package.json",
                       ".ssh", ".bashrc", ".profile", ".config"})


class NotARunDir(RuntimeError):
    """``experiment.resume=false`` would move aside a directory that is not a run's output."""


def check_output_dir(out: str | os.PathLike) -> Path:
    """Create ``out`` when missing (and its parents; ``out`` itself writable by its owner alone), then
    refuse it (:class:`UnsafeOutputDir`) when it is not a directory owned by this user, when other
    users may write into it (its group or everyone, sticky or not: a planted ``checkpoints`` symlink
    would steer what a resume loads, a planted ``metrics.jsonl`` one where the run writes), or when a
    run entry in it (:data:`RUN_PRODUCTS`, the warm-start cache, and everything below them) is a
    symlink, not ours, or writable by others. Returns ``out``."""
    out = Path(out)
    out.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode):  # a caller that resolved the path never sees one; a link is followed once
        st = os.stat(out)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeOutputDir(f"experiment.output_dir {out} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeOutputDir(f"experiment.output_dir {out} belongs to uid {st.st_uid}, not to this user (uid "
                              f"{os.geteuid()}): its owner could replace the files a run writes there. Choose a "
                              f"directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeOutputDir(f"experiment.output_dir {out} is writable by every user (mode {mode:04o}): another "
                              f"user could plant a symlink there. Use a directory of your own (e.g. chmod go-w "
                              f"{out})")
    if st.st_mode & stat.S_IWGRP:
        raise UnsafeOutputDir(f"experiment.output_dir {out} is writable by its group (mode {mode:04o}): a member "
                              f"of the group could plant a symlink there (the run's metrics, summary or checkpoints "
                              f"written or read elsewhere). Run chmod g-w {out}")
    for name in sorted(n for n in os.listdir(out) if is_checked_entry(n)):  # what is there: what a run writes
        _check_run_entry(out, out / name)
    return out


def is_checked_entry(name: str) -> bool:
    """``check_output_dir`` checks the entry ``name`` of an output directory (and all below it): what a
    run writes, its lock and the warm-start cache."""
    return is_run_product(name) or name == LOCK_FILE or name in KEPT_ON_FRESH_START


def is_run_product(name: str) -> bool:
    """``name`` is an entry a run writes in its output directory (:data:`RUN_PRODUCTS`, or a name of
    :data:`RUN_PRODUCT_PATTERNS`: ``slurm-<job id>.out``)."""
    return name in RUN_PRODUCTS or any(fnmatch.fnmatchcase(name, p) for p in RUN_PRODUCT_PATTERNS)


def _check_run_entry(out: Path, top: Path) -> None:
    """Refuse (:class:`UnsafeOutputDir`) a symlink, an entry of another user, or one its group or every
    user may write, at ``top`` or anywhere below it (nothing when ``top`` does not exist)."""
    stack = [top]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeOutputDir(f"{p} is a symlink (to {os.readlink(p)!r}): the run would read and write where it "
                                  f"points (a planted {CHECKPOINTS_DIR} link steers what a resume loads). Remove it; "
                                  f"keep the run's files in {out} itself")
        if st.st_uid != os.geteuid():
            raise UnsafeOutputDir(f"{p} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): its "
                                  f"owner could change what the run reads back. Remove it or choose another "
                                  f"experiment.output_dir")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
            raise UnsafeOutputDir(f"{p} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): they could "
                                  f"change what the run reads back or plant a symlink there. Run chmod -R "
                                  f"{'go' if st.st_mode & stat.S_IWOTH else 'g'}-w {out}")
        if stat.S_ISDIR(st.st_mode):
            stack.extend(os.path.join(p, n) for n in os.listdir(p))


def private_umask() -> None:
    """From now on this process (and what it starts) creates files and directories writable by their
    owner alone, whatever the umask was (``umask 002`` made ``checkpoints`` group-writable)."""
    os.umask(os.umask(0o022) | 0o022)


class RunDirBusy(RuntimeError):
    """Another live run holds the output directory."""


class RunLock:
    """``with RunLock(output_dir):`` refuses (RunDirBusy) while another process holds the directory."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        check_output_dir(self.out)
        private_umask()  # what the run creates from here on: see check_output_dir
        fd = open_private(self.path, os.O_RDWR)
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
    _check_looks_like_a_run(out, entries)
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


def _check_looks_like_a_run(out: Path, entries: list[Path]) -> None:
    """Refuse (:class:`NotARunDir`) to move ``entries`` of ``out`` aside unless ``out`` looks like a
    run's output: no repository or home-directory marker, and our ``config.yaml`` or nothing but what
    a run writes."""
    from areal_fast.config import RESOLVED_HEADER

    names = {p.name for p in entries}
    foreign = sorted(names & NOT_A_RUN)
    ours = False
    try:
        with open(out / RUN_CONFIG, "rb") as f:
            ours = f.read(len(RESOLVED_HEADER)) == RESOLVED_HEADER.encode()
    except OSError:
        pass
    others = sorted(n for n in names if not is_run_product(n))
    if foreign or (others and not ours):
        why = (f"it holds {', '.join(foreign)}" if foreign else
               f"it has no {RUN_CONFIG} written by a run and holds {', '.join(others[:5])}")
        raise NotARunDir(f"experiment.resume=false would move everything in {out} aside, but it does not look like "
                         f"the output directory of a run ({why}). Choose another experiment.output_dir; nothing "
                         f"was moved")
