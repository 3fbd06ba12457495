"""End to end on CPU: the multi-turn example (`examples/tiny_reverse_multiturn.yaml`, shrunk) is
killed with SIGKILL right after its second checkpoint and the same command resumes it: every step
is trained once, no task is trained twice or lost, and the trained groups are multi-turn (tool
and feedback tokens masked, with version -1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from test_e2e import TINY, _wait_for, kill_run, proc_children, resume, runner  # noqa: F401

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
    kill_run(p, proc_children(p.pid))

    groups2 = list(checkpoint_groups(out / "checkpoints" / "step_00000002"))  # retention deletes it later
    events, positions = resume(_cmd(out, f"experiment.total_steps={steps}", "weights.method=disk"), out, steps)
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
