"""Seccomp filter and a fresh keyring for sandboxed programs (stdlib only: ctypes, os, struct).

`sandbox.py` confines every program right before it is exec'd, after its uid switch (`confine`):

1. **A new, empty session keyring** (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``). Without it the
   program inherits the launcher's session keyring and *possesses* every key in it: it can read
   a key's payload, revoke it, link new keys; in a login-style session that keyring reaches
   root's user keyring. The new keyring belongs to the program's uid and holds nothing.
2. **A seccomp filter** (classic BPF, ``PR_SET_SECCOMP``/``SECCOMP_MODE_FILTER``, after
   ``PR_SET_NO_NEW_PRIVS``; inherited by every child, irrevocable). Denied calls fail with EPERM
   (`DENIED`); ``clone3`` fails with ENOSYS so that glibc falls back to ``clone``, whose flags a
   classic filter can read (``clone3`` passes them in memory, out of its reach); ``socket`` and
   ``socketpair`` fail with EAFNOSUPPORT for any address family but `SOCKET_FAMILIES`. A call made
   for another architecture (i386 ``int 0x80`` on x86_64, arm32 on aarch64) or through the x32
   ABI kills the process: the syscall numbers below would mean other calls there.

The filter is a deny list over an otherwise normal process: threads, fork/exec, pipes, files,
signals, mmap all work. It is a linear chain of compares (141 instructions on x86_64, JIT-compiled
by the kernel) that every syscall runs: getppid() in a C loop took 416-690 ns without it and
534-800 ns with it on our loaded 2-core VM (best of 6: +~120 ns a call; a binary search over the
numbers measured no better: the cost is mostly the filtered entry path itself). Installing it
and the keyring take ~0.2 ms, importing and building it ~0.7 ms, once per run. The list follows the spirit of
Docker's default profile (calls an unprivileged container has no business making) but is our own:

* socket families: ``socket`` and ``socketpair`` (the family is their first argument) for any
  family but AF_UNIX, AF_INET and AF_INET6. A network namespace isolates only families that are
  namespace-aware: AF_VSOCK is not, and on a VM guest it reaches the hypervisor side (host
  services listening on vsock ports) from an otherwise network-less sandbox. AF_NETLINK,
  AF_PACKET and the other ~40 families are kernel code no sandboxed program needs. Nothing the
  sandbox runs needs AF_NETLINK: Python starts without a socket, ``getaddrinfo`` of a literal or
  loopback address uses none, and glibc's ``AI_ADDRCONFIG`` probe (a NETLINK_ROUTE socket), when
  refused, assumes both IPv4 and IPv6 are configured and goes on (there is no network to reach
  either way). The error is EAFNOSUPPORT, what a kernel built without the family answers, so
  programs take the path they already have for it;
* namespaces: ``unshare`` and ``clone`` with any CLONE_NEW* flag, ``setns``, ``clone3``. A new
  user namespace would give the program a full capability set over namespaces of its own, the
  door to much of the kernel's rarely exercised code (mounting file systems, netfilter, ...);
* mounts: ``mount``, ``umount2``, ``pivot_root``, ``chroot`` and the new mount API
  (``open_tree``, ``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``mount_setattr``);
* keys: ``add_key``, ``keyctl``, ``request_key``;
* kernel attack surface and introspection: ``bpf``, ``userfaultfd``, ``perf_event_open``,
  ``io_uring_setup``/``enter``/``register``, ``fanotify_init``, ``lookup_dcookie``, ``syslog``;
* other processes: ``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``, ``pidfd_getfd``;
* the machine: ``kexec_load``, ``kexec_file_load``, ``init_module``, ``finit_module``,
  ``delete_module``, ``reboot``, ``swapon``, ``swapoff``, ``acct``, ``settimeofday``,
  ``clock_settime``, ``clock_adjtime``, ``sethostname``, ``setdomainname``, ``vhangup``,
  ``quotactl``, ``quotactl_fd``, ``open_by_handle_at``, ``name_to_handle_at``; on x86_64 also
  ``iopl``, ``ioperm``, ``uselib``, ``ustat``, ``sysfs``, ``_sysctl``.

Most of these need a capability the sandbox uid does not have; the filter makes sure a path to
one (a user namespace) does not exist, and shrinks what a kernel bug can be reached through.

Run as a script (``python -I -S seccomp.py PROGRAM ARGS...``) it confines itself and execs the
program: `sandbox.py` uses that in mode ``ns``, where ``unshare`` must create its namespaces
before the filter can forbid it. `_nsinit.py` imports it by path (no package, no site).
"""

