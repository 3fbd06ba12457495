"""Controller logic with in-process fakes (no servers, no torch) and the production staleness gate:
admission under the staleness bound, the synchronous baseline, strict mode, failures, and
checkpoint/resume without losing or repeating a sample, refusing a changed data order, and falling
back from a corrupt newest checkpoint."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from fakes import make_controller

from areal_fast.checkpoint import ResumeMismatch, latest_checkpoint, list_checkpoints
from areal_fast.diskutil import WriteFailed
from areal_fast.metrics.sinks import JsonlSink
from areal_fast.rollout.staleness import StalenessManager


def test_async_run_trains_each_group_once_within_bound(tmp_path):
    ctl, trainer, _ = make_controller(tmp_path, eta=2, steps=8)
    summary = asyncio.run(ctl.run())
    assert summary["steps"] == 8 == ctl.version
    assert len(trainer.trained) == len(set(trainer.trained)) == 8 * 2
    # nothing lost: trained + buffered + still running/queued == every position handed out
    st = ctl.state_dict()
    seen = trainer.trained + [g.position for g in st["buffer"]] + st["pending"]
    assert sorted(seen) == list(range(ctl.position))


def test_sync_mode_eta0_trains_only_fresh_samples(tmp_path):
    ctl, trainer, _ = make_controller(tmp_path, eta=0, steps=5)
    asyncio.run(ctl.run())
    for v, step in enumerate(trainer.steps):
        # with eta = 0 every token of the batch of step v was made by weights v: fully synchronous
        assert set(step["versions"]) == {v}, (v, set(step["versions"]))
    assert all(m["staleness_max"] == 0 for m in ctl.history)


def test_gate_counts_match_the_controller(tmp_path):
    gate = StalenessManager(2, 1, 16)
    ctl, trainer, _ = make_controller(tmp_path, eta=1, steps=5, gate=gate)
    asyncio.run(ctl.run())
    assert len(trainer.trained) == len(set(trainer.trained)) == 10
    assert gate.stats()["admitted"] == ctl.counters.admitted
    assert ctl.history[-1]["gate/admitted"] <= ctl.counters.admitted  # metrics come from the same gate


def test_strict_mode_drops_stale_groups_and_regenerates_them(tmp_path):
    # position 0 generates 10x longer, so by the time it finishes the trainer has moved > eta on
    ctl, trainer, _ = make_controller(tmp_path, eta=1, steps=8, B=1, n=1, strict=True,
                                      rollout_kw={"slow_positions": [0]})
    asyncio.run(ctl.run())
    for v, step in enumerate(trainer.steps):
        assert min(step["versions"]) >= v - 1
    assert ctl.counters.dropped_stale >= 1
    st = ctl.state_dict()
    seen = trainer.trained + [g.position for g in st["buffer"]] + st["pending"]
    assert sorted(seen) == list(range(ctl.position)), "a dropped group must be regenerated, not lost"


def test_failed_generation_stops_the_run_with_its_error(tmp_path):
    ctl, _, _ = make_controller(tmp_path, rollout_kw={"fail_position": 3})
    with pytest.raises(RuntimeError, match="failed on purpose"):
        asyncio.run(ctl.run())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_after_crash_loses_and_repeats_nothing(tmp_path, seed):
    """Crash (cancel the loop at a random moment), then restore from the newest checkpoint and
    finish: the lineage trains every handed-out position at most once and loses none."""
    ctl, trainer, server = make_controller(tmp_path, eta=2, steps=10, ckpt=2, seed=seed)

    async def crash():
        task = asyncio.create_task(ctl.run())
        while ctl.version < 5:
            await asyncio.sleep(0.001)
        await asyncio.sleep(random.Random(seed).random() * 0.01)
        task.cancel()  # everything in memory is gone, like kill -9
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(crash())
    ck = latest_checkpoint(tmp_path / "checkpoints")
    assert ck is not None
    n_ck = int(ck.name.split("_")[1])
    assert n_ck >= 4 and n_ck % 2 == 0
    trained_at_ck = json.loads((ck / "trainer" / "t.json").read_text())
    ctl2, trainer2, _ = make_controller(tmp_path, eta=2, steps=10, ckpt=2, seed=seed + 10)
    asyncio.run(ctl2.run(resume_from=ck))
    assert ctl2.version == 10
    assert trainer2.trained[: n_ck * 2] == trained_at_ck
    assert len(trainer2.trained) == len(set(trainer2.trained)) == 10 * 2
    st = ctl2.state_dict()
    seen = trainer2.trained + [g.position for g in st["buffer"]] + st["pending"]
    assert sorted(seen) == list(range(ctl2.position))
    # the bound after the restore: the gate was recovered with the restored buffer counted
    assert ctl2.gate.accepted + ctl2.gate.running <= (2 + ctl2.version + 1) * 2


def test_checkpoint_write_is_atomic(tmp_path):
    ctl, _, _ = make_controller(tmp_path, steps=2, ckpt=1)
    asyncio.run(ctl.run())
    # a half-written checkpoint (no COMPLETE marker) is never picked
    (tmp_path / "checkpoints" / "step_00000009.tmp").mkdir()
    bad = tmp_path / "checkpoints" / "step_00000008"
    bad.mkdir()
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"


def _crashed_run(tmp_path, steps=4, ckpt=1):
    ctl, _, _ = make_controller(tmp_path, eta=2, steps=steps, ckpt=ckpt)
    asyncio.run(ctl.run())
    return list_checkpoints(tmp_path / "checkpoints")


def test_resume_with_a_changed_data_order_is_refused_naming_the_keys(tmp_path):
    _crashed_run(tmp_path)
    ctl, _, _ = make_controller(tmp_path, eta=2, steps=8, ckpt=1, resume_key={"seed": 1, "data.rows": 10})
    with pytest.raises(ResumeMismatch) as e:
        ctl.restore_newest()
    msg = str(e.value)
    assert "seed" in msg and "data.rows" in msg and "step_00000004" in msg and "experiment.resume=false" in msg
    assert ctl.version == 0  # nothing was loaded
    ok, trainer, _ = make_controller(tmp_path, eta=2, steps=8, ckpt=1)  # the same key resumes
    assert ok.restore_newest().name == "step_00000004" and ok.version == 4 and len(trainer.trained) == 8


@pytest.mark.parametrize("damage", ["state_json", "trainer_state"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, caplog):
    cks = _crashed_run(tmp_path)
    newest = cks[-1]
    if damage == "state_json":
        (newest / "controller.json").write_text('{"version": 4, "posi')  # cut short, as by a full disk
    else:
        (newest / "trainer" / "t.json").write_bytes(b"\x80\x04")
    ctl, trainer, _ = make_controller(tmp_path, eta=2, steps=6, ckpt=1)
    with caplog.at_level("WARNING"):
        assert ctl.restore_newest() == cks[-2]
    assert ctl.version == 3 and len(trainer.trained) == 6
    assert str(newest) in caplog.text and "falling back" in caplog.text
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").is_dir()
    asyncio.run(ctl.run())  # and the run goes on from there, writing a fresh step 4
    assert ctl.version == 6 and latest_checkpoint(tmp_path / "checkpoints").name == "step_00000006"
    assert len(trainer.trained) == len(set(trainer.trained)) == 12


def test_a_failed_checkpoint_write_names_the_path_and_leaves_no_partial_checkpoint(tmp_path):
    """A full disk surfaces from torch.save as "unexpected pos": the error must name what was being written."""
    ctl, trainer, _ = make_controller(tmp_path, steps=2, ckpt=1)

    def full_disk(path, version):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 2048 vs 1994")

    trainer.save = full_disk
    with pytest.raises(WriteFailed, match=r"step_00000000\.tmp.*MiB free.*unexpected pos"):
        ctl._write_checkpoint(ctl.state_dict())
    assert not list((tmp_path / "checkpoints").glob("step_*")), "a partial checkpoint was left behind"


def test_a_full_disk_under_the_metrics_file_names_the_file(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")  # a regular file (a device there is refused) ...
    sink.f.close()
    sink.f = open("/dev/full", "a")  # ... whose every write fails with ENOSPC, as /dev/full's does
    try:
        with pytest.raises(WriteFailed, match=r"metrics\.jsonl.*No space left"):
            sink({"step": 1})
    finally:
        try:
            sink.close()
        except OSError:
            pass
