"""Run untrusted programs (model-generated code) in a contained subprocess.

Every run gets, whatever the isolation mode:
  * its own session and process group (``start_new_session``), killed as a whole on timeout;
  * a fresh temporary directory as cwd, ``HOME`` and ``TMPDIR``; a minimal environment;
  * a memory cap for the run as a whole, all its processes together (`cgroup.py`): a cgroup of
    its own with ``memory`` = ``memory_bytes`` and ``pids`` = ``nproc`` + 1 where one can be
    created; otherwise (logged once) RLIMIT_AS = ``memory_bytes`` / N per process with at most
    N = min(``nproc``, FALLBACK_NPROC, ``memory_bytes`` / 64 MiB) processes, which bounds the
    total the same way;
  * rlimits: CPU seconds, address space (``memory_bytes`` per process: one big allocation fails
    with a MemoryError before the cgroup has to kill anything), file size, processes, open
    files, no core dumps;
  * ``no_new_privs``: no setuid or file-capability binary raises its privileges;
  * stdout/stderr read through pipes with a byte cap: a program that prints more is killed
    (printing 1 GB costs ~1 MiB of our memory, not 1 GB);
  * ``PR_SET_PDEATHSIG`` = SIGKILL, so when the pool worker that launched it dies (the reward
    service kills workers on timeout) the sandbox dies with it;
  * right before the program is exec'd, after its uid switch (`seccomp.confine`): a new, empty
    session keyring of its own (the launcher's keys, and through a login session root's user
    keyring, are no longer possessed), and a seccomp filter: no namespace creation (unshare and
    clone with CLONE_NEW*, setns; clone3 answers ENOSYS so libc uses clone), no mount API, no
    keyctl/add_key/request_key, no bpf, userfaultfd, perf_event_open, io_uring, ptrace,
    process_vm_*, no kexec or module loading and other machine-wide calls (full list in
    `seccomp.py`), all EPERM; no socket of a family other than AF_UNIX/AF_INET/AF_INET6
    (EAFNOSUPPORT: AF_VSOCK would reach a VM's hypervisor whatever the network namespace); a call
    for another architecture (i386 on x86_64) or through x32 kills the process. Where the kernel
    has no seccomp or we have no syscall table for the architecture, the filter is left out and a
    warning says so (``Isolation.seccomp``).

Isolation modes, detected once per process by actually running a probe (`isolation()`):

``ns+uid`` (running as root, ``unshare`` works; the normal case on our CI and machines)
    ``unshare --mount --net --pid --ipc --fork --kill-child`` then, still root inside,
    `_nsinit.py` builds the run's own root file system, drops to uid U and execs the program:
      - network namespace: only a downed loopback, no network at all (not even 127.0.0.1);
      - PID namespace with its own /proc: the program is PID 1 and sees only its own processes
        (no other command line, environment or fd of the host); when it exits the kernel kills
        everything it left behind, so a child sleeping forever dies with it;
      - mount namespace and a new root (`rootfs.py`): only the interpreter, its module path and
        its shared libraries, read-only, at their host paths; a few /dev nodes; a fresh
        size-capped tmpfs as /tmp (the work dir is /tmp/work) and another as /dev/shm. Every
        mount is nosuid and nodev, the writable ones noexec. /work, /root, /etc, /home, /sys and
        every other host file are simply absent; all of it vanishes with the namespace;
      - uid U, unprivileged and used by no other live process. RLIMIT_NPROC is not enforced
        for root, but it is for U, and because U is unique (2**30 + 64 * launcher pid + slot)
        the limit counts only this sandbox's processes: a fork bomb stops at ``nproc``;
      - the keyring and the filter above, applied by `_nsinit.py` after the switch to U.
    After a timeout every process of U is SIGKILLed. Cost, in CPU time of the run's processes
    for a trivial program (bench/bench_reward.py, 2-core VM): ~32-37 ms, against ~29-33 ms for
    the same namespaces without the private root and ~8 ms for a bare interpreter start; the
    namespaces and the `_nsinit.py` interpreter are most of it, the ~95 mounts ~2 ms, the
    cgroup ~0.2 ms.
``ns`` (not root, user namespaces allowed)
    ``unshare --user --net --pid --ipc --fork --kill-child -- python seccomp.py``: no network,
    PID namespace as above; the keyring and the filter are applied by `seccomp.py` run as a
    script after ``unshare`` (which needs the calls the filter forbids). But the program keeps
    our uid and sees our file system (it can read and write what we can), RLIMIT_NPROC counts
    all of our uid's processes, so it is set to (our count + nproc), and the keyring swap alone
    does not keep it from our uid's keys (same uid): only the filter's keyctl denial does.
``uid`` (root, no ``unshare``): unique uid, cgroup, rlimits, keyring and filter (in the forked
    child, after the uid switch), but NO network isolation, the host's file system (what any
    user may read) and /proc; the work dir is a 0700 directory in the host's /tmp (the uid can
    still write world-writable places such as /tmp).
``plain`` (not root, no user namespaces): process group, rlimits, keyring and filter only, NO
    network isolation, our uid's file access. Root never falls back to it (nor to ``ns``):
    RLIMIT_NPROC is never enforced for uid 0, so root without a working uid switch raises
    SandboxUnavailable.
The weaker modes log a warning once; so does a run without the filter (no seccomp here, or
``AREAL_FAST_SANDBOX_SECCOMP=off``, the escape hatch should the filter break a task). In no mode
is the sandbox a defence against a kernel bug in the calls it still allows (file systems,
sockets, pipes, mmap, futex, ...: the filter is a deny list, not an allow list), nor against
timing side channels; see docs/reward.md.
``AREAL_FAST_SANDBOX_PYTHON`` picks the interpreter; otherwise the first of our own base
interpreter (never a virtualenv's: it would need the venv inside), ``/usr/bin/python3``, ... that
works in the sandbox is used.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import itertools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from . import cgroup as _cgroup
from . import rootfs
from . import seccomp as _seccomp
from .cgroup import CgroupSupport, RunCgroup

log = logging.getLogger(__name__)

_UID_BASE = 1 << 30  # far above any real account; + 64 * pid (pid < 2**22) stays < 2**32
_SLOTS_PER_PID = 64
_slot_counter = itertools.count()
_slot_lock = threading.Lock()
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_READ_CHUNK = 1 << 16
_RUN_PREFIX = "areal_sbx_"  # + launcher pid + "_": run dirs of a killed worker can be found
_MIN_GRACE_S = 0.1  # after the main process exits, how long we still drain pipes held by orphans
_PR_SET_NO_NEW_PRIVS = 38
FALLBACK_NPROC = 8
"""Process cap without a cgroup: RLIMIT_AS is then memory_bytes / 8 per process (128 MiB of the
default 1 GiB; a Python interpreter maps ~25 MiB at start), so 8 processes stay within the cap."""
FALLBACK_MIN_PROCESS_BYTES = 64 << 20
"""Without a cgroup, fewer processes rather than less than this each (a 256 MiB run: 4 of 64 MiB)."""
_PIDS_OVERHEAD = 1  # unshare, which waits inside the run's cgroup for the program


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits for one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit; the whole process group is SIGKILLed when it passes."""
    cpu_s: int | None = None
    """RLIMIT_CPU in seconds; default ceil(timeout_s) + 1 (the wall limit normally fires first)."""
    memory_bytes: int = 1 << 30
    """Memory of the whole run, all processes together (cgroup; see the module docstring for the
    fallback), and RLIMIT_AS of each process (1 GiB: a Python interpreter maps ~25 MiB)."""
    file_size_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file the program may write (SIGXFSZ beyond)."""
    nproc: int = 32
    """Processes (and threads) the program may have at once: RLIMIT_NPROC, and the run cgroup's
    pids limit (+ 1 for ``unshare``); without a cgroup, at most FALLBACK_NPROC."""
    nofile: int = 64
    """RLIMIT_NOFILE: open file descriptors per process."""
    output_bytes: int = 1 << 20
    """Cap on each of stdout and stderr; the program is killed when it writes more."""
    disk_bytes: int = 64 << 20
    """ns+uid: size of the program's /tmp tmpfs (work dir included); /dev/shm gets a quarter."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("memory_bytes", "file_size_bytes", "nproc", "nofile", "output_bytes", "disk_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(slots=True)
