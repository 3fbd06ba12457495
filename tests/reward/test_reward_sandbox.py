"""Hostile programs in the sandbox: each is contained, scores 0, and leaves the host untouched.

The fork bomb is safe to run here because the sandbox runs it under a uid of its own with
RLIMIT_NPROC = 32 (and in a PID namespace): checked on a harmless variant (fork 100 sleepers,
limit 10 -> 9 forks) in test_nproc_limit_counts_only_this_sandbox before it was ever run.
"""

import os
import secrets
import socket
import time
from pathlib import Path

import pytest

from areal_fast.reward import sandbox
from areal_fast.reward.code import code_reward
from areal_fast.reward.sandbox import SandboxLimits, run_sandboxed

ISO = sandbox.isolation()
needs_uid = pytest.mark.skipif(ISO.mode != "ns+uid", reason=f"needs root + unshare (mode here: {ISO.mode})")
needs_net_isolation = pytest.mark.skipif(not ISO.network_isolated, reason=f"no network namespace ({ISO.mode})")
ONE_TEST = [{"input": "", "output": "42"}]
TIMEOUT_S = 1.0  # wall limit for programs that must time out: any limit gets there, a short one sooner
FINISH_S = 20.0  # for programs that must end by themselves (an answer, an error): an interpreter starts in
# ~50 ms here when idle and took over 1 s at load 16 on 2 cores; the limit must never be what ends them
REAP_WAIT_S = 5.0  # namespace teardown is asynchronous in the kernel; it takes ~1-50 ms here


FINISH = SandboxLimits(timeout_s=FINISH_S)


def sandbox_processes() -> list[str]:
    """Live (non-zombie) processes owned by sandbox uids."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid < sandbox._UID_BASE:
                continue
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(d)
    return found


def assert_no_leftovers():
    deadline = time.monotonic() + REAP_WAIT_S
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sandbox_processes() == [], "sandboxed processes survived their run"


def score(program: str, limit_s: float = FINISH_S, **task):
    return code_reward({"tests": ONE_TEST, "time_limit_s": limit_s, **task}, program)


def test_runs_in_fresh_temp_dir_as_home_and_removes_it():
    prog = ("import os\nprint(os.path.exists('left_by_last_run'))\nopen('left_by_last_run', 'w').write('x')\n"
            "print(os.getcwd(), os.environ['HOME'], os.path.expanduser('~'))\n")
    for _ in range(2):
        r = run_sandboxed(["python", "-c", prog], limits=FINISH)
        assert r.ok, r
        fresh, cwd, home, tilde = r.stdout.decode().split()
        assert fresh == "False" and cwd == home == tilde, r
    if ISO.mode == "ns+uid":
        assert cwd == "/tmp/work"  # on a tmpfs of its own, gone with the namespace
    else:
        assert "areal_sbx_" in cwd and not os.path.exists(cwd)


@needs_uid
def test_cannot_write_or_read_the_real_home():
    """The sandbox's root holds no home: writes hit a read-only root, the secret does not exist."""
    home = Path.home()
    token = secrets.token_hex(8)
    target = home / f"areal_sbx_pwned_{token}"
    secret = home / f".areal_sbx_secret_{token}"
    secret.write_text(token)
    secret.chmod(0o600)
    try:
        prog = (f"open({str(target)!r}, 'w').write('pwned')\n")
        r = score(prog)
        assert (r.value, r.status) == (0.0, "error") and "Read-only file system" in r.detail, r
        assert not target.exists()
        r = code_reward({"tests": [{"input": "", "output": token}], "time_limit_s": FINISH_S},
                        f"print(open({str(secret)!r}).read())")
        assert r.value == 0.0 and "No such file" in r.detail, r
    finally:
        secret.unlink()
        if target.exists():
            target.unlink()


