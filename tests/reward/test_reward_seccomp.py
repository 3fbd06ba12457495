"""The sandbox's seccomp filter (`areal_fast/reward/seccomp.py`), on its own.

* the BPF program, run by a small classic-BPF interpreter here, for x86_64 and aarch64: every
  denied call gets EPERM, clone/unshare only with namespace flags, clone3 ENOSYS, socket and
  socketpair EAFNOSUPPORT for any family but AF_UNIX/AF_INET/AF_INET6, a foreign architecture or
  an x32 call kills, ordinary calls pass;
* the syscall numbers against the system headers where they are installed;
* the kernel: a process that installed the filter gets EPERM from each denied call, called with
  arguments that give another answer without the filter (shown by a control run, as root).

`PROBE` is also run inside the sandbox by test_reward_isolation.py.
"""

import json
import os
import re
import struct
import subprocess
import sys

import pytest

from areal_fast.reward import seccomp

EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK = 1, 2, 10, 16, 17, 40
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWTIME = 0x10000000, 0x00020000, 0x40000000, 0x80
SIGCHLD = 17
THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes to clone: VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|...

# ------------------------------------------------------------------ classic BPF, interpreted
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def run_filter(prog: bytes, nr: int, arch: int, args=(0, 0, 0, 0, 0, 0)) -> int:
    """What the filter returns for one syscall (struct seccomp_data, little-endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & (2**64 - 1) for a in args])
    insns = [struct.unpack("HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == _LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == _RET:
            return k
        elif code in (_JEQ, _JGE, _JSET):
            taken = {_JEQ: acc == k, _JGE: acc >= k, _JSET: bool(acc & k)}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"opcode {code:#x} at {pc} not understood by this interpreter")
        pc += 1


ALLOW, KILL = seccomp.SECCOMP_RET_ALLOW, seccomp.SECCOMP_RET_KILL_PROCESS
ERR_EPERM, ERR_ENOSYS = seccomp.SECCOMP_RET_ERRNO | EPERM, seccomp.SECCOMP_RET_ERRNO | ENOSYS
ERR_EAFNOSUPPORT = seccomp.SECCOMP_RET_ERRNO | EAFNOSUPPORT


@pytest.mark.parametrize("arch_name", sorted(seccomp.ARCHES))
def test_filter_decisions(arch_name):
    arch = seccomp.ARCHES[arch_name]
    prog, nr = seccomp.build_filter(arch), arch.numbers
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096  # BPF_MAXINSNS

    def decide(name_or_nr, *args, on=arch.audit_arch):
        n = nr[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
        return run_filter(prog, n, on, args + (0,) * (6 - len(args)))

    for name in seccomp.DENIED:
        if name in nr:
            assert decide(name) == ERR_EPERM, name
    for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, 0x02000000, 0x04000000, 0x08000000, 0x20000000):
        assert decide("clone", flag | SIGCHLD) == ERR_EPERM, hex(flag)
        assert decide("unshare", flag) == ERR_EPERM, hex(flag)
    assert decide("unshare", CLONE_NEWTIME) == ERR_EPERM
    assert decide("clone", THREAD_FLAGS) == ALLOW  # threads
    assert decide("clone", 0x01200000 | SIGCHLD) == ALLOW  # fork: CHILD_SETTID | CHILD_CLEARTID
    assert decide("clone", 0x4111) == ALLOW  # posix_spawn: VM | VFORK | SIGCHLD
    assert decide("clone", 0xFFFFFFFF_00000000 | SIGCHLD) == ALLOW  # the kernel only reads the low word
    assert decide("unshare", 0x400) == ALLOW  # CLONE_FILES: no namespace
    assert decide("clone3") == ERR_ENOSYS
    for ordinary in range(0, 1024):  # read, write, open, mmap, ... and every other number: allowed
        if ordinary not in nr.values():
            assert decide(ordinary) == ALLOW, ordinary
    foreign = {"x86_64": 0x40000003, "aarch64": 0x40000028}[arch_name]  # i386, arm (32-bit compat)
    assert decide(0, on=foreign) == KILL
    assert decide(nr["keyctl"], on=foreign) == KILL
    if arch.x32_bit:
        assert decide(seccomp.X32_SYSCALL_BIT | nr["keyctl"]) == KILL
        assert decide(seccomp.X32_SYSCALL_BIT) == KILL


@pytest.mark.parametrize("arch_name", sorted(seccomp.ARCHES))
def test_socket_families_other_than_unix_and_inet_are_refused(arch_name):
    """AF_VSOCK reaches the hypervisor side of a VM whatever the network namespace; AF_NETLINK,
    AF_PACKET and the rest are kernel surface no sandboxed program needs. Both socket and
    socketpair take the family in their first argument."""
    arch = seccomp.ARCHES[arch_name]
    prog, nr = seccomp.build_filter(arch), arch.numbers
    assert {"x86_64": (41, 53), "aarch64": (198, 199)}[arch_name] == (nr["socket"], nr["socketpair"])
    for call in ("socket", "socketpair"):
        def decide(family, call=call):
            return run_filter(prog, nr[call], arch.audit_arch, (family, 1, 0, 0, 0, 0))

        for family in (AF_UNIX, AF_INET, AF_INET6):
            assert decide(family) == ALLOW, (call, family)
            assert decide(0xFFFFFFFF_00000000 | family) == ALLOW  # the kernel reads an int
        for family in (0, AF_NETLINK, AF_PACKET, AF_VSOCK, 3, 9, 38, 44, 45, 46, 0xFFFF, 0xFFFFFFFF):
            assert decide(family) == ERR_EAFNOSUPPORT, (call, family)
        assert decide(0x1_00000000 | AF_VSOCK) == ERR_EAFNOSUPPORT


def test_denied_list_names_the_issue_calls():
    must = {"add_key", "keyctl", "request_key", "setns", "mount", "umount2", "pivot_root", "bpf", "userfaultfd",
            "perf_event_open", "ptrace", "kexec_load", "kexec_file_load", "init_module", "finit_module",
            "open_by_handle_at"}
    assert must <= set(seccomp.DENIED)
    for arch in seccomp.ARCHES.values():
        assert set(arch.numbers) <= set(seccomp.DENIED) | {"clone", "unshare", "clone3", "socket", "socketpair"}


HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}


@pytest.mark.parametrize("arch_name", sorted(HEADERS))
def test_syscall_numbers_match_the_system_headers(arch_name):
    path = HEADERS[arch_name]
    if not os.path.exists(path):
        pytest.skip(f"{path} not installed")
    text = open(path).read()
    for name, number in seccomp.ARCHES[arch_name].numbers.items():
        m = re.search(rf"#define __NR(?:3264)?_{name}\s+(\d+)\b", text)
        if m is None:  # only syscalls the header is too old to know
            assert number >= 424, f"{name} missing from {path}"
            continue
        assert int(m.group(1)) == number, (name, int(m.group(1)), number)


# ------------------------------------------------------------------ the kernel
# Each call with arguments that are harmless and answer something other than EPERM without the filter
# when made as root (EFAULT: NULL or 1 as a pointer, EBADF: fd -1, EINVAL, or success). Each runs in
# a fork of its own: an unfiltered unshare must not change the probes that follow it.
PROBE_CALLS = {
    "unshare": (CLONE_NEWUSER,), "clone": (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), "clone3": (0, 0),
    "setns": (-1, 0), "mount": (0, 0, 0, 0, 0), "umount2": (0, 0), "pivot_root": (0, 0), "chroot": (0,),
    "open_tree": (-1, 0, 0), "move_mount": (-1, 0, -1, 0, 0), "fsopen": (0, 0), "fsconfig": (-1, 0, 0, 0, 0),
    "fsmount": (-1, 0, 0), "fspick": (-1, 0, 0), "mount_setattr": (-1, 0, 0, 0, 0),
    "add_key": (0, 0, 0, 0, 0), "request_key": (0, 0, 0, 0), "keyctl": (0, -3, 0),
    "bpf": (-1, 0, 0), "userfaultfd": (-1,), "perf_event_open": (0, 0, -1, -1, 0),
    "io_uring_setup": (0, 0), "io_uring_enter": (-1, 0, 0, 0, 0, 0), "io_uring_register": (-1, 0, 0, 0),
    "fanotify_init": (0xFFFFFFFF, 0), "lookup_dcookie": (0, 0, 0), "syslog": (10, 0, 0),
    "ptrace": (2, 0, 0, 0), "process_vm_readv": (0, 0, 0, 0, 0, 0), "process_vm_writev": (0, 0, 0, 0, 0, 0),
    "kcmp": (0, 0, 0, 0, 0), "pidfd_getfd": (-1, 0, 0), "kexec_load": (0, 0, 0, 0xFFFFFFFF),
    "kexec_file_load": (-1, -1, 0, 0, 0xFFFFFFFF), "init_module": (0, 0, 0), "finit_module": (-1, 0, 0),
    "delete_module": (1, 0), "reboot": (0, 0, 0, 0), "swapon": (1, 0), "swapoff": (1,), "acct": (1,),
    "settimeofday": (1, 0), "clock_settime": (0, 1), "clock_adjtime": (0, 1), "sethostname": (0, -1),
    "setdomainname": (0, -1), "quotactl": (0, 0, 0, 0), "quotactl_fd": (-1, 0, 0, 0),
    "open_by_handle_at": (-1, 0, 0), "name_to_handle_at": (-1, 0, 0, 0, 0), "iopl": (4,),
    "ioperm": (0x10000, 1, 0), "uselib": (0,), "ustat": (0, 0), "sysfs": (99,), "_sysctl": (0,),
}
# vhangup is left out: as root without the filter it would hang up a controlling terminal.


def probe_source(numbers: dict) -> str:
    """A stdlib-only program that makes each probe call and prints {name: errno or 0} and its Seccomp mode."""
    calls = {n: a for n, a in PROBE_CALLS.items() if n in numbers}
    return f"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR, CALLS = {numbers!r}, {calls!r}
out = {{}}
for name, args in CALLS.items():
    pid = os.fork()
    if pid == 0:
        r = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) for a in args])
        os._exit(ctypes.get_errno() if r == -1 else 0)  # also the child of a clone that worked
    out[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
mode = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")]
print(json.dumps({{"errno": out, "seccomp": mode}}))
"""


