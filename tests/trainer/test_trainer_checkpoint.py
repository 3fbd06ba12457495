"""Trainer checkpoints: everything is on disk when save returns; a damaged file is named."""

import os
import re
import sys

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


# ----------------------------------------------------------------------------- edited or damaged checkpoints


def _copy(saved, tmp_path):
    import shutil

    copy = tmp_path / "step1"
    shutil.copytree(saved[1], copy)
    return copy


def test_a_truncated_shard_is_found_by_the_check_and_its_load_is_a_corrupt_checkpoint(saved, tmp_path):
    """The controller moves a checkpoint aside on CorruptCheckpoint from check or load: a truncated
    DCP shard must raise it from both (the check reads no tensor: it compares the shard lengths
    with the metadata), and the actor keeps its weights usable for the previous checkpoint."""
    from areal_fast.checkpoint import CorruptCheckpoint
    from areal_fast.launch.runtime import ActorTrainer

    actor = saved[0]
    trainer = ActorTrainer(actor)
    assert trainer.check(saved[1]) == 1  # a good checkpoint: its version
    copy = _copy(saved, tmp_path)
    shard = next(p for p in copy.iterdir() if p.name.startswith("__0_"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        trainer.check(copy)
    with pytest.raises(CorruptCheckpoint, match=str(copy).replace(".", r"\.")):
        trainer.load(copy)
    trainer.load(saved[1])  # the previous good one loads after the failed attempt
    assert actor.version == 1


def test_a_shard_name_in_the_metadata_cannot_point_outside_the_checkpoint(saved, tmp_path):
    import pickle

    copy = _copy(saved, tmp_path)
    md = pickle.loads((copy / ".metadata").read_bytes())
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../outside.distcp"
    (copy / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        ckpt.verify_checkpoint(str(copy))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # what an edited trainer_state.pt could do at resume


def test_trainer_state_is_read_without_running_code(saved, tmp_path):
    copy = _copy(saved, tmp_path)
    marker = tmp_path / "code_ran"
    extra = torch.load(copy / "trainer_state.pt", weights_only=True)
    torch.save({**extra, "scheduler": _RunsCode(str(marker))}, copy / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        read_trainer_state(str(copy))
    assert not marker.exists(), "loading the trainer state ran code from the file"
    assert read_trainer_state(str(saved[1]))["version"] == 1  # a real one reads with weights_only=True


@pytest.mark.parametrize("edit", [{"version": "1"}, {"version": -1}, {"rng_cpu": [1, 2]}, {"unknown": 1}])
def test_a_wrongly_typed_trainer_state_is_a_damaged_checkpoint(saved, tmp_path, edit):
    copy = _copy(saved, tmp_path)
    extra = torch.load(copy / "trainer_state.pt", weights_only=True)
    torch.save({**extra, **edit}, copy / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="not a trainer state"):
        read_trainer_state(str(copy))


def test_dcp_metadata_and_entries_are_read_without_running_code(saved, tmp_path):
    """DCP's .metadata is a pickle and its non-tensor entries are torch.load'ed with weights_only=False
    by torch's own planner: an edited checkpoint must not run code through either."""
    import pickle

    actor = saved[0]
    copy = _copy(saved, tmp_path)
    marker = tmp_path / "code_ran"
    md = pickle.loads((copy / ".metadata").read_bytes())
    md.planner_data = _RunsCode(str(marker))
    (copy / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="not allowed"):
        ckpt.verify_checkpoint(str(copy))
    with pytest.raises(CheckpointError):
        load_checkpoint(actor, str(copy))
    assert not marker.exists(), "reading the DCP metadata ran code from the file"
    load_checkpoint(actor, str(saved[1]))  # a real one: metadata and optimizer param groups load
    assert actor.version == 1


def test_a_non_tensor_dcp_entry_is_read_with_weights_only(saved, tmp_path, monkeypatch):
    seen = []
    real = torch.load

    def spy(*a, **kw):
        seen.append(kw.get("weights_only"))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    load_checkpoint(saved[0], str(saved[1]))
    assert seen and all(w is True for w in seen), seen


def test_the_actor_is_told_its_version_and_counts_none(saved, tmp_path):
    """The controller owns the version: the actor trains from the version it is told (the
    proximal approximation and the staleness metrics use it), its weights are then that version
    + 1 whatever it held before, and a checkpoint records the version the caller gives."""
    from areal_fast.launch.runtime import ActorTrainer

    actor = actor_for(os.fspath(saved[1].parent / "model"), ppo={"prox_mode": "approx"})
    batch = make_batch(4, seed=2, version=3)
    for _ in range(2):  # told the same version twice: the same version after, no count of its own
        m = actor.train_batch(batch, version=5)
        assert actor.version == 6 and m["version"] == 6.0
        assert m["staleness_mean"] == m["staleness_max"] == 2  # made by v3, trained from v5 as told
    trainer = ActorTrainer(actor)
    trainer.train(batch, 9)
    assert actor.version == 10
    trainer.save(tmp_path / "told", 4)  # what the controller says these weights are
    assert read_trainer_state(str(tmp_path / "told"))["version"] == 4 == trainer.check(tmp_path / "told")
    trainer.load(tmp_path / "told")
    assert actor.version == 4


def _stack_global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that looks up ``module`` + ``name`` with STACK_GLOBAL and calls it with
    ``arg``: a dotted name reaches what ``module`` itself imports (``os.mkdir`` through DCP's own
    metadata module)."""
    import pickle

    def short_str(s: str) -> bytes:
        b = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b

    return (pickle.PROTO + b"\x04" + short_str(module) + short_str(name) + pickle.STACK_GLOBAL
            + pickle.BINUNICODE + len(arg.encode()).to_bytes(4, "little") + arg.encode()
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.metadata", "os.mkdir"),  # a dotted name through the module's imports
    ("torch.distributed.checkpoint.metadata", "os.makedirs"),
    ("torch.distributed.checkpoint.metadata", "field"),  # a function of the module, not a metadata class
    ("torch.serialization", "os.mkdir"),
])
def test_dcp_metadata_cannot_call_a_function_through_an_allowed_module(saved, tmp_path, module, name):
    """verify (every resume), load and eval refuse a .metadata calling anything but DCP's metadata
    classes, with an error naming the global, and nothing in it runs."""
    actor = saved[0]
    copy = _copy(saved, tmp_path)
    made = tmp_path / "made_by_the_metadata"
    (copy / ".metadata").write_bytes(_stack_global_call(module, name, str(made)))
    with pytest.raises(CheckpointError, match=re.escape(f"{module}.{name}") + ".*not allowed"):
        ckpt.verify_checkpoint(str(copy))
    assert not made.exists(), "reading the DCP metadata ran code from the file"
    with pytest.raises(CheckpointError, match=r"not allowed"):
        load_checkpoint(actor, str(copy))
    assert not made.exists(), "loading the DCP metadata ran code from the file"


def test_dcp_metadata_globals_are_an_explicit_list_of_classes():
    """Every global the metadata reader admits is a class (the layout lookup aside, which takes only
    a layout's name); a dotted name or a module's other attributes are refused."""
    import pickle

    u = ckpt._MetadataUnpickler(__import__("io").BytesIO(b""))
    for module, name in ckpt._MetadataUnpickler._GLOBALS:
        if module == "pathlib._local" and sys.version_info < (3, 13):
            continue  # where Python >= 3.13 pickles a path from
        obj = u.find_class(module, name)
        assert isinstance(obj, type) or obj is ckpt._layout_by_name, (module, name, obj)
    assert u.find_class("torch", "bfloat16") is torch.bfloat16
    assert u.find_class("torch.serialization", "_get_layout")("torch.strided") is torch.strided
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        u.find_class("torch.serialization", "_get_layout")("os")
    for module, name in [("torch.distributed.checkpoint.metadata", "os"), ("torch", "load"),
                         ("torch", "serialization.os.mkdir"), ("torch.distributed.checkpoint.metadata", "dataclass"),
                         ("pathlib", "os.mkdir"), ("collections", "OrderedDict.fromkeys")]:
        with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{module}.{name}")):
            u.find_class(module, name)


def test_the_trainer_state_temporary_is_created_exclusively_and_never_through_a_symlink(tmp_path):
    from areal_fast.diskutil import UnsafeOutputDir

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "trainer_state.pt.tmp").symlink_to(victim)  # planted where the state is written first
    with pytest.raises(UnsafeOutputDir, match="trainer_state.pt.tmp is a symlink"):
        ckpt._write_state_durably({"version": 1}, str(ck))
    assert victim.read_text() == "precious\n"
    (ck / "trainer_state.pt.tmp").unlink()
    (ck / "trainer_state.pt.tmp").write_bytes(b"left by a save that died")
    ckpt._write_state_durably({"version": 2}, str(ck))
    assert torch.load(ck / "trainer_state.pt", weights_only=True) == {"version": 2}
    assert not (ck / "trainer_state.pt.tmp").exists()
