"""Trainer checkpoints: everything is on disk when save returns; a damaged file is named."""

import os

import pytest
import torch
from test_trainer_actor import actor_for, make_batch, make_tiny_model

from areal_fast.trainer import CheckpointError, load_checkpoint, read_trainer_state, save_checkpoint
from areal_fast.trainer import checkpoint as ckpt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny actor after one step, and its checkpoint (the fsync'd paths recorded)."""
    root = tmp_path_factory.mktemp("ckpt")
    make_tiny_model(root / "model")
    actor = actor_for(str(root / "model"))
    actor.train_batch(make_batch(4, seed=1))
    synced: list[str] = []
    real_fsync = os.fsync

    def tracking_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))  # the path this descriptor is open on
        return real_fsync(fd)

    mp = pytest.MonkeyPatch()
    mp.setattr(ckpt.os, "fsync", tracking_fsync)
    try:
        save_checkpoint(actor, str(root / "step1"))
    finally:
        mp.undo()
    return actor, root / "step1", synced


def test_save_fsyncs_every_file_before_returning(saved):
    _, path, synced = saved
    names = {os.path.basename(p.rstrip("/")) for p in synced}
    state_file = str(path / "trainer_state.pt")
    # the state is fsynced under its temporary name, then renamed; the directory entry is fsynced
    assert any(p.startswith(state_file) for p in synced), synced
    assert str(path) in {p.rstrip("/") for p in synced}, synced
    assert ".metadata" in names and any(n.startswith("__0_") for n in names), names
    assert not (path / "trainer_state.pt.tmp").exists()
    assert read_trainer_state(str(path))["version"] == 1


def test_roundtrip_restores_version(saved, tmp_path):
    actor, path, _ = saved
    other = actor_for(os.fspath(path.parent / "model"))
    load_checkpoint(other, str(path))
    assert other.version == actor.version == 1
    for (n, x), (_, y) in zip(actor.iter_full_params(), other.iter_full_params()):
        assert torch.equal(x, y), n


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing", "no_metadata"])
def test_damaged_checkpoint_raises_an_error_naming_the_file(saved, tmp_path, damage):
    import shutil

    _, path, _ = saved
    copy = tmp_path / "step1"
    shutil.copytree(path, copy)
    state = copy / "trainer_state.pt"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "garbage":
        state.write_bytes(b"not a checkpoint")
    elif damage == "missing":
        state.unlink()
    else:
        (copy / ".metadata").unlink()
    culprit = ".metadata" if damage == "no_metadata" else "trainer_state.pt"
    with pytest.raises(CheckpointError, match=str(copy / culprit).replace(".", r"\.")):
        read_trainer_state(str(copy))
    actor = saved[0]
    with pytest.raises(CheckpointError, match=str(copy).replace(".", r"\.")):
        load_checkpoint(actor, str(copy))


def test_damaged_shard_raises_an_error_naming_the_checkpoint(saved, tmp_path):
    import shutil

    actor, path, _ = saved
    copy = tmp_path / "step1"
    shutil.copytree(path, copy)
    shard = next(p for p in copy.iterdir() if p.name.startswith("__0_"))
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(CheckpointError, match=str(copy).replace(".", r"\.")):
        load_checkpoint(actor, str(copy))