import ctypes
import os
import struct
import sys

EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97  # the same numbers on x86_64 and aarch64 (asm-generic)
PR_GET_SECCOMP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 21, 22, 38
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
KEYCTL_JOIN_SESSION_KEYRING = 1
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes (linux/filter.h) and the offsets in struct seccomp_data
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x05 | 0x10  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x05 | 0x30
BPF_JSET_K = 0x05 | 0x40
BPF_RET_K = 0x06
OFF_NR, OFF_ARCH, OFF_ARG0_LOW = 0, 4, 16  # args[0] low word: little-endian architectures only

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWTIME = 0x10000000, 0x20000000, 0x40000000, 0x00000080
CLONE_NS_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                  | CLONE_NEWNET)
"""Flags that make ``clone`` create a namespace (CLONE_NEWTIME is clone3/unshare only: in clone's
first argument its bit is part of the exit signal)."""
UNSHARE_NS_FLAGS = CLONE_NS_FLAGS | CLONE_NEWTIME
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
"""The address families ``socket``/``socketpair`` may open; any other fails with EAFNOSUPPORT."""


class Arch:
    """One architecture's audit id and the syscall numbers the filter needs."""

    def __init__(self, name, audit_arch, numbers, x32_bit=False):
        self.name, self.audit_arch, self.numbers, self.x32_bit = name, audit_arch, numbers, x32_bit


# asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64)
_X86_64 = dict(
    clone=56, clone3=435, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161,
    open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
    add_key=248, request_key=249, keyctl=250, bpf=321, userfaultfd=323, perf_event_open=298,
    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, fanotify_init=300, lookup_dcookie=212,
    syslog=103, ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312, pidfd_getfd=438,
    kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169,
    swapon=167, swapoff=168, acct=163, settimeofday=164, clock_settime=227, clock_adjtime=305,
    sethostname=170, setdomainname=171, vhangup=153, quotactl=179, quotactl_fd=443, open_by_handle_at=304,
    name_to_handle_at=303, iopl=172, ioperm=173, uselib=134, ustat=136, sysfs=139, _sysctl=156,
    socket=41, socketpair=53)
_AARCH64 = dict(
    clone=220, clone3=435, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
    open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
    add_key=217, request_key=218, keyctl=219, bpf=280, userfaultfd=282, perf_event_open=241,
    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, fanotify_init=262, lookup_dcookie=18,
    syslog=116, ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272, pidfd_getfd=438,
    kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, reboot=142,
    swapon=224, swapoff=225, acct=89, settimeofday=170, clock_settime=112, clock_adjtime=266,
    sethostname=161, setdomainname=162, vhangup=58, quotactl=60, quotactl_fd=443, open_by_handle_at=265,
    name_to_handle_at=264, socket=198, socketpair=199)
ARCHES = {"x86_64": Arch("x86_64", 0xC000003E, _X86_64, x32_bit=True),
          "aarch64": Arch("aarch64", 0xC00000B7, _AARCH64)}

FLAG_CHECKED = ("clone", "unshare")
"""Denied (EPERM) only when their flags ask for a new namespace."""
ENOSYS_CALLS = ("clone3",)
"""Reported as not implemented: glibc then falls back to clone (threads, fork, posix_spawn)."""
FAMILY_CHECKED = ("socket", "socketpair")
"""Allowed only for `SOCKET_FAMILIES` (their first argument); EAFNOSUPPORT otherwise."""
DENIED = tuple(n for n in _X86_64 if n not in FLAG_CHECKED + ENOSYS_CALLS + FAMILY_CHECKED)
"""Always EPERM (those missing on an architecture are simply absent from its filter)."""


def _insn(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k)


