"""Hostile or damaged files in a run's output directory (issue 32, M4-M7, L9-L11): an edited or
truncated checkpoint is moved aside and the previous one used; no readable checkpoint is an
error, never a silent restart at step 0; planted symlinks are not followed; a directory that is
not ours, or not a run, is refused; the API key never reaches a file; the trainer's own process
group listens on no TCP port."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_controller import FakeTrainer, latest_checkpoint, list_checkpoints, make

from areal_fast.controller import CorruptCheckpoint

# ----------------------------------------------------------------------------- checkpoints (M4, L11)


def _run_with_checkpoints(tmp_path, steps=4):
    ctl, _, _ = make(tmp_path, eta=2, steps=steps, ckpt=1)
    asyncio.run(ctl.run())
    return list_checkpoints(tmp_path / "checkpoints")


def _edit_state(ck: Path, edit) -> None:
    st = json.loads((ck / "controller.json").read_text())
    edit(st)
    (ck / "controller.json").write_text(json.dumps(st))


EDITS = {
    "version as a string": lambda st: st.update(version=str(st["version"])),
    "version a boolean": lambda st: st.update(version=True),
    "negative position": lambda st: st.update(position=-1),
    "unknown entry": lambda st: st.update(note="hi"),
    "unknown counter": lambda st: st["counters"].update(bogus=1),
    "counter a float": lambda st: st["counters"].update(admitted=1.5),
    "pending twice": lambda st: st.update(pending=[1, 1]),
    "pending past position": lambda st: st.update(pending=[st["position"] + 5]),
    "buffer file elsewhere": lambda st: st["buffer_file"].update(name="../../etc/passwd"),
    "elapsed not a number": lambda st: st.update(elapsed="NaN"),
    "timers a list": lambda st: st.update(timers=[1]),
    # L11: consistency with the trainer state and with what the position accounts for
    "version ahead of the trainer": lambda st: st.update(version=st["version"] + 1),
    "position behind the trained groups": lambda st: st.update(position=1),
}


class VersionedTrainer(FakeTrainer):
    """A trainer whose check returns the version it holds, as the real one does (positions / B)."""

    def check(self, path: Path):
        return len(json.loads((path / "t.json").read_text())) // 2


def _make_versioned(tmp_path, **kw):
    ctl, _, server = make(tmp_path, eta=2, ckpt=1, **kw)
    ctl.trainer = trainer = VersionedTrainer()
    return ctl, trainer


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_an_edited_controller_state_is_corrupt_and_the_previous_checkpoint_is_used(tmp_path, edit, caplog):
    cks = _run_with_checkpoints(tmp_path)
    newest = cks[-1]
    _edit_state(newest, EDITS[edit])
    ctl, trainer = _make_versioned(tmp_path, steps=6)
    with caplog.at_level("WARNING"):
        assert ctl.restore_newest() == cks[-2]
    assert ctl.version == 3 and len(trainer.trained) == 6
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").is_dir()
    assert "controller.json" in caplog.text or "version" in caplog.text


class ShardTruncatedTrainer(FakeTrainer):
    """check passes (it reads only the small files), load finds the damage, as a truncated DCP
    shard shows itself only when the tensors are read."""

    def __init__(self, bad: set[str]):
        super().__init__()
        self.bad = bad

    def load(self, path: Path):
        if path.parent.name in self.bad:
            raise CorruptCheckpoint(f"{path}/__0_0.distcp: truncated")
        super().load(path)


def test_a_trainer_load_failure_moves_the_checkpoint_aside_like_a_failed_check(tmp_path, caplog):
    cks = _run_with_checkpoints(tmp_path)
    ctl, _, _ = make(tmp_path, eta=2, steps=6, ckpt=1)
    ctl.trainer = trainer = ShardTruncatedTrainer({cks[-1].name})
    with caplog.at_level("WARNING"):
        assert ctl.restore_newest() == cks[-2]
    assert ctl.version == 3 and trainer.trained and cks[-1].with_name(cks[-1].name + ".corrupt").is_dir()
    assert "truncated" in caplog.text and "falling back" in caplog.text
    asyncio.run(ctl.run())  # the run goes on from the previous checkpoint, nothing trained twice
    assert ctl.version == 6 and len(trainer.trained) == len(set(trainer.trained)) == 12


def test_no_readable_checkpoint_is_an_error_not_a_silent_restart_at_step_zero(tmp_path):
    cks = _run_with_checkpoints(tmp_path, steps=2)
    for ck in cks:
        (ck / "controller.json").write_text("{")
    ctl, _, _ = make(tmp_path, eta=2, steps=4, ckpt=1)
    with pytest.raises(CorruptCheckpoint) as e:
        ctl.restore_newest()
    msg = str(e.value)
    assert "no readable checkpoint" in msg and "experiment.resume=false" in msg and "step_00000002" in msg
    assert ctl.version == 0
    again, _, _ = make(tmp_path, eta=2, steps=4, ckpt=1)  # the same command again: still refused
    with pytest.raises(CorruptCheckpoint, match="no readable checkpoint"):
        again.restore_newest()
    fresh, _, _ = make(tmp_path / "elsewhere", eta=2, steps=4, ckpt=1)
    assert fresh.restore_newest() is None  # no checkpoint ever: a new run, as before
    assert latest_checkpoint(tmp_path / "checkpoints") is None
