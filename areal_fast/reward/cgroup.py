"""One cgroup per sandboxed run: caps the memory and the process count of the run as a whole.

RLIMIT_AS bounds one process; a program that forks 31 children could still use 32 times that.
A cgroup counts every page the run's processes touch (heap, stacks, tmpfs files they write) and
every task they create, whoever created it, and the kernel's OOM killer acts inside the cgroup
only, so a hostile run is killed while the host is untouched.

Where the cgroup lives, detected once per process (`support()`) and logged:

* ``AREAL_FAST_SANDBOX_CGROUP=/sys/fs/cgroup/<dir>``: a cgroup v2 directory prepared for us
  (``memory`` and ``pids`` in its ``cgroup.subtree_control``), e.g. a systemd unit with
  ``Delegate=yes`` that moved its own processes into a leaf. ``off`` disables cgroups.
* cgroup v2 (unified): a child of our own cgroup, when that cgroup delegates ``memory`` and
  ``pids`` to its children (or lets us enable them). The kernel's no-internal-process rule
  refuses that for a cgroup that holds processes itself, which is the usual case outside the
  root cgroup; we then fall back rather than move processes we do not own.
* cgroup v1 (this project's CI: hybrid mounts, ``memory`` and ``pids`` as v1 hierarchies): a
  child of our own cgroup in each hierarchy; v1 has no no-internal-process rule.
* none of these writable (not root, read-only /sys/fs/cgroup): ``None``; `sandbox.py` then bounds
  the run's total with RLIMIT_AS = cap / processes and a lower process cap.

Creating, limiting and removing a run's cgroup costs ~0.3 ms here (bench/bench_reward.py).
Per-run cgroups are named ``areal_sbx_<launcher pid>_<pid namespace>_<n>`` so that those of a
killed launcher can be found and removed (`cleanup_after`), and a process in another PID
namespace (a container sharing the hierarchy) never takes ours for stale.
"""

from __future__ import annotations

import functools
import glob
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PREFIX = "areal_sbx_"
_counter = itertools.count()
_PIDNS = os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0
_RMDIR_WAIT_S = 2.0  # a PID namespace's processes are reaped asynchronously (~1-50 ms here)


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """Where per-run cgroups are created."""

    version: int
    """2 (unified) or 1 (one hierarchy per controller)."""
    memory_parent: str
    """Directory under which each run's memory cgroup is created (v2: memory and pids both)."""
    pids_parent: str | None = None
    """v1 only: the pids hierarchy's directory (None: v2, or no writable pids hierarchy)."""

    def describe(self) -> str:
        extra = f" and pids under {self.pids_parent}" if self.pids_parent else ""
        return f"cgroup v{self.version} under {self.memory_parent}{extra}"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> dict[str, tuple[str, str]]:
    """{"cgroup2" or a v1 controller name: (mount point, root of the mount inside the hierarchy)}."""
    out: dict[str, tuple[str, str]] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        root, point = fields[3], fields[4]
        if fstype == "cgroup2":
            out.setdefault("cgroup2", (point, root))
        elif fstype == "cgroup":
            for opt in options:
                if opt in ("memory", "pids"):
                    out.setdefault(opt, (point, root))
    return out


