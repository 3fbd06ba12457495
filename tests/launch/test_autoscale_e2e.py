"""The server-count policy end to end (``docs/autoscale.md``), real processes on the CPU: `areal-fast train`
on the shrunken tiny task with embedded servers, the local launcher and the distributed (gloo) weight sync,
on a task whose answers grow longer over the run (``tools/autoscale_task.py``: 2 tokens an answer, then 96
from weight version 6).

While the answers are short, two servers make more than the trainer takes (the trainer never waits, the
batch is there when it asks, its groups are at the staleness bound): the policy removes one, and the launcher
stops it once it left the pool. Once the answers are long, the trainer waits for its batches: the policy adds
one back, the launcher starts it, and it joins the pool after a full weight update. Through both changes:
every step's staleness within the bound, steps contiguous, every prompt group the loader handed out trained
exactly once with all its samples or still held at the last checkpoint (the chaos benchmark's accounting,
``tools/chaos_lib.py``; the run stops at the first checkpoint of a step on the grown pool), every update a
broadcast; each decision in ``metrics.jsonl`` and the run's log.

Its time is process start-up: the run's, its two servers', the added server's (begun as soon as the
policy decides: a removed server exiting slowly does not hold it up, ``elastic.supervisor``).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from test_e2e import START_TIMEOUT_S, _cmd, _train_events, _wait_for, run_dir, runner  # noqa: F401

from areal_fast.buffer import checkpoint_groups
from areal_fast.checkpoint import CorruptCheckpoint, latest_checkpoint, read_state
from areal_fast.metrics.sinks import read_jsonl
from tools.chaos_lib import account

pytestmark = pytest.mark.slow
GROUP_SIZE, ETA = 2, 1  # test_e2e.TINY
SWITCH = 6  # the weight version from which answers are long


# the policy's run: two servers, the growing-answers task, the tiny run's signals, not the production
# thresholds (a whole batch waiting when the trainer asks is "full", any staleness is "stale": eta is 1)
AUTOSCALE = ["rollout.n_servers=2", "rollout.workflow=tools.autoscale_task:growing_answers",
             f"rollout.workflow_args.switch={SWITCH}", "log.samples=true",
             "rollout.autoscale.enabled=true", "rollout.autoscale.min_servers=1", "rollout.autoscale.max_servers=2",
             "rollout.autoscale.settle_steps=1", "rollout.autoscale.buffer_high=1", "rollout.autoscale.stale_high=0.01"]


def _changes(out: Path) -> list[dict]:
    """The policy's decisions that changed the count (a line being written is skipped)."""
    return [r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "autoscale" and r["autoscale/change"]]


def _checkpointed(out: Path) -> int:
    """The newest checkpoint's step (0: none; retention may delete one as it is read)."""
    try:
        ck = latest_checkpoint(out / "checkpoints")
        return read_state(ck)["version"] if ck is not None else 0
    except (OSError, CorruptCheckpoint):
        return 0


def test_the_policy_removes_a_server_then_adds_one_as_answers_grow_and_loses_nothing(run_dir, runner):  # noqa: F811
    out = run_dir
    p = runner(_cmd(out, "experiment.total_steps=100000", "weights.method=distributed", "log.plots=false", *AUTOSCALE))
    _wait_for(lambda: [c["autoscale/change"] for c in _changes(out)][:1] == [-1], p, "the policy to remove a server")
    _wait_for(lambda: [c["autoscale/change"] for c in _changes(out)][:2] == [-1, 1], p, "the policy to add one back")
    added_at = _changes(out)[1]["step"]

    def joined():
        return [e for e in _train_events(out) if e["step"] > added_at and e.get("sync/servers") == 2]

    _wait_for(lambda: joined(), p, "the added server to join the pool")
    first = joined()[0]["step"]

    _wait_for(lambda: _checkpointed(out) >= first, p, "a checkpoint of a step on the grown pool")
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=START_TIMEOUT_S)

    removal, addition = check_policy_run(out, added_at)
    assert "generation runs ahead" in removal["reason"] and "trainer idle" in addition["reason"]


def check_policy_run(out: Path, added_at: int, group_size: int = GROUP_SIZE, eta: int = ETA) -> tuple[dict, dict]:
    """What a run of the policy on the growing-answers task must show, here and on real Slurm
    (``test_slurm_e2e.py``): a removal while the answers are short and an addition once they are long,
    steps contiguous, staleness within eta on every step, a step served by one server between the two,
    every update a broadcast, nothing lost or trained twice up to the last checkpoint (the chaos
    accounting), both decisions in the run's log. Returns the two decisions."""
    events = _train_events(out)
    removal, addition = _changes(out)[:2]
    assert removal["step"] < SWITCH <= added_at, _changes(out)  # fewer while short, more once long
    assert [e["step"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["staleness_max"] <= eta for e in events), [e["staleness_max"] for e in events]
    assert any(e.get("sync/servers") == 1 for e in events if removal["step"] < e["step"] <= added_at)
    assert all("sync/broadcast_s" in e and "sync/disk_sync_s" not in e for e in events)
    ck = latest_checkpoint(out / "checkpoints")
    st = read_state(ck)
    upto = [e for e in events if e["step"] <= st["version"]]
    per_group = {int(g["position"]): len(g["samples"])
                 for r in (json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip())
                 for g in r.get("groups", []) if g.get("position") is not None}
    acc = account(upto, st, [g.position for g in checkpoint_groups(ck, st)], per_group, group_size)
    assert acc.ok and acc.trained > 0, acc.to_dict()
    text = (out / "logs" / "controller.log").read_text()
    assert "autoscale: servers 2 -> 1" in text and "autoscale: servers 1 -> 2" in text
    return removal, addition
