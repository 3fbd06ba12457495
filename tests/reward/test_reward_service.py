"""Reward service: results through the pool, failures scored 0 and counted, pool recovery.

The custom reward functions below are resolved by name ("test_reward_service:raises") inside
the workers, which receive this process's sys.path (pytest puts tests/ on it).
"""

import asyncio
import glob
import logging
import math
import os
import signal
import sys
import tempfile
import time

import pytest
from test_reward_sandbox import sandbox_processes

from areal_fast.reward import RewardResult, RewardService, get_reward_fn
from areal_fast.reward.math import math_reward
from areal_fast.reward.sandbox import isolation

HANG_TIMEOUT_S = 1.0  # per-call limit of the calls that must time out (they hang forever: any limit gets there)
FINISH_S = 60.0  # per-call limit of calls that must finish: a cold worker imports this module first (~1 s idle)
ME = __name__


# ---------------------------------------------------------------- custom rewards (run in workers)
def constant(task, completion):
    return task.get("value", 1.0)


def raises(task, completion):
    raise RuntimeError("custom boom")


def hangs(task, completion):
    time.sleep(3600)


def exits(task, completion):
    os._exit(7)


def sigkill_self(task, completion):
    os.kill(os.getpid(), signal.SIGKILL)


def sys_exit(task, completion):
    sys.exit(2)


def dies_once(task, completion):
    """SIGKILLs its worker the first time it sees ``task["marker"]`` missing (an OOM kill, say)."""
    marker = task["marker"]
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    with open(marker) as f:
        return RewardResult(1.0, "ok", f"{f.read()} {os.getpid()}")


def returns_nan(task, completion):
    return math.nan


def returns_text(task, completion):
    return "1.0"


def sleeps(task, completion):
    start = time.time()
    time.sleep(task["seconds"])
    return RewardResult(1.0, "ok", f"{start} {time.time()}")


def forges_log_lines(task, completion):
    return RewardResult(0.0, "error", "boom\n2030-01-01 WARNING root: forged\x1b[2K\r\x9b1A\u2028\u202eend")


def run(coro):
    return asyncio.run(coro)


def test_registry():
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("areal_fast.reward.math:math_reward") is math_reward
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no attribute"):
        get_reward_fn("os:no_such_fn")


def test_math_and_code_through_the_pool():
    async def main():
        async with RewardService(num_workers=2, timeout_s=FINISH_S) as svc:
            results = await asyncio.gather(
                svc.score({"reward": "math", "answer": "3/4"}, "so \\boxed{\\frac{3}{4}}"),
                svc.score({"reward": "math", "answer": "\\frac{1}{2}"}, "so \\boxed{0.6}"),
                svc.score({"reward": "code", "tests": [{"input": "2 3\n", "output": "5\n"}]},
                          "```python\na, b = map(int, input().split())\nprint(a + b)\n```"),
                svc.score({"answer": "7"}, "\\boxed{7}"),  # default_reward below is not set: error
                return_exceptions=True)
            return results, svc.stats()

    results, stats = run(main())
    assert [(r.value, r.status) for r in results[:3]] == [(1.0, "ok"), (0.0, "ok"), (1.0, "ok")]
    assert all(r.elapsed > 0 for r in results[:3])
    assert isinstance(results[3], ValueError) and "no 'reward' name" in str(results[3])
    assert stats["calls"] == 3 and stats["ok"] == 3 and stats["by_reward"]["math"]["calls"] == 2


def test_failing_custom_rewards_score_zero_are_counted_and_the_pool_recovers(caplog):
    cases = [  # (function, status, substring of detail, workers it kills: a death is retried once)
        ("raises", "error", "RuntimeError: custom boom", 0),
        ("hangs", "timeout", "exceeded", 1),
        ("exits", "error", "died (exit code 7", 2),
        ("sigkill_self", "error", "died (exit code -9", 2),
        ("sys_exit", "error", "SystemExit", 0),
        ("returns_nan", "error", "non-finite", 0),
        ("returns_text", "error", "returned str", 0),
        ("no_such_function", "error", "no attribute", 0),
    ]

    async def main():
        out = []
        async with RewardService(num_workers=2, timeout_s=FINISH_S, warn_interval_s=0) as svc:
            for fn, status, *_ in cases:
                task = {"reward": f"{ME}:{fn}"}
                if status == "timeout":
                    task["timeout_s"] = HANG_TIMEOUT_S
                bad = await svc.score(task, "x")
                good = await svc.score({"reward": f"{ME}:constant", "value": 0.25}, "x")
                out.append((bad, good))
            return out, svc.stats()

    with caplog.at_level(logging.WARNING, logger="areal_fast.reward.service"):
        out, stats = run(main())
    for (fn, status, detail, _), (bad, good) in zip(cases, out):
        assert (bad.value, bad.status) == (0.0, status), (fn, bad)
        assert detail in bad.detail, (fn, bad)
        assert (good.value, good.status) == (0.25, "ok"), (fn, good)
    n_kills = sum(c[3] for c in cases)
    assert stats["timeout"] == 1 and stats["error"] == len(cases) - 1 and stats["ok"] == len(cases)
    assert stats["worker_restarts"] == n_kills and stats["workers"] == 2
    assert stats["worker_deaths"] == 4 and stats["retries"] == 2 and stats["retried_ok"] == 0  # no retry on timeout
    assert "retried on a fresh worker" in out[2][0].detail
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("1 timeouts" in w and f"{len(cases) - 1} errors" in w for w in warnings), warnings


