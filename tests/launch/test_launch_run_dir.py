"""The output directory of a run and the checks made before any server starts: one live run per
directory (a lock that dies with its process, kill -9 included), a fresh start that moves the whole
previous run aside, a resume refused when the data order changed, and a reward that must score a
real task."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from areal_fast.checkpoint import BUFFER_FILE, ResumeMismatch
from areal_fast.launch.run_dir import LOCK_FILE, RunDirBusy, RunLock, move_previous_run_aside
from areal_fast.launch.train import RewardCheckFailed, check_resume, check_reward

HOLDER = """
import sys
from areal_fast.launch.run_dir import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()  # hold until the test closes stdin (or kills us)
"""


def _hold(out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked"  # the lock is held from here on
    return p


@pytest.mark.slow  # starts other processes
def test_a_second_live_run_is_refused_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        with pytest.raises(RunDirBusy) as e:
            with RunLock(out):
                pass
        msg = str(e.value)
        assert str(out) in msg and f"pid {holder.pid}" in msg and "experiment.output_dir" in msg
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no cleanup code runs: the kernel drops the flock
        holder.wait()
    with RunLock(out):  # taken at once after the kill
        assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()}")
    holder = _hold(out)  # and released on a normal exit of the with block
    holder.stdin.close()
    assert holder.wait() == 0


def test_fresh_start_moves_the_whole_previous_run_aside(tmp_path):
    out = tmp_path / "run"
    for d in ("checkpoints/step_00000002", "final", "plots", "logs", "warm_start"):
        (out / d).mkdir(parents=True)
    for f in ("metrics.jsonl", "summary.json", "final/model.safetensors", "logs/controller.log"):
        (out / f).write_text(f)
    said = []
    with RunLock(out):
        aside = move_previous_run_aside(out, said.append)
    assert aside is not None and aside.parent == out.parent and aside.name.startswith("run.previous-")
    for f in ("metrics.jsonl", "summary.json", "final/model.safetensors", "logs/controller.log"):
        assert (aside / f).read_text() == f  # moved, nothing deleted or overwritten
    assert (aside / "checkpoints" / "step_00000002").is_dir()
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "warm_start"]  # the cache stays
    assert str(aside) in said[0] and "metrics.jsonl" in said[0] and "nothing was deleted" in said[0]
    assert move_previous_run_aside(out, said.append) is None and len(said) == 1  # nothing left to move


def _checkpoint(ckpt_dir: Path, step: int, key: dict | None, text: str | None = None) -> Path:
    d = ckpt_dir / f"step_{step:08d}"
    d.mkdir(parents=True)
    st = {"version": step, "position": 4 * step, "pending": [], "counters": {},
          "buffer_file": {"name": BUFFER_FILE, "groups": 0, "bytes": 0}}
    if key is not None:
        st["resume_key"] = key
    (d / BUFFER_FILE).write_bytes(b"")
    (d / "controller.json").write_text(text if text is not None else json.dumps(st))
    (d / "COMPLETE").write_text("ok")
    return d


def test_resume_check_names_the_changed_keys_and_skips_a_corrupt_newest(tmp_path):
    ck = tmp_path / "checkpoints"
    key = {"experiment.seed": 1, "data.rows": 480, "data.sha256": "ab12"}
    _checkpoint(ck, 2, key)
    check_resume(ck, key)  # same data order: fine
    with pytest.raises(ResumeMismatch) as e:
        check_resume(ck, {**key, "experiment.seed": 2, "data.rows": 500})
    msg = str(e.value)
    assert "experiment.seed" in msg and "data.rows" in msg and "data.sha256" not in msg
    assert "480" in msg and "500" in msg and "step_00000002" in msg
    _checkpoint(ck, 3, key, text='{"version": 3, "posi')  # corrupt newest: the previous one decides
    with pytest.raises(ResumeMismatch, match="step_00000002"):
        check_resume(ck, {**key, "experiment.seed": 2})
    check_resume(tmp_path / "none", key)  # nothing to resume: nothing to check


class _Cfg:
    """The two sections check_reward reads."""

    def __init__(self, name, eval_name=None):
        self.reward = type("R", (), {"name": name, "timeout": 10.0})()
        self.eval = type("E", (), {"reward": eval_name})()


@pytest.mark.slow  # starts other processes
def test_reward_check_calls_the_reward_and_names_it_when_it_fails():
    task = {"answer": "cba", "prompt": "abc"}
    check_reward(_Cfg("areal_fast.data.tiny_task:partial_reward", "areal_fast.data.tiny_task:reward"), task)
    with pytest.raises(RewardCheckFailed) as e:
        check_reward(_Cfg("areal_fast.data.tiny_task:partial_reward", "areal_fast.data.tiny_task:no_such_reward"),
                     task)
    assert "eval.reward" in str(e.value) and "no_such_reward" in str(e.value)
    with pytest.raises(RewardCheckFailed, match=r"reward\.name = 'math'.*error"):
        check_reward(_Cfg("math"), {"no_answer_field": 1})  # the math reward cannot score this task