class SandboxResult:
    """What a sandboxed run did. ``status`` is one of ok | exit | signal | timeout | output_limit."""

    status: str
    returncode: int | None
    stdout: bytes
    stderr: bytes
    elapsed: float
    mode: str
    notes: list[str] = field(default_factory=list)
    memory_exceeded: bool = False
    """The run's cgroup OOM-killed a process: together its processes wanted more than the cap."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, slots=True)
class Isolation:
    mode: str  # ns+uid | ns | uid | plain
    python: str  # interpreter the sandboxed program can run
    network_isolated: bool
    layout: tuple[tuple[str, ...], ...] = ()
    """ns+uid only: what the run's root file system holds (`rootfs.layout`)."""
    cgroup: CgroupSupport | None = None
    """Where each run's cgroup is created; None: the RLIMIT fallback caps the run's memory."""
    seccomp: bool = True
    """Programs run under the seccomp filter (`seccomp.py`); False where the kernel or the
    architecture has none (logged). A fresh session keyring is given in every case."""


class SandboxUnavailable(RuntimeError):
    """No interpreter can be run inside the sandbox."""


def _sandbox_uid() -> int:
    with _slot_lock:
        slot = next(_slot_counter) % _SLOTS_PER_PID
    return _UID_BASE + os.getpid() * _SLOTS_PER_PID + slot


