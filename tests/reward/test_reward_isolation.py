"""Hostile programs against what the sandbox must not let them see or take.

* memory: a run's processes together stay within the run's cap (a cgroup, or the RLIMIT fallback);
* the host: no host /proc (other processes' command lines), no /work, no repository, no /etc,
  no setuid escalation (every mount nosuid, no_new_privs set);
* the kernel (keyrings, user namespaces), in every mode this machine can run: the launcher's keyrings are out
  of reach (a fresh session keyring, keyctl denied), no user namespace, no mount, each call of the
  seccomp deny list fails with EPERM, no socket but AF_UNIX/AF_INET/AF_INET6 (AF_VSOCK reaches
  the hypervisor whatever the network namespace), and ordinary programs (threads, fork, exec) still work.

Each test waits only on events it controls (pipes, process exit), never on a timer.
"""

import dataclasses
import functools
import glob
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_reward_sandbox import FINISH, FINISH_S, assert_no_leftovers
from test_reward_seccomp import ENOSYS, EPERM, SOCKET_ANSWERS, SOCKET_FAMILIES, probe_source

from areal_fast.reward import cgroup, sandbox
from areal_fast.reward.code import code_reward
from areal_fast.reward.sandbox import SandboxLimits, run_sandboxed

ISO = sandbox.isolation()
REPO = Path(__file__).resolve().parents[2]
needs_root_fs = pytest.mark.skipif(ISO.mode != "ns+uid", reason=f"private root needs root + unshare ({ISO.mode})")
needs_cgroup = pytest.mark.skipif(ISO.cgroup is None, reason="no writable cgroup here (see the warning logged)")
MiB = 1 << 20
CAP = 256 * MiB  # the run's cap in the memory tests
CHILD_BYTES = 100 * MiB  # each child's share: under RLIMIT_AS (= CAP) alone, six of them are 600 MiB together
N_CHILDREN = 6

# Forks N children; each touches CHILD_BYTES (bytes(n) would only map zero pages), reports on its own
# pipe, then blocks until released. The parent counts the children that got their memory: a
# child the OOM killer took closes its pipe with nothing written. Prints "allocated K".
GREEDY_CHILDREN = f"""
import os
release_r, release_w = os.pipe()
pipes = []
for _ in range({N_CHILDREN}):
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        os.close(release_w)
        try:
            block = bytearray(b"\\x01") * {CHILD_BYTES}
            os.write(w, b"1")
        except MemoryError:
            os._exit(3)
        os.read(release_r, 1)  # until the parent is done counting
        os._exit(0)
    os.close(w)
    pipes.append(r)
allocated = sum(os.read(r, 1) == b"1" for r in pipes)
print("allocated", allocated, flush=True)
os.close(release_w)
"""


def run_greedy(iso, limits):
    return sandbox._run(iso, [iso.python, "-I", "-c", GREEDY_CHILDREN], b"", {}, limits)


def our_cgroups() -> list[str]:
    if ISO.cgroup is None:
        return []
    parents = [p for p in (ISO.cgroup.memory_parent, ISO.cgroup.pids_parent) if p]
    return [d for p in parents for d in glob.glob(os.path.join(p, f"areal_sbx_{os.getpid()}_*"))]


# ---------------------------------------------------------------- memory of the whole run (cgroup)
@needs_cgroup
def test_children_that_together_exceed_the_run_cap_are_killed():
    r = run_greedy(ISO, SandboxLimits(timeout_s=FINISH_S, memory_bytes=CAP))
    assert f"allocated {N_CHILDREN}".encode() not in r.stdout, r
    assert r.memory_exceeded, r  # the cgroup's OOM killer acted, inside the run only
    assert_no_leftovers()
    assert our_cgroups() == []  # the run's cgroup is gone with it
    # the host and the next run are untouched
    assert run_sandboxed(["python", "-c", "print(6 * 7)"], limits=FINISH).stdout == b"42\n"