def _own_cgroups() -> dict[str, str]:
    """{"" (v2) or a v1 controller name: our cgroup's path inside that hierarchy}."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _dir(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return os.path.normpath(os.path.join(point, rel if rel != "." else ""))


def _v2_delegates(parent: str) -> bool:
    """True when children of ``parent`` get the memory and pids controllers (enabling them if we may)."""
    try:
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        if {"memory", "pids"} <= set(enabled):
            return True
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        return True
    except OSError:
        return False


def _candidates() -> tuple[list[CgroupSupport], list[str]]:
    reasons: list[str] = []
    env = os.environ.get("AREAL_FAST_SANDBOX_CGROUP", "").strip()
    if env.lower() == "off":
        return [], ["disabled by AREAL_FAST_SANDBOX_CGROUP=off"]
    if env:
        if not os.path.isfile(os.path.join(env, "cgroup.subtree_control")):
            raise ValueError(f"AREAL_FAST_SANDBOX_CGROUP={env!r} is not a cgroup v2 directory "
                             "(no cgroup.subtree_control in it)")
        if not _v2_delegates(env):
            raise ValueError(f"AREAL_FAST_SANDBOX_CGROUP={env!r}: cannot enable the memory and pids "
                             "controllers for its children (write '+memory +pids' to its cgroup.subtree_control)")
        return [CgroupSupport(2, env)], reasons
    try:
        mounts, own = _mounts(), _own_cgroups()
    except (OSError, ValueError, IndexError) as e:
        return [], [f"cannot read our cgroups: {e}"]
    cands: list[CgroupSupport] = []
    if "cgroup2" in mounts and "" in own:
        parent = _dir(mounts["cgroup2"], own[""])
        available = set()
        try:
            available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        except OSError:
            pass
        if not {"memory", "pids"} <= available:
            reasons.append(f"cgroup v2 at {parent} offers {sorted(available)}, not memory and pids")
        elif not _v2_delegates(parent):
            reasons.append(f"cgroup v2 at {parent} holds processes, so it cannot delegate memory to children")
        else:
            cands.append(CgroupSupport(2, parent))
    if "memory" in mounts and "memory" in own:
        pids = _dir(mounts["pids"], own["pids"]) if "pids" in mounts and "pids" in own else None
        cands.append(CgroupSupport(1, _dir(mounts["memory"], own["memory"]), pids))
    elif not cands:
        reasons.append("no cgroup v1 memory hierarchy mounted")
    return cands, reasons


def _works(sup: CgroupSupport) -> CgroupSupport | None:
    """Create, limit and remove a probe cgroup; drop the pids hierarchy if only it fails."""
    try:
        RunCgroup(sup, memory_bytes=64 << 20, pids_max=8).remove()
        return sup
    except OSError as e:
        if sup.pids_parent is not None:
            log.info("reward sandbox: pids cgroup under %s not usable (%s)", sup.pids_parent, e)
            return _works(CgroupSupport(sup.version, sup.memory_parent, None))
        raise


@functools.cache
def support() -> CgroupSupport | None:
    """The cgroup setup per-run cgroups use here, or None (logged once, with the reason)."""
    cands, reasons = _candidates()
    for sup in cands:
        try:
            ok = _works(sup)
        except OSError as e:
            reasons.append(f"{sup.describe()}: {e}")
            continue
        for parent in (ok.memory_parent, ok.pids_parent):
            if parent:
                _remove_stale(parent)
        log.info("reward sandbox: each run's memory and processes are capped by a %s", ok.describe())
        return ok
    log.warning("reward sandbox: no usable cgroup (%s); the run's memory is bounded by RLIMIT_AS per "
                "process times a lower process cap instead", "; ".join(reasons) or "unknown reason")
    return None


class RunCgroup:
    """The cgroup(s) of one run: created with its limits, joined by the run's first process
    (`join` runs in the forked child before exec), read for OOM kills, then removed."""

    def __init__(self, sup: CgroupSupport, *, memory_bytes: int, pids_max: int):
        name = f"{_PREFIX}{os.getpid()}_{_PIDNS}_{next(_counter)}"
        self.dirs: list[str] = []
        self.version = sup.version
        try:
            mem = self._make(os.path.join(sup.memory_parent, name))
            if sup.version == 2:
                _write(os.path.join(mem, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.swap.max")):
                    _write(os.path.join(mem, "memory.swap.max"), "0")
                _write(os.path.join(mem, "pids.max"), str(pids_max))
            else:
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                try:  # without swap accounting the file is absent or refuses writes
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                except OSError:
                    pass
                if sup.pids_parent:
                    pids = self._make(os.path.join(sup.pids_parent, name))
                    _write(os.path.join(pids, "pids.max"), str(pids_max))
        except BaseException:
            self.remove()
            raise
        self.memory_dir = mem
        self._procs = [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def _make(self, path: str) -> str:
        os.mkdir(path)
        self.dirs.append(path)
        return path

    def join(self) -> None:
        """Move the calling process into the run's cgroup(s); for a preexec_fn (syscalls only)."""
        pid = str(os.getpid()).encode()
        for procs in self._procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def oom_kills(self) -> int:
        """How many processes of the run the kernel's OOM killer killed for exceeding the cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.memory_dir, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """SIGKILL what is left in the run's cgroups and remove them (waits for the reaping)."""
        for d in reversed(self.dirs):
            _kill_and_rmdir(d)
        self.dirs = []


def _kill_and_rmdir(d: str) -> None:
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if time.monotonic() > deadline:
                log.warning("reward sandbox: cannot remove cgroup %s (%s); left for cleanup", d, e)
                return
        try:
            pids = [int(p) for p in _read(os.path.join(d, "cgroup.procs")).split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)


def _remove_stale(parent: str) -> None:
    """Remove per-run cgroups whose launcher process (in our PID namespace) no longer exists."""
    for d in glob.glob(os.path.join(parent, f"{_PREFIX}*_{_PIDNS}_*")):
        pid = os.path.basename(d)[len(_PREFIX):].split("_")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _kill_and_rmdir(d)


def cleanup_after(launcher_pid: int) -> None:
    """Remove the cgroups of a launcher (a reward worker) that was killed mid-run."""
    sup = support()
    if sup is None:
        return
    for parent in (sup.memory_parent, sup.pids_parent):
        if parent:
            for d in glob.glob(os.path.join(parent, f"{_PREFIX}{launcher_pid}_{_PIDNS}_*")):
                _kill_and_rmdir(d)