def _count_own_processes() -> int:
    uid, n = os.getuid(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n


def kill_uid(uid: int) -> None:
    """SIGKILL every process owned by ``uid`` (root only): catches orphans that left the group.

    A forked helper takes the uid and calls kill(-1), which reaches exactly the processes that
    uid may signal, i.e. its own.
    """
    if os.geteuid() != 0:
        return
    pid = os.fork()
    if pid == 0:  # child: only syscalls, then _exit (safe even if the parent has threads)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # kill(-1) reports success whenever any other process exists, so it cannot tell us
            # when none of ours is left; two passes cover a fork that raced the first one
            # (new tasks join the tail of the list the kernel walks, so one pass usually does).
            for _ in range(2):
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def cleanup_after(launcher_pid: int) -> None:
    """Remove the run directories a killed launcher (a reward worker) could not remove itself.

    Its sandboxed processes need no help: PR_SET_PDEATHSIG kills ``unshare`` (or, without
    namespaces, the program) when the launcher dies. In ns+uid mode the work dir is a tmpfs that
    vanishes with the namespace; what is left is the small staging dir (files and stdin) and the
    run's cgroup.
    """
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_RUN_PREFIX}{launcher_pid}_*")):
        shutil.rmtree(path, ignore_errors=True)
    _cgroup.cleanup_after(launcher_pid)


_NSINIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nsinit.py")  # runs as root: any python
_CONFINE = os.path.abspath(_seccomp.__file__)  # mode ns: run after unshare, confines and execs the program
_NS_WORK = "/tmp/work"  # the program's cwd/HOME inside the mount namespace


def _unshare_prefix(iso: Isolation, uid: int | None, run_dir: str, limits: SandboxLimits,
                    layout: tuple[tuple[str, ...], ...]) -> list[str]:
    if iso.mode == "ns+uid":
        return ["unshare", "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--",
                sys.executable, "-I", "-S", _NSINIT, str(uid), run_dir, str(limits.disk_bytes), rootfs.encode(layout),
                "filter" if iso.seccomp else "no-filter"]
    if iso.mode == "ns":  # the filter forbids unshare itself: installed after it, by seccomp.py
        return ["unshare", "--user", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--",
                sys.executable, "-I", "-S", _CONFINE, *([] if iso.seccomp else ["--no-filter"])]
    return []