@needs_uid
def test_writes_to_world_writable_places_stay_inside():
    """/tmp, /dev/shm are fresh size-capped tmpfs inside the namespace; the rest is read-only."""
    token = secrets.token_hex(8)
    paths = [f"{d}/areal_sbx_probe_{token}" for d in ("/tmp", "/dev/shm", "/var/tmp", "")]
    prog = (f"for p in {paths!r}:\n    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n"
            "    except OSError as e:\n        print(type(e).__name__, e.strerror)\n")
    r = run_sandboxed(["python", "-c", prog], limits=FINISH)
    assert r.ok, r
    # its own /tmp and /dev/shm; no /var on its root; the root itself is read-only
    assert r.stdout.decode().splitlines() == [f"wrote {paths[0]}", f"wrote {paths[1]}",
                                              "FileNotFoundError No such file or directory",
                                              "OSError Read-only file system"], r
    assert not any(os.path.exists(p) for p in paths)
    fill = "for i in range(100):\n    open('f%d' % i, 'wb').write(b'x' * (8 << 20))\n"  # 800 MB
    r = run_sandboxed(["python", "-c", fill], limits=SandboxLimits(timeout_s=FINISH_S, disk_bytes=32 << 20))
    assert r.status == "exit" and b"No space left on device" in r.stderr, r


@needs_net_isolation
def test_no_network_even_to_loopback():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.setblocking(False)
        port = srv.getsockname()[1]
        prog = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                "s.sendall(b'hello')\nprint('connected')\n")
        r = code_reward({"tests": [{"input": "", "output": "connected"}], "time_limit_s": FINISH_S}, prog)
        assert (r.value, r.status) == (0.0, "error"), r
        assert "unreachable" in r.detail or "refused" in r.detail, r
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing ever connected


@needs_uid
def test_nproc_limit_counts_only_this_sandbox():
    prog = ("import os, time\nn = 0\nfor i in range(100):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "    n += 1\nprint(n)\n")
    r = run_sandboxed(["python", "-c", prog], limits=SandboxLimits(timeout_s=FINISH_S, nproc=10))
    assert r.ok and r.stdout.strip() == b"9", r  # 10 processes including itself
    assert_no_leftovers()


@needs_uid
def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = score(bomb, TIMEOUT_S)
    assert (r.value, r.status) == (0.0, "timeout"), r
    assert_no_leftovers()
    # the host still runs things
    assert run_sandboxed(["python", "-c", "print(6 * 7)"], limits=FINISH).stdout == b"42\n"


def test_allocating_8_gib_fails_inside():
    r = score("b = bytearray(8 << 30)\nprint(42)\n")
    assert (r.value, r.status) == (0.0, "error") and r.detail.startswith("memory limit"), r


def test_infinite_loop_times_out():
    r = score("while True:\n    pass\n", TIMEOUT_S)
    assert (r.value, r.status) == (0.0, "timeout"), r


def test_printing_1_gb_is_cut_off():
    r = score("import sys\nline = 'x' * 65535 + '\\n'\nfor _ in range(16384):\n    sys.stdout.write(line)\n")
    assert (r.value, r.status) == (0.0, "error") and "output limit" in r.detail, r
    # and at the sandbox level: only the cap was kept
    r = run_sandboxed(["python", "-c", "while True: print('y' * 1000)"],
                      limits=SandboxLimits(timeout_s=FINISH_S, output_bytes=4096))
    assert r.status == "output_limit" and len(r.stdout) == 4096


def test_child_sleeping_forever_after_parent_exits_is_killed():
    prog = "import os, time\nif os.fork() == 0:\n    time.sleep(100000)\n    os._exit(0)\nprint(41)\n"
    r = score(prog)
    # "ok": the run ended with its main process; had it waited for the orphan, it would be a timeout
    assert (r.value, r.status) == (0.0, "ok") and "wrong answer" in r.detail, r
    if ISO.mode == "ns+uid":
        assert_no_leftovers()


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="must be relative"):
        run_sandboxed(["python", "-c", "pass"], files={"../x": "y"})