HOSTILE = {  # program -> expected status; every one must score 0
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                  "timeout"),
    "8 GiB": ("b = bytearray(8 << 30)\nprint(42)\n", "error"),
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "1 GB output": ("import sys\nline = 'x' * 65535 + '\\n'\nfor _ in range(16384):\n    sys.stdout.write(line)\n",
                    "error"),
    "orphan sleeper": ("import os, time\nif os.fork() == 0:\n    time.sleep(100000)\n    os._exit(0)\nprint(41)\n",
                       "ok"),
    "write home": (f"open({os.path.expanduser('~/areal_sbx_service_probe')!r}, 'w').write('42')\nprint(42)\n",
                   "error"),
    "network": ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=0.5)\nprint(42)\n", "error"),
}


def test_hostile_programs_through_the_service_then_it_still_answers():
    hostile = dict(HOSTILE)
    if isolation().mode != "ns+uid":  # only a separate uid keeps the program out of our home
        hostile.pop("write home")
    if not isolation().network_isolated:
        hostile.pop("network")
    must_time_out = {"fork bomb", "infinite loop"}
    tasks = {name: {"reward": "code", "tests": [{"input": "", "output": "42"}],
                    "time_limit_s": HANG_TIMEOUT_S if name in must_time_out else FINISH_S / 4} for name in hostile}

    async def main():
        async with RewardService(num_workers=2, timeout_s=FINISH_S) as svc:
            results = await asyncio.gather(*(svc.score(tasks[name], prog) for name, (prog, _) in hostile.items()))
            after = await asyncio.gather(
                svc.score(tasks["8 GiB"], "print(6 * 7)"),
                svc.score({"reward": "math", "answer": "0.5"}, "\\boxed{\\frac{1}{2}}"))
            return results, after, svc.stats()

    results, after, stats = run(main())
    for (name, (_, status)), r in zip(hostile.items(), results):
        assert (r.value, r.status) == (0.0, status), (name, r)
    assert not os.path.exists(os.path.expanduser("~/areal_sbx_service_probe"))
    assert [(r.value, r.status) for r in after] == [(1.0, "ok"), (1.0, "ok")]
    assert stats["worker_restarts"] == 0  # programs die in their sandbox, never the worker


def test_worker_killed_mid_sandbox_leaves_nothing_behind():
    """Service timeout while the worker runs a sandboxed program: the worker is SIGKILLed, the
    program dies with it (PR_SET_PDEATHSIG chain) and the run directory is removed."""
    task = {"reward": "code", "tests": [{"input": "", "output": "1"}], "time_limit_s": 30, "timeout_s": 1.0}
    prog = "import time\ntime.sleep(3600)\n"

    async def main():
        async with RewardService(num_workers=1) as svc:
            pid = svc._workers[0].proc.pid
            r = await svc.score(task, prog)
            again = await svc.score({"reward": "math", "answer": "2"}, "\\boxed{2}")
            return pid, r, again

    pid, r, again = run(main())
    assert (r.value, r.status) == (0.0, "timeout") and "worker killed" in r.detail, r
    assert again.value == 1.0
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"areal_sbx_{pid}_*")) == []
    cg = isolation().cgroup  # the run's cgroup, created by the killed worker, is gone too
    if cg is not None:
        assert [d for p in (cg.memory_parent, cg.pids_parent) if p
                for d in glob.glob(os.path.join(p, f"areal_sbx_{pid}_*"))] == []
    if isolation().mode == "ns+uid":
        deadline = time.monotonic() + 5.0  # PDEATHSIG delivery and namespace teardown are asynchronous
        while sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sandbox_processes() == []