@functools.cache
def _prepared_filter() -> _seccomp.Prepared:
    """Built once per process, so the forked child of a run only installs it (modes uid, plain)."""
    return _seccomp.prepare()


def _python_candidates() -> list[str]:
    env = os.environ.get("AREAL_FAST_SANDBOX_PYTHON")
    if env:
        return [env]
    # real paths: a virtualenv's python would look for its pyvenv.cfg and site-packages, which
    # the sandbox does not show; its base interpreter is the same Python without them
    cands = [getattr(sys, "_base_executable", "") or sys.executable, sys.executable,
             shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"]
    out = []
    for c in cands:
        c = os.path.realpath(c) if c else c
        if c and os.path.exists(c) and c not in out:
            out.append(c)
    return out


@functools.cache
def isolation() -> Isolation:
    """Detect (once per process) the strongest mode that works here and an interpreter for it."""
    root = os.geteuid() == 0
    # root never runs untrusted code as root: RLIMIT_NPROC is never enforced for uid 0 (kernel
    # exempts INIT_USER in copy_process), so without a uid of its own a fork bomb is unbounded
    modes = ["ns+uid", "uid"] if root else ["ns", "plain"]
    if shutil.which("unshare") is None:
        modes = [m for m in modes if not m.startswith("ns")]
    cg = _cgroup.support()
    filtered = _seccomp_wanted()
    for mode in modes:
        for py in _python_candidates():
            iso = Isolation(mode, py, mode.startswith("ns"), cgroup=cg, seccomp=filtered)
            if mode == "ns+uid":
                try:
                    iso = dataclasses.replace(iso, layout=rootfs.layout(py))
                except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                    log.info("reward sandbox: %s cannot be laid out for the sandbox root: %s", py, e)
                    continue
            if not _probe(iso):
                continue
            if not iso.network_isolated:
                log.warning("reward sandbox: mode %r has NO network isolation (unshare unavailable "
                            "or refused); untrusted code can open sockets", iso.mode)
            if mode != "ns+uid":
                log.warning("reward sandbox: mode %r shows the program the host's file system and /proc "
                            "(run as root with unshare for a private root)", iso.mode)
            return iso
    raise SandboxUnavailable(
        f"no interpreter runs inside the sandbox (tried {_python_candidates()} in modes {modes}); "
        "set AREAL_FAST_SANDBOX_PYTHON to a Python that an unprivileged user can execute")


def _seccomp_wanted() -> bool:
    """Whether runs get the seccomp filter: yes where it works, unless AREAL_FAST_SANDBOX_SECCOMP=off."""
    setting = os.environ.get("AREAL_FAST_SANDBOX_SECCOMP", "on")
    if setting not in ("on", "off"):
        raise ValueError(f"AREAL_FAST_SANDBOX_SECCOMP={setting!r}: expected 'on' or 'off'")
    if setting == "off":
        log.warning("reward sandbox: AREAL_FAST_SANDBOX_SECCOMP=off: no seccomp filter; programs may create "
                    "user namespaces and reach bpf, keyctl, perf_event_open")
        return False
    if not _seccomp.supported():
        log.warning("reward sandbox: no seccomp filter on %s (kernel without CONFIG_SECCOMP_FILTER or no "
                    "syscall table for this architecture): programs may create user namespaces and reach "
                    "bpf, keyctl, perf_event_open", os.uname().machine)
        return False
    return True


def _probe(iso: Isolation) -> bool:
    try:
        r = _run(iso, [iso.python, "-I", "-c", _PROBE], b"", {}, SandboxLimits(timeout_s=10.0))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("reward sandbox: probe of mode %r with %s failed: %r", iso.mode, iso.python, e)
        return False
    if r.ok and r.stdout.strip() == b"sandbox-ok":
        return True
    log.info("reward sandbox: probe of mode %r with %s failed: %s, %r %r", iso.mode, iso.python, r.status,
             r.stdout[-200:], r.stderr[-500:])
    return False


# An interpreter whose own prefix is unreadable can still start (exec happens before the caps
# are gone) and then silently pick up another install's stdlib (here: pyenv 3.11.7 binary with
# /usr/lib/python3.11 from 3.11.2). Accept only a consistent install.
_PROBE = ("import os, sys; exe = os.path.realpath(sys.executable); "
          "print('sandbox-ok' if exe.startswith(os.path.realpath(sys.base_prefix) + os.sep) else 'mixed ' + exe)")


def _preexec(limits: SandboxLimits, nproc: int, address_space: int, cg: RunCgroup | None, uid: int | None,
             confine: bool, prepared: _seccomp.Prepared | None):
    cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2
    settings = [
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, address_space),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
        (resource.RLIMIT_NOFILE, limits.nofile),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_CORE, 0),
    ]

    def fn():  # runs in the forked child before exec: syscalls only
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if cg is not None:
            cg.join()  # while still root: cgroup.procs is root's
        for which, value in settings:
            resource.setrlimit(which, (value, value))
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if uid is not None:  # mode uid (ns+uid drops in _nsinit.py, after building the root)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by the uid change
        if confine:  # modes uid and plain (the others confine after unshare: _nsinit.py, seccomp.py)
            _seccomp.confine(prepared)

    return fn


