"""Build the sandbox's own root file system as root, then become the sandbox uid and exec the program.

Run by `sandbox.py` as ``unshare --mount --net --pid --ipc --fork --kill-child -- python -I -S
_nsinit.py UID RUN_DIR TMPFS_BYTES LAYOUT FILTER PROGRAM...``: it is PID 1 of the new PID namespace
and the program replaces it. Mounts are private to the namespace (unshare's default propagation),
so nothing leaks out, and all of them vanish with it. Stdlib only and no site: it starts in ~10 ms
(no json, re or platform: importing them would add ~5 ms per run; LAYOUT is `rootfs.encode`'s text).

The new root (RUN_DIR/root, a 1 MiB tmpfs, read-only once built) holds:
  * the paths of LAYOUT (`rootfs.py`): the interpreter, its standard library and shared
    libraries, bind-mounted read-only, nosuid, nodev, at their host paths (site-packages hidden);
  * /dev/{null,zero,full,random,urandom}: bind mounts of the host's nodes (nosuid);
  * /proc: a fresh procfs of the new PID namespace (only the sandbox's own processes);
  * /tmp (the work dir is /tmp/work) and /dev/shm: fresh size-capped tmpfs, nosuid, nodev, noexec.
Then pivot_root: the host's tree is detached and unreachable; there is no /work, /root, /etc,
/home, /sys. no_new_privs is set before exec, so no setuid or file-capability binary can give the
program more than its uid has (on top of nosuid everywhere). After the uid switch the program gets
an empty session keyring of its own and, with FILTER = ``filter``, the seccomp filter
(`seccomp.py`, imported by path: this script runs without the package).
"""

import ctypes
import os
import signal
import sys

# only seccomp.py itself is imported from there: its ctypes, os, struct, sys are already loaded,
# so no sibling (math.py, code.py) can shadow a standard module
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seccomp  # noqa: E402

del sys.path[0]

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
_ROOT_TMPFS = "size=1m,nr_inodes=4096,mode=0755"  # dirs, symlinks and empty mount points only
_RO = MS_RDONLY | MS_NOSUID | MS_NODEV
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox setup: mount {target}: {os.strerror(err)}")


def bind(source, target, flags):
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | flags)  # bind flags only apply on a remount


def pivot_root(new_root):
    nr = _SYS_PIVOT_ROOT.get(os.uname().machine)
    old = os.path.join(new_root, ".old_root")
    os.mkdir(old, 0o700)
    if nr is not None:
        if _libc.syscall(nr, new_root.encode(), old.encode()) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox setup: pivot_root: {os.strerror(err)}")
        os.chdir("/")
        if _libc.umount2(b"/.old_root", MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox setup: detach the host root: {os.strerror(err)}")
        os.rmdir("/.old_root")
    else:  # unknown syscall number: move the new root over / (the host tree stays mounted beneath)
        os.rmdir(old)
        os.chdir(new_root)
        mount(new_root, "/", None, 8192)  # MS_MOVE
        os.chroot(".")
        os.chdir("/")


def copy_tree(src, dst, uid):
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s):
            os.mkdir(d, 0o700)
            copy_tree(s, d, uid)
        else:
            with open(s, "rb") as fi, open(d, "wb") as fo:
                fo.write(fi.read())
        os.chown(d, uid, uid)


def host_ppid(stat_fd):
    # read through an fd opened on the host's /proc: getppid() is 0 for PID 1 of a namespace
    return int(os.pread(stat_fd, 4096, 0).decode().rsplit(")", 1)[1].split()[1])


def main():
    uid, run_dir, size, argv = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[6:]
    if sys.argv[5] not in ("filter", "no-filter"):
        raise ValueError(f"sandbox setup: FILTER must be 'filter' or 'no-filter', got {sys.argv[5]!r}")
    prepared = seccomp.prepare() if sys.argv[5] == "filter" else None
    ops = [line.split("\t") for line in sys.argv[4].split("\n") if line]
    stat_fd = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
    parent = host_ppid(stat_fd)
    new = os.path.join(run_dir, "root")
    os.mkdir(new, 0o755)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, _ROOT_TMPFS)
    for op in ops:
        target = new + op[1]
        if op[0] == "dir":
            os.makedirs(target, 0o755, exist_ok=True)
        elif op[0] == "link":
            os.symlink(op[2], target)
        elif op[0] == "bind":
            bind(op[1], target, _RO)
        elif op[0] == "hide":
            mount("tmpfs", target, "tmpfs", _RO | MS_NOEXEC, "size=4k,nr_inodes=8,mode=0755")
        else:
            raise ValueError(f"sandbox setup: unknown layout operation {op!r}")
    os.makedirs(new + "/dev", 0o755, exist_ok=True)
    for node in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + node):
            bind("/dev/" + node, f"{new}/dev/{node}", MS_NOSUID)
    tmp, shm = new + "/tmp", new + "/dev/shm"
    for d in (tmp, shm, new + "/proc"):
        os.mkdir(d, 0o755)
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size},mode=1777")
    mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={max(size // 4, 1 << 20)},mode=1777")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    work = tmp + "/work"
    os.mkdir(work, 0o700)
    os.chown(work, uid, uid)
    copy_tree(os.path.join(run_dir, "files"), work, uid)
    pivot_root(new)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | _RO)
    os.chdir("/tmp/work")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        os._exit(126)
    # The uid change clears the PR_SET_PDEATHSIG that unshare --kill-child set on us, and it is
    # what kills the sandbox when its launcher (a reward worker) is SIGKILLed: re-arm it, then
    # make sure unshare did not die in between (we would have been reparented).
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if host_ppid(stat_fd) != parent:
        os._exit(137)
    os.close(stat_fd)  # the last handle on the host's /proc
    try:
        seccomp.confine(prepared)  # as the sandbox uid: the new keyring is the program's own
    except OSError as e:
        os.write(2, f"{e}\n".encode())
        os._exit(126)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, f"sandbox: cannot run {argv[0]!r} ({e.strerror}): only the interpreter and the paths "
                    "given as ro_paths exist inside the sandbox\n".encode())
        os._exit(127)


main()