def test_call_whose_worker_is_killed_is_retried_once_on_a_fresh_worker(tmp_path):
    """A worker SIGKILLed mid-call (as by the OOM killer) does not cost the sample its reward."""
    async def main():
        async with RewardService(num_workers=1, timeout_s=30) as svc:
            first_pid = svc._workers[0].proc.pid
            r = await svc.score({"reward": f"{ME}:dies_once", "marker": str(tmp_path / "died")}, "")
            return first_pid, r, svc.stats()

    first_pid, r, stats = run(main())
    assert (r.value, r.status) == (1.0, "ok"), r
    killed_pid, retry_pid = map(int, r.detail.split())
    assert killed_pid == first_pid and retry_pid != first_pid
    assert stats["calls"] == 1 and stats["ok"] == 1 and stats["error"] == 0
    assert stats["worker_deaths"] == 1 and stats["retries"] == 1 and stats["retried_ok"] == 1


def test_concurrency_is_bounded_by_the_workers():
    async def main():
        async with RewardService(num_workers=2, timeout_s=FINISH_S) as svc:
            return await asyncio.gather(*(svc.score({"reward": f"{ME}:sleeps", "seconds": 0.2}, "") for _ in range(6)))

    spans = [tuple(map(float, r.detail.split())) for r in run(main())]
    for t in [s for s, _ in spans]:
        running = sum(1 for s, e in spans if s <= t < e)
        assert running <= 2, spans


def test_cancelled_call_and_dead_idle_worker_are_replaced():
    from _shared import wait_until  # here, not at the top: the reward workers import this module

    async def main():
        async with RewardService(num_workers=1, timeout_s=30) as svc:
            call = asyncio.ensure_future(svc.score({"reward": f"{ME}:hangs"}, ""))
            await wait_until(lambda: svc._workers and svc._workers[0].future is not None,
                             "the call to reach the worker")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            first = await svc.score({"reward": f"{ME}:constant"}, "")
            proc = svc._workers[0].proc
            os.kill(proc.pid, signal.SIGKILL)  # dies while idle
            await asyncio.to_thread(proc.join)  # dead before the next call: it must not be retried mid-call
            second = await svc.score({"reward": f"{ME}:constant"}, "")
            return first, second, svc.stats()

    first, second, stats = run(main())
    assert first.value == second.value == 1.0
    assert stats["worker_deaths"] == 1 and stats["worker_restarts"] == 1 and stats["workers"] == 1


def test_bad_arguments_and_closed_service():
    async def main():
        svc = RewardService(num_workers=1, default_reward="math")
        with pytest.raises(TypeError, match="task must be a dict"):
            await svc.score("3/4", "x")
        r = await svc.score({"answer": "2"}, "\\boxed{2}")  # default_reward applies
        svc.close()
        with pytest.raises(RuntimeError, match="closed"):
            await svc.score({"answer": "2"}, "\\boxed{2}")
        return r

    assert run(main()).value == 1.0
    with pytest.raises(ValueError, match="num_workers"):
        RewardService(num_workers=0)


def test_escape_controls_shows_every_control_character():
    from areal_fast.reward.result import escape_controls

    controls = "".join(chr(c) for c in [*range(0x20), *range(0x7f, 0xa0)]) + "\u2028\u2029\u202e\u2066"
    out = escape_controls("a" + controls + "é\\n€")
    assert out.isprintable() and out.startswith("a\\x00") and out.endswith("\\x9f\\u2028\\u2029\\u202e\\u2066é\\n€")
    assert "\\n\\x0b\\x0c\\r" in out and "\\t" in out and "\\x1b" in out and "\\x7f" in out
    assert escape_controls("plain text, ünïcode") == "plain text, ünïcode"


def test_reward_details_are_logged_with_control_characters_escaped(caplog):
    async def main():
        async with RewardService(num_workers=1, timeout_s=FINISH_S, warn_interval_s=0) as svc:
            return await svc.score({"reward": f"{ME}:forges_log_lines"}, "x")

    with caplog.at_level(logging.WARNING, logger="areal_fast.reward.service"):
        res = run(main())
    assert res.status == "error"
    (w,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "forged" in r.getMessage()]
    assert w.isprintable() and "boom\\n2030-01-01 WARNING root: forged\\x1b[2K\\r\\x9b1A\\u2028\\u202eend" in w