def _run_memory(iso: Isolation, limits: SandboxLimits) -> tuple[int, int]:
    """(process cap, RLIMIT_AS per process) that keep the run's total within ``memory_bytes``."""
    if iso.cgroup is not None:
        return limits.nproc, limits.memory_bytes
    nproc = max(1, min(limits.nproc, FALLBACK_NPROC, limits.memory_bytes // FALLBACK_MIN_PROCESS_BYTES))
    return nproc, limits.memory_bytes // nproc


def run_sandboxed(argv: list[str], *, stdin: bytes = b"", files: dict[str, bytes | str] | None = None,
                  limits: SandboxLimits | None = None, ro_paths: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``argv`` contained. ``files`` are written into the fresh working directory first.

    ``argv[0] == "python"`` is replaced by the interpreter chosen by `isolation()`. ``ro_paths``:
    host files or directories the program may also read (ns+uid mode: bound read-only, nosuid,
    at the same path; the other modes show the host anyway).
    """
    if not argv:
        raise ValueError("run_sandboxed: argv is empty")
    for p in ro_paths:
        if not os.path.isabs(p) or not os.path.exists(p):
            raise ValueError(f"run_sandboxed: ro_paths entry {p!r} must be an existing absolute path")
        if os.path.realpath(p).split("/")[1] in rootfs.OWN_TOPS:
            raise ValueError(f"run_sandboxed: ro_paths entry {p!r} is under /tmp, /dev or /proc, which the "
                             "sandbox mounts afresh")
    iso = isolation()
    if argv[0] == "python":
        argv = [iso.python, *argv[1:]]
    return _run(iso, argv, stdin, files or {}, limits or SandboxLimits(), ro_paths)


def _run(iso: Isolation, argv: list[str], stdin: bytes, files: dict[str, bytes | str],
         limits: SandboxLimits, ro_paths: tuple[str, ...] = ()) -> SandboxResult:
    uid = _sandbox_uid() if iso.mode in ("ns+uid", "uid") else None
    nproc, address_space = _run_memory(iso, limits)
    # same uid as us (modes ns, plain): RLIMIT_NPROC counts all our processes, so allow ours + nproc
    rlimit_nproc = nproc if uid is not None else _count_own_processes() + nproc
    layout = iso.layout
    if ro_paths and iso.mode == "ns+uid":
        layout = rootfs.with_paths(layout, ro_paths)
    root = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}_")
    cg = None
    try:
        os.chmod(root, 0o711)  # the sandbox uid may traverse to work/ but not list or read stdin
        in_ns = iso.mode == "ns+uid"
        # ns+uid: files are staged in root/files and copied onto the namespace's tmpfs by _nsinit.py
        work = os.path.join(root, "files" if in_ns else "work")
        os.mkdir(work, 0o700)
        for name, data in files.items():
            if os.path.isabs(name) or ".." in name.split("/"):
                raise ValueError(f"run_sandboxed: file name {name!r} must be relative, inside the work dir")
            path = os.path.join(work, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
        if uid is not None and not in_ns:
            for dirpath, _dirs, names in os.walk(work):
                os.chown(dirpath, uid, uid)
                for n in names:
                    os.chown(os.path.join(dirpath, n), uid, uid)
        stdin_path = os.path.join(root, "stdin")
        with open(stdin_path, "wb") as f:
            f.write(stdin)
        home = _NS_WORK if in_ns else work
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home,
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        cmd = _unshare_prefix(iso, uid, root, limits, layout) + list(argv)
        if iso.cgroup is not None:
            cg = RunCgroup(iso.cgroup, memory_bytes=limits.memory_bytes, pids_max=nproc + _PIDS_OVERHEAD)
        drop_to = uid if iso.mode == "uid" else None
        confine_here = iso.mode in ("uid", "plain")
        prepared = _prepared_filter() if confine_here and iso.seccomp else None
        with open(stdin_path, "rb") as fin:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=root if in_ns else work, env=env, start_new_session=True,
                                    preexec_fn=_preexec(limits, rlimit_nproc, address_space, cg, drop_to,
                                                        confine_here, prepared))
        try:
            status, out, err = _supervise(proc, limits, start)
        finally:
            if proc.poll() is None:  # timeout, output cap, or an exception here
                _terminate(proc, uid)
            proc.wait()
            if uid is not None and not iso.network_isolated:
                kill_uid(uid)  # no PID namespace: orphans may have left the process group
        rc = proc.returncode
        if status == "ok" and rc != 0:
            status = "signal" if rc < 0 else "exit"
        notes = [] if iso.network_isolated else ["network not isolated"]
        oom = cg is not None and cg.oom_kills() > 0
        return SandboxResult(status, rc, out, err, time.perf_counter() - start, iso.mode, notes, oom)
    finally:
        if cg is not None:
            cg.remove()
        shutil.rmtree(root, ignore_errors=True)


def _terminate(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill a run that is still going, innermost first.

    In the namespace modes ``proc`` is ``unshare``, which waits for the program (PID 1 of the
    namespace). Killing the program first lets ``unshare`` reap it; SIGKILLing ``unshare``
    first would orphan PID 1 to the host's init, which in a container may never reap zombies.
    """
    if uid is not None:
        kill_uid(uid)
    else:
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _supervise(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[str, bytes, bytes]:
    """Drain stdout/stderr under the byte cap until EOF; enforce the wall-clock deadline."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in bufs:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    deadline = start + limits.timeout_s
    exited_at = None
    status = "ok"
    try:
        while sel.get_map():
            now = time.perf_counter()
            if now >= deadline:
                status = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _MIN_GRACE_S:
                break  # the main process is gone; orphans still hold the pipes (killed below)
            wait = min(deadline - now, 0.05)
            for key, _ in sel.select(wait):
                try:
                    chunk = os.read(key.fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                room = limits.output_bytes - len(buf)
                buf += chunk[:max(room, 0)]
                if len(chunk) > room:
                    status = "output_limit"
                    return status, bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])
        if status == "ok":
            # pipes closed (or grace passed): wait for the exit itself, still under the deadline
            try:
                proc.wait(timeout=max(deadline - time.perf_counter(), 0.001))
            except subprocess.TimeoutExpired:
                status = "timeout"
        return status, bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
