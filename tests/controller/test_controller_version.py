"""The weight version has one owner, the controller: it tells the trainer the version it trains
from and saves, and the servers (through the sync port, down the trainer's ranks to the
transports) the version they get; nobody counts on their own."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fakes import GroupListTrainer, ServerState, make_controller

from areal_fast.checkpoint import list_checkpoints
from areal_fast.launch import runtime
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.port import DiskSync


class ToldTrainer(GroupListTrainer):
    """Records every version it is told; counts none itself."""

    def __init__(self):
        super().__init__()
        self.told: list[tuple[str, int]] = []

    def train(self, samples, version):
        self.told.append(("train", version))
        return super().train(samples, version)

    def save(self, path: Path, version: int):
        self.told.append(("save", version))
        super().save(path, version)
        (path / "version.json").write_text(json.dumps(version))

    def check(self, path: Path):
        return json.loads((path / "version.json").read_text())


def test_the_trainer_and_the_servers_are_told_the_controllers_version(tmp_path):
    ctl, _, server = make_controller(tmp_path, eta=1, steps=6, ckpt=2)
    ctl.trainer = trainer = ToldTrainer()
    synced: list[int] = []
    sync = ctl.syncer.sync

    async def recording_sync(version):
        synced.append(version)
        return await sync(version)

    ctl.syncer.sync = recording_sync
    asyncio.run(ctl.run())
    assert [v for op, v in trainer.told if op == "train"] == list(range(6))  # from v to v + 1
    assert [v for op, v in trainer.told if op == "save"] == [2, 4, 6]
    assert synced == [1, 2, 3, 4, 5, 6] and server.version == 6 == ctl.version
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004", "step_00000006"]

    # resumed at 4: the servers are brought to 4, and the trainer trains from 4 on
    ctl2, _, server2 = make_controller(tmp_path, eta=1, steps=6, ckpt=2, server=ServerState())
    ctl2.trainer = trainer2 = ToldTrainer()
    ctl2.syncer.sync = lambda v, s=ctl2.syncer.sync: (synced.append(v), s(v))[1]
    synced.clear()
    asyncio.run(ctl2.run(resume_from=tmp_path / "checkpoints" / "step_00000004"))
    assert synced == [4, 5, 6] and server2.version == 6
    assert [v for op, v in trainer2.told if op == "train"] == [4, 5]


class _Actor:
    """What ActorTrainer needs of PPOActor, recording the versions it is told."""

    world = 1

    def __init__(self):
        self.told: list[int] = []

    def train_batch(self, samples, version=None):
        self.told.append(version)
        return {}

    def sharded_state_dict(self):
        return {}


class _Pool:
    urls = ["http://127.0.0.1:1"]

    def is_dead(self, url):
        return False

    def remove_server(self, url):
        return False


def test_the_version_goes_down_from_the_sync_port_to_every_transport(tmp_path, monkeypatch):
    """Controller -> DiskSync.sync(v) -> ActorTrainer.update_weights -> transport.update(state, v):
    the transport (which labels the servers' weights) gets the controller's version; nothing
    travels back up through weights/port.py."""
    updates: list[int] = []

    class Transport:
        def update(self, state, version):
            updates.append(version)

    monkeypatch.setattr("areal_fast.weights.port.SyncSpec.build", lambda spec: Transport())
    saved = []
    monkeypatch.setattr("areal_fast.trainer.save_checkpoint",
                        lambda actor, path, version: (saved.append(version), Path(path).mkdir(parents=True)))
    ctl, _, server = make_controller(tmp_path, eta=1, steps=3)
    actor = _Actor()
    ctl.trainer = trainer = runtime.ActorTrainer(actor)
    disk = DiskSync(trainer, _Pool(), tmp_path / "w", WeightSyncConfig(method="disk"))

    async def sync(version):  # the fake rollout's pause flag, then the real port
        assert server.paused
        return await disk.sync(version)

    ctl.syncer.sync = sync
    asyncio.run(ctl.run())
    assert updates == [1, 2, 3] and actor.told == [0, 1, 2] and saved == [3]
    assert len(trainer.weight_syncs) == 1  # one transport per spec, reused


def test_followers_are_told_the_version_by_rank_0(monkeypatch):
    """Ranks > 0 train and save with the version rank 0 announces, never one of their own."""
    import torch.distributed as dist

    ops = [("train", 7), ("save", ("/nowhere", 8)), ("stop", None)]
    saved = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src=0: box.__setitem__(0, ops.pop(0)))
    monkeypatch.setattr("areal_fast.trainer.save_checkpoint", lambda actor, path, version: saved.append(version))
    actor = _Actor()
    runtime.follower_loop(actor)
    assert actor.told == [7] and saved == [8] and not ops


@pytest.mark.parametrize("method", ["train", "save"])
def test_the_trainer_port_requires_the_version(method):
    """A trainer call without the controller's version is an error, not a silent count of its own."""
    trainer = runtime.ActorTrainer(_Actor())
    with pytest.raises(TypeError):
        getattr(trainer, method)(Path("/nowhere")) if method == "save" else trainer.train([])


class Killed(BaseException):
    """A kill -9 at a point of the checkpoint write: nothing after it runs, no clean-up."""


CRASH_POINTS = ("trainer saved", "controller.json written", "fsynced", "COMPLETE written", "renamed")


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_checkpoint_write_killed_at_any_point_leaves_a_readable_newest(tmp_path, monkeypatch, point):
    """Killed after each step of writing checkpoint 3, the newest complete checkpoint is 2 (3 once
    renamed), it restores without being moved aside, and the run goes on to overwrite what was left."""
    import os

    from areal_fast import checkpoint

    ctl, trainer, _ = make_controller(tmp_path, steps=3, ckpt=1)
    armed = []

    def hook(name):
        if armed and name == point:
            raise Killed(name)

    real_save, real_json, real_fsync = trainer.save, checkpoint.write_json, checkpoint.fsync_tree
    real_rename = os.rename

    def save(path, version):
        real_save(path, version)
        if version == 3:
            armed.append(version)
        hook("trainer saved")

    trainer.save = save
    monkeypatch.setattr(checkpoint, "write_json", lambda p, obj: (real_json(p, obj), hook(f"{p.name} written"))[0])
    monkeypatch.setattr(checkpoint, "fsync_tree", lambda p: (real_fsync(p), hook("fsynced"))[0])
    monkeypatch.setattr(os, "rename", lambda a, b: (real_rename(a, b), hook("renamed"))[0])
    with pytest.raises(Killed):
        asyncio.run(ctl.run())
    monkeypatch.undo()
    expected = "step_00000003" if point == "renamed" else "step_00000002"
    ckpt_dir = tmp_path / "checkpoints"
    assert list_checkpoints(ckpt_dir)[-1].name == expected
    ctl2, trainer2, _ = make_controller(tmp_path, steps=5, ckpt=1)
    assert ctl2.restore_newest().name == expected and not checkpoint.corrupt_checkpoints(ckpt_dir)
    asyncio.run(ctl2.run())
    assert ctl2.version == 5 and len(trainer2.trained) == len(set(trainer2.trained)) == 10
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000004", "step_00000005"]  # leftovers gone