@needs_cgroup
def test_the_same_children_fit_under_a_larger_cap():
    """The control for the test above: it fails because of the cap, not because forking failed."""
    r = run_greedy(ISO, SandboxLimits(timeout_s=FINISH_S, memory_bytes=2 * N_CHILDREN * CHILD_BYTES))
    assert r.ok and r.stdout == f"allocated {N_CHILDREN}\n".encode(), r
    assert not r.memory_exceeded


@needs_cgroup
def test_code_reward_reports_the_run_memory_cap():
    prog = GREEDY_CHILDREN + "print(42)\n"
    r = code_reward({"tests": [{"input": "", "output": "42"}], "time_limit_s": FINISH_S, "memory_mb": CAP // MiB}, prog)
    assert (r.value, r.status) == (0.0, "error") and r.detail.startswith("memory limit exceeded"), r


def test_without_a_cgroup_the_fallback_still_bounds_the_total(caplog):
    """RLIMIT_AS per process = cap / process cap: six 100 MiB children under a 512 MiB cap all fail."""
    iso = dataclasses.replace(ISO, cgroup=None)
    limits = SandboxLimits(timeout_s=FINISH_S, memory_bytes=2 * CAP)
    nproc, per_process = sandbox._run_memory(iso, limits)
    assert nproc == sandbox.FALLBACK_NPROC and nproc * per_process <= limits.memory_bytes
    for memory, nproc_cap in ((1 << 30, 32), (256 * MiB, 32), (64 * MiB, 32), (8 * MiB, 32), (1 << 30, 2)):
        n, each = sandbox._run_memory(iso, SandboxLimits(memory_bytes=memory, nproc=nproc_cap))
        assert 1 <= n <= nproc_cap and n * each <= memory, (memory, n, each)  # the total stays bounded
    r = run_greedy(iso, limits)
    assert r.ok and r.stdout == b"allocated 0\n", r
    assert_no_leftovers()


def test_cgroup_detection_can_be_turned_off_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("AREAL_FAST_SANDBOX_CGROUP", "off")
    with caplog.at_level(logging.WARNING, logger="areal_fast.reward.cgroup"):
        assert cgroup.support.__wrapped__() is None
    assert any("AREAL_FAST_SANDBOX_CGROUP=off" in m and "RLIMIT_AS" in m for m in caplog.messages), caplog.messages
    monkeypatch.setenv("AREAL_FAST_SANDBOX_CGROUP", "/nonexistent/cgroup")
    with pytest.raises(ValueError, match="AREAL_FAST_SANDBOX_CGROUP='/nonexistent/cgroup'"):
        cgroup.support.__wrapped__()


def test_mount_table_parsing_maps_our_cgroup_to_its_directory():
    mount = ("/sys/fs/cgroup/memory", "/")
    assert cgroup._dir(mount, "/a/b") == "/sys/fs/cgroup/memory/a/b"
    assert cgroup._dir(("/sys/fs/cgroup", "/"), "/") == "/sys/fs/cgroup"
    # a cgroup namespace or a bind mount exposes a subtree: paths are relative to its root
    assert cgroup._dir(("/sys/fs/cgroup", "/kubepods/pod1"), "/kubepods/pod1/c") == "/sys/fs/cgroup/c"


# ---------------------------------------------------------------- the host stays out of sight
@needs_root_fs
def test_host_processes_and_their_command_lines_are_invisible():
    token = secrets.token_hex(12)
    host = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import sys; sys.stdin.read()",
                             f"--password={token}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert host.stdout.readline() == b"up\n"  # running, its command line in place
        with open(f"/proc/{host.pid}/cmdline", "rb") as f:
            assert token.encode() in f.read()  # the secret is there for anyone on the host to read
        prog = (f"import os\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\nprint(pids)\n"
                f"try:\n    print(open('/proc/{host.pid}/cmdline').read())\nexcept OSError as e:\n"
                f"    print(type(e).__name__)\n"
                "for p in os.listdir('/proc'):\n    try:\n        print(open(f'/proc/{p}/cmdline').read())\n"
                "    except OSError:\n        pass\n")
        r = run_sandboxed(["python", "-I", "-c", prog], limits=FINISH)
        assert r.ok, r
        assert token.encode() not in r.stdout and token.encode() not in r.stderr
        lines = r.stdout.decode().splitlines()
        assert lines[0] == "[1]", r  # its own PID namespace: it is PID 1 and alone
        assert lines[1] == "FileNotFoundError", r
    finally:
        host.stdin.close()
        host.wait()
        host.stdout.close()


@needs_root_fs
def test_work_the_repository_and_host_files_are_absent():
    repo_file = REPO / "pyproject.toml"
    assert repo_file.exists()
    targets = ["/work", str(REPO), str(repo_file), "/etc/passwd", "/etc/hostname", "/home", "/root",
               os.path.expanduser("~"), "/var", "/sys/kernel", "/usr/bin/su", "/bin/su", "/usr/bin/env"]
    prog = ("import os, json\nout = {}\n"
            f"for p in {targets!r}:\n"
            "    try:\n        out[p] = sorted(os.listdir(p)) if os.path.isdir(p) else open(p).read()[:50]\n"
            "    except OSError as e:\n        out[p] = type(e).__name__\n"
            "print(json.dumps([sorted(os.listdir('/')), out]))\n")
    r = run_sandboxed(["python", "-I", "-c", prog], limits=FINISH)
    assert r.ok, r
    top, seen = json.loads(r.stdout)
    assert not {"work", "etc", "home", "var", "sys", "boot", "opt", "srv", "mnt"} & set(top), top
    for p in ["/work", str(REPO), str(repo_file), "/etc/passwd", "/etc/hostname", "/home", "/var", "/sys/kernel",
              "/usr/bin/su", "/bin/su", "/usr/bin/env"]:
        assert seen[p] == "FileNotFoundError", (p, seen[p])
    # /root may hold the skeleton of an interpreter installed under it (a pyenv), nothing else
    for p in ("/root", os.path.expanduser("~")):
        assert seen[p] in ("FileNotFoundError", [".pyenv"]), (p, seen[p])


@needs_root_fs
def test_every_mount_is_nosuid_nodev_and_no_new_privs_is_set():
    prog = ("mounts = [l.split() for l in open('/proc/self/mountinfo')]\n"
            "for m in mounts:\n    print(m[4], m[5])\n"
            "print([l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0].split()[1])\n")
    r = run_sandboxed(["python", "-I", "-c", prog], limits=FINISH)
    assert r.ok, r
    *mounts, nnp = r.stdout.decode().splitlines()
    assert nnp == "1"
    assert len(mounts) > 5
    for line in mounts:
        point, opts = line.split()
        opts = opts.split(",")
        assert "nosuid" in opts, line
        if not point.startswith("/dev/"):  # the device nodes themselves must stay usable
            assert "nodev" in opts, line
        if point in ("/", ) or not point.startswith(("/tmp", "/dev", "/proc")):
            assert "ro" in opts, line  # all but the run's own tmpfs and the device nodes are read-only


@pytest.fixture
def setuid_root_python():
    """A setuid-root copy of the sandbox's interpreter, outside the sandbox; checked to escalate there."""
    d = tempfile.mkdtemp(prefix="areal_setuid_", dir="/var/tmp")  # /tmp is the sandbox's own tmpfs
    try:
        os.chmod(d, 0o755)
        helper = os.path.join(d, "python-suid")
        shutil.copy(ISO.python, helper)
        os.chown(helper, 0, 0)
        os.chmod(helper, 0o4755)
        probe = subprocess.run([helper, "-I", "-S", "-c", "import os; print(os.geteuid())"], capture_output=True,
                               user=65534, group=65534, extra_groups=[])
        if probe.stdout != b"0\n":
            pytest.skip(f"cannot build a setuid-root helper here ({d} is nosuid?): {probe}")
        yield helper
    finally:
        shutil.rmtree(d)


@needs_root_fs
def test_a_setuid_root_binary_does_not_raise_privileges(setuid_root_python):
    helper = setuid_root_python
    prog = ("import os, subprocess\nprint(os.geteuid())\n"
            f"r = subprocess.run([{helper!r}, '-I', '-S', '-c', 'import os; print(os.geteuid(), os.getuid())'],"
            " capture_output=True)\nprint(r.returncode, r.stdout.decode().strip(), r.stderr.decode()[-200:])\n")
    r = run_sandboxed(["python", "-I", "-c", prog], limits=FINISH, ro_paths=(os.path.dirname(helper),))
    assert r.ok, r
    me, child = r.stdout.decode().splitlines()
    assert int(me) >= sandbox._UID_BASE
    rc, euid, uid, *_ = child.split()
    assert rc == "0" and euid == uid == me, child  # ran, and stayed the sandbox uid


@needs_root_fs
def test_a_program_not_in_the_sandbox_cannot_run_and_says_why():
    r = run_sandboxed(["/usr/bin/env"], limits=FINISH)
    assert r.status == "exit" and r.returncode == 127, r
    assert b"only the interpreter" in r.stderr


@needs_root_fs
def test_only_the_standard_library_is_importable():
    """The host's site-packages (torch, numpy, our own package) stay outside."""
    prog = ("import ctypes, decimal, hashlib, json, lzma, sqlite3, ssl, zlib  # extension modules: their libs\n"
            "import importlib.util\n"
            "print(json.dumps([importlib.util.find_spec(m) is not None for m in ('areal_fast', 'torch', 'pytest')]))\n")
    r = run_sandboxed(["python", "-I", "-c", prog], limits=FINISH)
    assert r.ok, r
    assert r.stdout.strip() == b"[false, false, false]", r


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK), reason="needs root and "
                    "/usr/bin/python3 (an interpreter any uid can run)")