def build_filter(arch):
    """The filter for ``arch`` (an `ARCHES` value) as ``struct sock_filter`` bytes, in order."""
    nr = arch.numbers
    prog = [_insn(BPF_LD_W_ABS, OFF_ARCH),
            _insn(BPF_JEQ_K, arch.audit_arch, jt=1),
            _insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
            _insn(BPF_LD_W_ABS, OFF_NR)]
    if arch.x32_bit:  # same audit arch, other numbering: x32 calls would slip past the compares
        prog += [_insn(BPF_JGE_K, X32_SYSCALL_BIT, jf=1), _insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS)]
    for name, mask in (("clone", CLONE_NS_FLAGS), ("unshare", UNSHARE_NS_FLAGS)):
        prog += [_insn(BPF_JEQ_K, nr[name], jf=4),
                 _insn(BPF_LD_W_ABS, OFF_ARG0_LOW),
                 _insn(BPF_JSET_K, mask, jf=1),
                 _insn(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM),
                 _insn(BPF_RET_K, SECCOMP_RET_ALLOW)]
    n = len(SOCKET_FAMILIES)
    for name in FAMILY_CHECKED:  # the kernel reads the family as an int: the low word of args[0]
        prog += [_insn(BPF_JEQ_K, nr[name], jf=n + 3), _insn(BPF_LD_W_ABS, OFF_ARG0_LOW)]
        prog += [_insn(BPF_JEQ_K, family, jt=n - i) for i, family in enumerate(SOCKET_FAMILIES)]
        prog += [_insn(BPF_RET_K, SECCOMP_RET_ERRNO | EAFNOSUPPORT), _insn(BPF_RET_K, SECCOMP_RET_ALLOW)]
    for name in ENOSYS_CALLS:
        prog += [_insn(BPF_JEQ_K, nr[name], jf=1), _insn(BPF_RET_K, SECCOMP_RET_ERRNO | ENOSYS)]
    for name in DENIED:
        if name in nr:
            prog += [_insn(BPF_JEQ_K, nr[name], jf=1), _insn(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM)]
    prog.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    return b"".join(prog)


def host_arch():
    """This machine's `Arch`, or None where we have no syscall table (no filter is installed)."""
    return ARCHES.get(os.uname().machine)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def supported():
    """The kernel filters syscalls (CONFIG_SECCOMP) and we know this architecture's numbers."""
    return host_arch() is not None and _libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) >= 0


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Prepared:
    """A filter ready to install: everything allocated up front, so a forked child only calls prctl."""

    def __init__(self, prog):
        self._buf = ctypes.create_string_buffer(prog, len(prog))
        self._fprog = _SockFprog(len(prog) // 8, ctypes.addressof(self._buf))

    def install(self):
        """Set no_new_privs (required for an unprivileged filter) and the filter, on this thread."""
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox: prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._fprog), 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox: installing the seccomp filter: {os.strerror(err)}")


def prepare():
    """The host's filter, prepared (raises RuntimeError on an architecture we have no table for)."""
    arch = host_arch()
    if arch is None:
        raise RuntimeError(f"sandbox: no seccomp syscall table for {os.uname().machine!r}")
    return Prepared(build_filter(arch))


def new_session_keyring():
    """Join a new, empty anonymous session keyring (dropping the inherited one).

    Where the kernel has no keys or the call is refused (ENOSYS, EPERM: a container's own filter),
    the program cannot use keys either, and we go on; any other failure raises.
    """
    arch = host_arch()
    if arch is None:
        return
    if _libc.syscall(arch.numbers["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        if err not in (ENOSYS, EPERM):
            raise OSError(err, f"sandbox: keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(err)}")


def confine(prepared):
    """A fresh keyring, then the filter (``prepared``; None: keyring only). Call after the uid switch."""
    new_session_keyring()
    if prepared is not None:
        prepared.install()


def _main(argv):
    """``seccomp.py [--no-filter] PROGRAM ARGS...``: confine this process, then exec the program."""
    filtered = argv[:1] != ["--no-filter"]
    argv = argv if filtered else argv[1:]
    try:
        confine(prepare() if filtered else None)
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, f"sandbox: cannot start {argv[0]!r}: {e}\n".encode())
        os._exit(127 if e.filename else 126)


if __name__ == "__main__":
    _main(sys.argv[1:])