ARCH = seccomp.host_arch()
needs_arch = pytest.mark.skipif(ARCH is None or not seccomp.supported(), reason="no seccomp filter on this machine")
INSTALL = ("import sys; sys.path.insert(0, {pkg!r}); from areal_fast.reward import seccomp; "
           "seccomp.confine(seccomp.prepare())\n")


def run_probe(filtered: bool) -> dict:
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(seccomp.__file__)))
    src = (INSTALL.format(pkg=pkg) if filtered else "") + probe_source(ARCH.numbers)
    r = subprocess.run([sys.executable, "-I", "-c", src], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return json.loads(r.stdout)


@needs_arch
def test_the_kernel_denies_each_call_once_the_filter_is_installed():
    got = run_probe(filtered=True)
    assert got["seccomp"] == ["2"]  # SECCOMP_MODE_FILTER
    expected = {name: ENOSYS if name == "clone3" else EPERM for name in got["errno"]}
    assert got["errno"] == expected


@needs_arch
@pytest.mark.skipif(os.geteuid() != 0, reason="without the filter most of these are EPERM anyway unless root")
def test_without_the_filter_the_same_calls_answer_otherwise():
    """The control: the EPERMs above are the filter's, not the kernel's capability checks."""
    got = run_probe(filtered=False)
    assert got["seccomp"] == ["0"]
    natural_eperm = {n for n, e in got["errno"].items() if e == EPERM}
    # kexec and module loading can be locked down machine-wide (kexec_load_disabled, modules_disabled,
    # lockdown): EPERM even for root there. Everything else must answer otherwise.
    assert natural_eperm <= {"kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
                             "iopl", "ioperm"}, got["errno"]
    assert got["errno"]["clone3"] != ENOSYS and got["errno"]["unshare"] == 0 and got["errno"]["keyctl"] == 0


@needs_arch
def test_an_ordinary_program_runs_under_the_filter():
    """Threads (clone3 -> ENOSYS -> clone), fork, posix_spawn, subprocess, files, a pipe."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(seccomp.__file__)))
    src = INSTALL.format(pkg=pkg) + """
import os, subprocess, sys, tempfile, threading
box = []
ts = [threading.Thread(target=box.append, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
pid = os.fork()
if pid == 0:
    os._exit(7)
forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
spawned = os.posix_spawn(sys.executable, [sys.executable, "-c", "raise SystemExit(3)"], {})
spawned = os.waitstatus_to_exitcode(os.waitpid(spawned, 0)[1])
child = subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout.strip()
with tempfile.TemporaryFile() as f:
    f.write(b"x" * 10); f.seek(0); n = len(f.read())
print(sorted(box) == list(range(8)), forked, spawned, child, n)
"""
    r = subprocess.run([sys.executable, "-I", "-c", src], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "7", "3", "child", "10"]


# socket(family) for each family (and socketpair for two): {name: errno or 0}. Printed as JSON.
SOCKET_FAMILIES = r"""
import json, socket
out = {}
for name, fam, kind in (("unix", 1, 1), ("inet", 2, 1), ("inet6", 10, 1), ("netlink", 16, 3), ("packet", 17, 3),
                        ("vsock", 40, 1)):
    try:
        socket.socket(fam, kind).close()
        out[name] = 0
    except OSError as e:
        out[name] = e.errno
for name, fam in (("pair_unix", 1), ("pair_vsock", 40)):
    try:
        [s.close() for s in socket.socketpair(fam, 1)]
        out[name] = 0
    except OSError as e:
        out[name] = e.errno
print(json.dumps(out))
"""
SOCKET_ANSWERS = {"unix": 0, "inet": 0, "inet6": 0, "netlink": EAFNOSUPPORT, "packet": EAFNOSUPPORT,
                  "vsock": EAFNOSUPPORT, "pair_unix": 0, "pair_vsock": EAFNOSUPPORT}


@needs_arch
def test_the_kernel_refuses_vsock_and_netlink_sockets_under_the_filter():
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(seccomp.__file__)))
    for filtered in (False, True):
        src = (INSTALL.format(pkg=pkg) if filtered else "") + SOCKET_FAMILIES
        r = subprocess.run([sys.executable, "-I", "-c", src], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout)
        if not filtered:  # the control: these families exist here (a kernel without vsock would say 97)
            assert got["netlink"] == 0, got
            vsock_here = got["vsock"] == 0
    assert got == SOCKET_ANSWERS, got
    if not vsock_here:
        pytest.skip("no AF_VSOCK in this kernel: the refusal above is not shown to be the filter's")


@needs_arch
def test_a_foreign_architecture_call_kills_the_process():
    """x86_64 only: an i386 ``int 0x80`` from a 64-bit process would use another syscall table."""
    if ARCH.name != "x86_64":
        pytest.skip("the i386 entry point is x86_64's")
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(seccomp.__file__)))
    # getpid through int 0x80 (i386 number 20): mov eax, 20; int 0x80; ret
    src = INSTALL.format(pkg=pkg) + """
import ctypes, mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
print("returned", fn(), flush=True)
"""
    r = subprocess.run([sys.executable, "-I", "-c", src], capture_output=True, text=True, timeout=120)
    assert r.returncode == -31 and "returned" not in r.stdout, (r.returncode, r.stdout, r.stderr[-500:])  # SIGSYS


def test_the_filter_can_be_turned_off_and_says_so(monkeypatch, caplog):
    import logging

    from areal_fast.reward import sandbox

    monkeypatch.setenv("AREAL_FAST_SANDBOX_SECCOMP", "off")
    with caplog.at_level(logging.WARNING, logger="areal_fast.reward.sandbox"):
        assert sandbox._seccomp_wanted() is False
    assert any("AREAL_FAST_SANDBOX_SECCOMP=off" in m for m in caplog.messages), caplog.messages
    monkeypatch.setenv("AREAL_FAST_SANDBOX_SECCOMP", "no")
    with pytest.raises(ValueError, match="AREAL_FAST_SANDBOX_SECCOMP='no'"):
        sandbox._seccomp_wanted()
    monkeypatch.delenv("AREAL_FAST_SANDBOX_SECCOMP")
    assert sandbox._seccomp_wanted() is seccomp.supported()