def test_uid_mode_drops_to_its_uid_with_no_new_privs_and_the_run_cap():
    """The fallback for root without unshare: the uid switch happens in the child, after joining the cgroup."""
    iso = sandbox.Isolation("uid", "/usr/bin/python3", False, cgroup=ISO.cgroup)
    prog = ("import os\nprint(os.getuid(), os.geteuid(), os.getgroups())\n"
            "print([l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0].split()[1])\n"
            "print(open('/proc/self/cgroup').read().count('areal_sbx_'))\n")
    r = sandbox._run(iso, [iso.python, "-I", "-c", prog], b"", {}, FINISH)
    assert r.ok, r
    ids, nnp, in_cgroups = r.stdout.decode().splitlines()
    uid, euid, groups = ids.split(" ", 2)
    assert int(uid) == int(euid) >= sandbox._UID_BASE and groups == "[]", ids
    assert nnp == "1"
    expected = 0 if ISO.cgroup is None else 1 + (ISO.cgroup.version == 1 and ISO.cgroup.pids_parent is not None)
    assert int(in_cgroups) == expected, r
    assert_no_leftovers()


@needs_root_fs
def test_host_unix_sockets_and_processes_are_out_of_reach():
    """Abstract and file-system unix sockets of the host, and kill(-1), reach nothing outside."""
    token = secrets.token_hex(8)
    sock_dir = tempfile.mkdtemp(prefix="areal_sock_", dir="/var/tmp")
    path = os.path.join(sock_dir, "s")
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    on_disk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    victim = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        os.chmod(sock_dir, 0o755)
        abstract.bind(f"\0areal_sbx_{token}")
        on_disk.bind(path)
        os.chmod(path, 0o777)
        for s in (abstract, on_disk):
            s.listen(4)
            s.setblocking(False)
        prog = ("import os, signal, socket\n"
                f"for addr in ('\\0areal_sbx_{token}', {path!r}):\n"
                "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "    try:\n        s.connect(addr)\n        print('connected')\n"
                "    except OSError as e:\n        print(type(e).__name__)\n"
                "try:\n    os.kill(-1, signal.SIGKILL)  # every process it may signal but itself\n"
                "except OSError as e:\n    print(type(e).__name__)\n")
        r = run_sandboxed(["python", "-I", "-c", prog], limits=FINISH)
        # PID 1 of its namespace, alone in it: kill(-1) finds nobody to signal
        assert r.ok and r.stdout.decode().split() == ["ConnectionRefusedError", "FileNotFoundError",
                                                      "ProcessLookupError"], r
        for s in (abstract, on_disk):
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody ever connected
        assert victim.poll() is None  # the host process it tried to kill is alive
    finally:
        abstract.close()
        on_disk.close()
        victim.stdin.close()
        victim.wait()
        shutil.rmtree(sock_dir)


