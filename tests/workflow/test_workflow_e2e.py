"""End to end on CPU: the multi-turn example (`examples/tiny_reverse_multiturn.yaml`, shrunk) is
killed with SIGKILL right after its second checkpoint and the same command resumes it: every step
is trained once, no task is trained twice or lost, and the trained groups are multi-turn (tool
and feedback tokens masked, with version -1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_e2e import START_TIMEOUT_S, TINY, _train_events, _wait_for, proc_alive, proc_children, runner  # noqa: F401

from areal_fast.buffer import checkpoint_groups
from areal_fast.checkpoint import HANG_AFTER_CHECKPOINT_ENV

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "tiny_reverse_multiturn.yaml")
MULTITURN = [*TINY, "rollout.workflow_args.max_turns=3", "log.plots=false", "checkpoint.save_hf=false"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "areal_fast.cli", "train", EXAMPLE, f"experiment.output_dir={out}",
            *MULTITURN, *extra]


def test_multi_turn_run_killed_and_resumed_trains_each_task_exactly_once(tmp_path, runner):  # noqa: F811
    out = tmp_path / "run"
    steps = 5
    p = runner(_cmd(out, f"experiment.total_steps={steps}", "weights.method=disk"),
               env={HANG_AFTER_CHECKPOINT_ENV: "2"})
    _wait_for(lambda: (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file(), p, "checkpoint 2")
    kids = proc_children(p.pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 30  # the children die with the launcher (parent-death signal)
    while any(proc_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [k for k in kids if proc_alive(k)], "processes of the killed run are still running"

    groups2 = list(checkpoint_groups(out / "checkpoints" / "step_00000002"))  # retention deletes it later
    r = subprocess.run(_cmd(out, f"experiment.total_steps={steps}", "weights.method=disk"), cwd=ROOT,
                       capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr
    events = _train_events(out)
    assert [e["step"] for e in events] == list(range(1, steps + 1))
    positions = [pos for e in events for pos in e["positions"]]
    assert len(positions) == len(set(positions)) == steps * 2, positions
    st = json.loads((out / "checkpoints" / f"step_{steps:08d}" / "controller.json").read_text())
    ck = out / "checkpoints" / f"step_{steps:08d}"
    groups = [*groups2, *checkpoint_groups(ck)]  # per-token columns as arrays
    seen = positions + [g.position for g in checkpoint_groups(ck)] + st["pending"]
    assert sorted(seen) == list(range(st["position"])), "a task was lost or handed out twice"
    # the groups the checkpoints held are multi-turn: feedback tokens masked and versionless
    assert groups, "no buffered group to inspect"
    masks = [(s.loss_mask.tolist(), s.output_versions.tolist()) for g in groups for s in g.samples]
    assert all(len(m) == len(v) for m, v in masks)
    assert all(x == -1 for m, v in masks for x, b in zip(v, m) if not b)
    assert all(x >= 0 for m, v in masks for x, b in zip(v, m) if b)
    assert any(0 in m for m, _ in masks), "no episode got feedback (a second turn) in the checkpointed groups"
    assert all(e.get("episode/turns", 1) >= 1 for e in events)
