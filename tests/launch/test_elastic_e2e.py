"""Elastic servers end to end (``docs/elastic.md``), real processes on the CPU: `areal-fast train` on the
shrunken tiny task with two embedded servers and the distributed (gloo) weight sync.

- one server of a synchronous run (eta = 0) is killed with SIGKILL mid-run: the run goes on with only
  fresh samples, the group is re-formed without it (the run never falls back to disk), the launcher
  relaunches it, and the replacement joins the pool within ``JOIN_DEADLINE_S`` after getting the
  weights; every later update is a broadcast to both servers; no prompt group is trained twice or
  lost and every group has all its samples;
- ``rollout.keep_servers``: the launcher is killed with SIGKILL after a checkpoint, its server
  survives, and the resume reuses it (its weight version checked against the checkpoint) instead of
  starting another.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from test_e2e import START_TIMEOUT_S, _cmd, _train_events, _wait_for, proc_children, proc_cmdline, run_dir, runner  # noqa: F401

from areal_fast.checkpoint import HANG_AFTER_CHECKPOINT_ENV

pytestmark = pytest.mark.slow
JOIN_DEADLINE_S = 40.0  # the elastic promise: a replacement joins within 40 s of the kill
GROUP_SIZE, BATCH = 2, 2  # test_e2e.TINY


def _servers(pid: int) -> list[int]:
    return [k for k in proc_children(pid) if "areal_fast.embedded" in proc_cmdline(k)]


def _sample_groups(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip()]
    return [g for r in rows for g in r["groups"]]


def stop_and_check_each_group_trained_once(p, out: Path) -> list[dict]:
    """Stop a run of 100000 steps as Ctrl-C does (SIGTERM), then check what a server fault must not
    change: steps contiguous, no update fell back to disk, every prompt position handed out trained
    exactly once with all its samples, no stale sample (``max_staleness=0``). Its train events."""
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=START_TIMEOUT_S)
    events = _train_events(out)
    steps = [e["step"] for e in events]
    assert steps == list(range(1, len(steps) + 1))
    assert all("sync/disk_sync_s" not in e for e in events), "fell back to disk"
    groups = [g for g in _sample_groups(out) if g["position"] is not None]
    positions = sorted(g["position"] for g in groups)
    assert positions == list(range(len(steps) * BATCH)), "a prompt group trained twice or lost"
    assert all(len(g["samples"]) == GROUP_SIZE for g in groups)
    assert all(e["staleness_max"] == 0 for e in events)
    return events


def test_a_killed_server_is_replaced_and_the_run_stays_on_distributed_sync(run_dir, runner):  # noqa: F811
    out = run_dir
    p = runner(_cmd(out, "experiment.total_steps=100000", "rollout.n_servers=2", "checkpoint.every_steps=0",
                    "rollout.max_staleness=0", "weights.method=distributed", "log.samples=true", "log.plots=false"))
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and len(_train_events(out)) >= 2, p, "step 2")
    victims = _servers(p.pid)
    assert len(victims) == 2
    os.kill(victims[0], signal.SIGKILL)
    killed_at, killed_step = time.monotonic(), _train_events(out)[-1]["step"]

    def joined():
        return [e for e in _train_events(out) if e["step"] > killed_step and e.get("sync/servers") == 2]

    _wait_for(lambda: joined(), p, "the replacement to join", timeout=JOIN_DEADLINE_S)
    join_s = time.monotonic() - killed_at
    first = joined()[0]["step"]
    _wait_for(lambda: _train_events(out)[-1]["step"] >= first + 3, p, "three steps on the re-formed group")
    events = stop_and_check_each_group_trained_once(p, out)
    assert all("sync/broadcast_s" in e for e in events)
    after = [e for e in events if e["step"] >= first]
    assert all(e["sync/servers"] == 2 and e["sync/group_generation"] >= 2 for e in after)
    assert "died" in (out / "logs" / "controller.log").read_text()  # the death was seen, and the run went on
    members = json.loads((out / "servers" / "members.json").read_text())["servers"]
    assert len(members) == 2 and victims[0] not in [m["pid"] for m in members]
    print(f"replacement joined {join_s:.1f} s after the kill (step {first})")


def test_kept_servers_are_reused_by_the_resume_after_a_kill_9(run_dir, runner):  # noqa: F811
    out = run_dir
    cmd = _cmd(out, "experiment.total_steps=4", "rollout.keep_servers=true", "log.plots=false")
    p = runner(cmd, env={HANG_AFTER_CHECKPOINT_ENV: "2"})
    # the hook holds the run right after the checkpoint is complete
    _wait_for(lambda: (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file(), p, "checkpoint 2")
    kept = _servers(p.pid)
    assert len(kept) == 1
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        assert Path(f"/proc/{kept[0]}").exists(), "the kept server died with its launcher"
        q = runner(cmd + ["experiment.resume=true"])
        _, err = q.communicate(timeout=START_TIMEOUT_S)
    finally:  # a kept server is no child of the runner's processes any more
        if "areal_fast.embedded" in proc_cmdline(kept[0]):
            os.kill(kept[0], signal.SIGKILL)
    assert q.returncode == 0, err.decode()[-3000:]
    said = err.decode()
    assert "reused: at version 2, the checkpoint's" in said, said[-3000:]
    assert [e["step"] for e in _train_events(out)] == [1, 2, 3, 4]
    assert not Path(f"/proc/{kept[0]}/cmdline").exists() or not proc_cmdline(kept[0]), \
        "a finished run stops its servers"
    assert not (out / ".secrets" / "servers.key").exists()