def test_cgroup_v2_files_written_and_read(tmp_path, monkeypatch):
    """The v2 protocol against a plain directory (no v2 memory controller on this CI host): the
    files a run's cgroup writes, how it is joined, how OOM kills are read, and its removal."""
    monkeypatch.setattr(cgroup, "_kill_and_rmdir", shutil.rmtree)  # a plain directory keeps its files
    sup = cgroup.CgroupSupport(2, str(tmp_path))
    run = cgroup.RunCgroup(sup, memory_bytes=300 * MiB, pids_max=33)
    (d,) = run.dirs
    assert os.path.basename(d).startswith(f"areal_sbx_{os.getpid()}_")
    assert sorted(os.listdir(d)) == ["memory.max", "pids.max"]  # memory.swap.max only where the kernel made one
    assert (Path(d) / "memory.max").read_text() == str(300 * MiB) and (Path(d) / "pids.max").read_text() == "33"
    (Path(d) / "cgroup.procs").write_text("")
    run.join()
    assert (Path(d) / "cgroup.procs").read_text() == str(os.getpid())
    assert run.oom_kills() == 0  # no memory.events: nothing known, nothing claimed
    (Path(d) / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 2\n")
    assert run.oom_kills() == 2
    run.remove()
    assert not os.path.exists(d) and run.dirs == []


# ---------------------------------------------------------------- the kernel: keys, namespaces, syscalls
SYSTEM_PYTHON = "/usr/bin/python3"  # mode uid shows the host's files: an interpreter any uid can run


@functools.cache
def mode_isolation(mode: str) -> sandbox.Isolation | str:
    """An Isolation for ``mode`` that works on this machine, or why there is none.

    As root, ``ns`` and ``plain`` run the program as root (they are the modes of an unprivileged
    launcher): they exercise the same confinement path (after unshare, in the forked child).
    """
    if mode == "ns+uid":
        return ISO if ISO.mode == "ns+uid" else f"needs root + unshare (mode here: {ISO.mode})"
    if mode == "uid":
        if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
            return f"needs root and {SYSTEM_PYTHON}"
        return sandbox.Isolation("uid", SYSTEM_PYTHON, False, cgroup=ISO.cgroup)
    iso = sandbox.Isolation(mode, ISO.python, mode == "ns", cgroup=ISO.cgroup)
    if mode == "ns" and (shutil.which("unshare") is None or not sandbox._probe(iso)):
        return "unshare --user refused here"
    return iso


def isolation_for(mode: str) -> sandbox.Isolation:
    iso = mode_isolation(mode)
    if isinstance(iso, str):
        pytest.skip(iso)
    return iso


MODES = ["ns+uid", "uid", "ns", "plain"]

# Runs as a launcher of its own (the test process keeps its keyrings): joins a named session keyring
# that links root's user keyring, as a login session does, adds a secret key to it, then runs a program
# in the sandbox that tries to read and revoke that key and to plant keys in both keyrings.
KEYRING_LAUNCHER = r"""
import ctypes, dataclasses, json, os, sys
from areal_fast.reward import sandbox
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
JOIN, GET_ID, LINK, REVOKE, READ, SEARCH, SESSION, USER = 1, 0, 8, 3, 11, 10, -3, -4
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a)
                                          for a in args])
    return r, (ctypes.get_errno() if r < 0 else 0)
def read(key):
    buf = ctypes.create_string_buffer(256)
    r = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(READ), ctypes.c_long(key), buf, ctypes.c_long(256))
    return buf.raw[:r].decode() if r >= 0 else None
spec = json.loads(sys.argv[1])
token = spec["token"]
assert call(KEYCTL, JOIN, ("areal_test_" + token).encode())[0] > 0
user_kr = call(KEYCTL, GET_ID, USER, 1)[0]
assert call(KEYCTL, LINK, USER, SESSION) == (0, 0)
key = call(ADD_KEY, b"user", ("areal_secret_" + token).encode(), token.encode(), len(token), SESSION)[0]
assert key > 0 and read(key) == token
prog = PROGRAM % (key, user_kr, token, token)
iso = sandbox.Isolation(spec["mode"], spec["python"], spec["mode"].startswith("ns"), cgroup=sandbox.isolation().cgroup)
if spec["mode"] == "ns+uid":
    iso = sandbox.isolation()
if not spec["seccomp"]:
    iso = dataclasses.replace(iso, seccomp=False)
run = sandbox._run(iso, [iso.python, "-I", "-c", prog], b"", {}, sandbox.SandboxLimits(timeout_s=20.0))
found = {}
for where, kr in (("user", user_kr), ("session", SESSION)):
    r, e = call(KEYCTL, SEARCH, kr, b"user", ("areal_planted_" + token).encode(), 0)
    found[where] = r > 0
    if r > 0:  # clean up what a broken sandbox planted in root's user keyring
        call(KEYCTL, 9, r, user_kr)
still_readable = read(key) == token
call(KEYCTL, REVOKE, key)
print(json.dumps({"run": [run.status, run.stdout.decode(), run.stderr.decode()[-500:]],
                  "still_readable": still_readable, "planted": found}))
"""
KEYRING_PROGRAM = r"""
import ctypes, json, os
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a)
                                          for a in args])
    return [r, ctypes.get_errno() if r < 0 else 0]
key, user_kr, token = %d, %d, %r
buf = ctypes.create_string_buffer(256)
r = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(11), ctypes.c_long(key), buf, ctypes.c_long(256))
planted = ("areal_planted_" + %r).encode()
print(json.dumps({"read": buf.raw[:r].decode() if r >= 0 else ctypes.get_errno(),
                  "add_to_root_user_keyring": call(ADD_KEY, b"user", planted, b"x", 1, user_kr),
                  "add_to_session": call(ADD_KEY, b"user", planted, b"x", 1, -3),
                  "revoke": call(KEYCTL, 3, key)}))
"""


def run_keyring_attack(mode: str, seccomp_on: bool) -> dict:
    iso = isolation_for(mode)
    token = secrets.token_hex(8)
    spec = json.dumps({"mode": mode, "python": iso.python, "seccomp": seccomp_on, "token": token})
    src = f"PROGRAM = {KEYRING_PROGRAM!r}\n" + KEYRING_LAUNCHER
    r = subprocess.run([sys.executable, "-c", src, spec], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and ("AssertionError" in r.stderr and "JOIN" in r.stderr):
        pytest.skip(f"keyrings unavailable here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    status, stdout, stderr = out["run"]
    assert status == "ok", out
    return {**out, "program": json.loads(stdout)}


@pytest.mark.parametrize("mode", MODES)
def test_the_launchers_keyrings_are_out_of_reach(mode):
    """Once the program could read and revoke the launcher's key and plant one in root's user keyring."""
    got = run_keyring_attack(mode, seccomp_on=True)
    prog = got["program"]
    assert prog["read"] == EPERM, got  # not the payload
    assert prog["revoke"] == [-1, EPERM] and prog["add_to_session"] == [-1, EPERM], got
    assert prog["add_to_root_user_keyring"] == [-1, EPERM], got
    assert got["still_readable"] and got["planted"] == {"user": False, "session": False}, got


@pytest.mark.parametrize("mode", ["ns+uid", "uid"])
def test_without_the_filter_the_fresh_keyring_alone_keeps_them_out(mode):
    """The second layer: after the uid switch the program possesses none of the launcher's keys."""
    got = run_keyring_attack(mode, seccomp_on=False)
    prog = got["program"]
    assert isinstance(prog["read"], int), got  # an errno (EACCES), not the payload
    assert prog["revoke"][0] == -1 and prog["add_to_root_user_keyring"][0] == -1, got
    assert prog["add_to_session"][0] > 0, got  # into its own new keyring: harmless, and gone with it
    assert got["still_readable"] and got["planted"] == {"user": False, "session": False}, got


USERNS_AND_MOUNT = r"""
import ctypes, os
CLONE_NEWUSER, CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x10000000, 0x20000, 0x4000, 0x40000
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
    print("unshare", ctypes.get_errno())
    raise SystemExit(0)
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)  # never propagate anything back
os.mkdir("m")
r = libc.mount(b"none", b"m", b"tmpfs", 0, None)
print("mounted" if r == 0 else "mount", ctypes.get_errno(), caps)
"""


@pytest.mark.parametrize("mode", MODES)
def test_no_user_namespace_and_no_mount(mode):
    """Once a new user namespace gave the program every capability in it, and a tmpfs mount."""
    iso = isolation_for(mode)
    r = sandbox._run(iso, [iso.python, "-I", "-c", USERNS_AND_MOUNT], b"", {}, FINISH)
    assert r.ok and r.stdout.split() == [b"unshare", str(EPERM).encode()], r


def host_syscall_numbers() -> dict:
    """seccomp.py's table for this machine (test_reward_seccomp checks it against the system headers)."""
    from areal_fast.reward import seccomp

    arch = seccomp.host_arch()
    if arch is None:
        pytest.skip(f"no syscall table for {os.uname().machine}")
    return arch.numbers


@pytest.mark.parametrize("mode", MODES)
def test_each_denied_call_fails_with_eperm_inside_the_sandbox(mode):
    iso = isolation_for(mode)
    r = sandbox._run(iso, [iso.python, "-I", "-c", probe_source(host_syscall_numbers())], b"", {}, FINISH)
    assert r.ok, r
    got = json.loads(r.stdout)
    assert got["seccomp"] == ["2"]
    assert got["errno"] == {name: ENOSYS if name == "clone3" else EPERM for name in got["errno"]}


ORDINARY = r"""
import multiprocessing, os, subprocess, sys, tempfile, threading
box = []
ts = [threading.Thread(target=box.append, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
child = subprocess.run([sys.executable, "-I", "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip()
with multiprocessing.get_context("fork").Pool(2) as pool:
    squares = pool.map(abs, [-1, -2, -3])
with tempfile.NamedTemporaryFile("w+", dir=os.environ["TMPDIR"]) as f:
    f.write("x" * 100); f.flush(); f.seek(0); n = len(f.read())
print(sorted(box) == list(range(8)), child, squares == [1, 2, 3], n)
"""


@pytest.mark.parametrize("mode", MODES)
def test_ordinary_programs_still_work_under_the_filter(mode):
    iso = isolation_for(mode)
    r = sandbox._run(iso, [iso.python, "-I", "-c", ORDINARY], b"", {}, FINISH)
    assert r.ok and r.stdout.split() == [b"True", b"42", b"True", b"100"], r


# The families, then what a program does with the ones it keeps: name lookups of loopback (with
# AI_ADDRCONFIG glibc asks the kernel over AF_NETLINK first and, refused, assumes both IPv4 and IPv6)
# and a TCP connection to 127.0.0.1, refused or unreachable as without the filter.
SOCKETS_IN_USE = SOCKET_FAMILIES.replace("print(json.dumps(out))", """
out["lookup"] = sorted({a[4][0] for a in socket.getaddrinfo("127.0.0.1", 80)})
out["lookup_addrconfig"] = sorted({a[4][0] for a in socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG)})
try:
    socket.create_connection(("127.0.0.1", 9), timeout=5).close()
    out["connect"] = 0
except OSError as e:
    out["connect"] = e.errno
print(json.dumps(out))
""")


@pytest.mark.parametrize("mode", MODES)
def test_only_unix_and_inet_sockets_inside_the_sandbox(mode):
    import errno

    iso = isolation_for(mode)
    r = sandbox._run(iso, [iso.python, "-I", "-c", SOCKETS_IN_USE], b"", {}, FINISH)
    assert r.ok, r
    got = json.loads(r.stdout)
    assert {k: got[k] for k in SOCKET_ANSWERS} == SOCKET_ANSWERS, got
    assert got["lookup"] == got["lookup_addrconfig"] == ["127.0.0.1"], got
    assert got["connect"] in (errno.ENETUNREACH, errno.ECONNREFUSED), got
