"""The trainer's part of a checkpoint: torch.distributed.checkpoint (DCP) for model + optimizer,
resharded on load, so a run saved on N ranks resumes on M; and an HF safetensors export. The run's
checkpoint layout (where this directory lives, the names in it) is ``areal_fast.checkpoint``'s.

Layout of the trainer's directory: DCP files (``.metadata``, ``__<rank>_0.distcp``) holding
``model`` and ``optim`` under the HF-canonical FQNs (``lm.`` prefix), and ``trainer_state.pt``
(rank 0): version (the one the caller gives: the controller's), scheduler state, and the RNG
states (CPU and CUDA of rank 0, restored on every rank; the trainer itself draws no random
numbers during a step).

Durability: when :func:`save_checkpoint` returns, every file it wrote is on disk (each rank
fsyncs its own DCP shard, rank 0 the metadata; ``trainer_state.pt`` is written to a temporary
name (created exclusively, a symlink there refused), fsynced, renamed, and the directory fsynced),
so a caller may mark the checkpoint complete right after. A damaged checkpoint raises
:class:`CheckpointError` naming the file.

Reading is not executing: ``trainer_state.pt`` is read with ``torch.load(weights_only=True)`` (its
entries are ints, tensors, None and the LR scheduler's plain state dict); DCP's ``.metadata`` (a
pickle) through :class:`_SafeReader`, which admits only an explicit list of DCP's metadata classes,
``torch.Size``, dtypes and layouts (by name), never a dotted name or a function; and DCP's non-tensor
entries (the optimizer's param groups, which torch reads with ``weights_only=False``) through
:class:`_SafeLoadPlanner` with ``weights_only=True``.
:func:`verify_checkpoint` checks, without loading a tensor, that every DCP shard the metadata names
is present and long enough, so a truncated shard is found before the collective load starts.
"""

from __future__ import annotations

import io
import json
import os
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from areal_fast.checkpoint import TRAINER_STATE_FILE as _STATE_FILE
from areal_fast.diskutil import open_private_temp

_METADATA_FILE = ".metadata"
_STATE_KEYS = ("version", "scheduler", "rng_cpu", "rng_cuda")
_OPTIONAL_STATE_KEYS = ("world_size",)


class CheckpointError(RuntimeError):
    """A trainer checkpoint is missing a file or a file is damaged; the message names the path."""


def _layout_by_name(name):
    """``torch.serialization._get_layout`` (how a pickled ``torch.layout`` is rebuilt), taking only a
    layout's name and returning only a layout."""
    from torch.serialization import _get_layout

    try:
        layout = _get_layout(name) if isinstance(name, str) else None
    except KeyError:
        layout = None
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"layout {name!r} is not allowed in checkpoint metadata (not a torch layout)")
    return layout


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` without arbitrary globals: the classes torch writes there (listed from the
    pickle of a real save), torch dtypes, and layouts by name; nothing else. A dotted name (protocol 4
    resolves ``os.mkdir`` through a module's own imports) or a function is refused."""

    _GLOBALS = frozenset({
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # the same, Python >= 3.13
        ("collections", "OrderedDict"),
    })

    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in self._GLOBALS:
                obj = super().find_class(module, name)
                if isinstance(obj, type):
                    return obj
            elif module == "torch.serialization" and name == "_get_layout":
                return _layout_by_name
            elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata (only DCP's "
                                     f"metadata classes, torch dtypes and layouts are)")


class _SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # as the parent does

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (the directory entry of a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_state_durably(extra: dict, path: str) -> None:
    final = os.path.join(path, _STATE_FILE)
    tmp = final + ".tmp"
    with os.fdopen(open_private_temp(tmp), "wb") as f:  # O_EXCL, O_NOFOLLOW: a planted symlink is refused
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_path(path)


def _model_options(actor, strict: bool = True):
    """A LoRA actor's checkpoint holds its adapter, not the frozen base (reloaded from model_path); on
    load every adapter matrix must be in it (DCP's load fails on a key the checkpoint lacks), the base
    is not looked for (``strict=False``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if getattr(actor, "lora", None) is None:
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _dcp_state(actor) -> dict:
    """What DCP saves and loads: the model's and the optimizer's state dicts; with expert parallelism the
    experts (and their moments) as DTensors of all experts (``parallel/expert.py``), so a checkpoint
    saved under one mesh loads under another."""
    from areal_fast.trainer.parallel.expert import global_optim_state, global_state

    mesh = getattr(actor, "pmesh", None)
    return {
        "model": global_state(actor.model, get_model_state_dict(actor.model, options=_model_options(actor)), mesh),
        "optim": global_optim_state(actor.model, get_optimizer_state_dict(actor.model, actor.optimizer), mesh),
    }


def save_checkpoint(actor, path: str, version: int | None = None) -> None:
    """Save everything needed to resume ``actor`` (collective: every rank calls it), recording its
    weights as ``version`` (the controller's; None: ``actor.version``). Returns once every file is on
    disk (see the module docstring)."""
    os.makedirs(path, exist_ok=True)
    dcp.save(_dcp_state(actor), checkpoint_id=path)
    rank = dist.get_rank()
    # each rank makes its own shard durable (ranks may not share a page cache); rank 0 the metadata
    for name in os.listdir(path):
        if name.startswith(f"__{rank}_") or (rank == 0 and name == _METADATA_FILE):
            _fsync_path(os.path.join(path, name))
    if rank == 0:
        extra = {
            "version": actor.version if version is None else int(version),
            "scheduler": actor.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "world_size": dist.get_world_size(),
        }
        _write_state_durably(extra, path)
    dist.barrier()


def read_trainer_state(path: str) -> dict:
    """The small ``trainer_state.pt`` of checkpoint ``path`` (no model needed): a cheap check that a
    checkpoint is readable before choosing it. Read with ``weights_only=True`` (an edited file cannot
    run code), every entry type-checked. Raises :class:`CheckpointError` naming the file."""
    state_file = os.path.join(path, _STATE_FILE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{state_file}: missing; {path!r} is not a complete trainer checkpoint")
    if not os.path.isfile(os.path.join(path, _METADATA_FILE)):
        raise CheckpointError(f"{os.path.join(path, _METADATA_FILE)}: missing; the model/optimizer state of "
                              f"{path!r} was not written completely")
    try:
        extra = torch.load(state_file, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated, garbage or a forbidden global: EOFError, UnpicklingError, RuntimeError...
        raise CheckpointError(f"{state_file}: cannot be read ({type(e).__name__}: {str(e)[:300]}); the file is "
                              f"damaged") from e
    problem = _trainer_state_problem(extra)
    if problem:
        raise CheckpointError(f"{state_file}: not a trainer state ({problem})")
    return extra


def _trainer_state_problem(extra) -> str | None:
    """What is wrong with a loaded ``trainer_state.pt`` (None: nothing)."""
    if not isinstance(extra, dict) or any(k not in extra for k in _STATE_KEYS):
        return f"expected the keys {list(_STATE_KEYS)}"
    unknown = sorted(set(extra) - set(_STATE_KEYS) - set(_OPTIONAL_STATE_KEYS))
    if unknown:
        return f"unknown entries {unknown}"
    v = extra["version"]
    if type(v) is not int or v < 0:
        return f"version must be an integer >= 0, got {v!r}"
    ws = extra.get("world_size", 1)
    if type(ws) is not int or ws < 1:
        return f"world_size must be an integer >= 1, got {ws!r}"
    if not isinstance(extra["scheduler"], dict):
        return f"scheduler must be a dict, got {type(extra['scheduler']).__name__}"
    if not (isinstance(extra["rng_cpu"], torch.Tensor) and extra["rng_cpu"].dtype == torch.uint8):
        return "rng_cpu must be a uint8 tensor"
    if extra["rng_cuda"] is not None and not (isinstance(extra["rng_cuda"], torch.Tensor)
                                              and extra["rng_cuda"].dtype == torch.uint8):
        return "rng_cuda must be a uint8 tensor or None"
    return None


def verify_checkpoint(path: str) -> dict:
    """Check checkpoint ``path`` without loading a tensor: :func:`read_trainer_state`, the DCP
    metadata, and every shard file it names present and at least as long as the bytes it names
    there (a truncated shard). Returns the trainer state; raises :class:`CheckpointError`."""
    extra = read_trainer_state(path)
    try:
        storage = _SafeReader(path).read_metadata().storage_data
        need: dict[str, int] = {}
        for info in storage.values():
            rel = str(info.relative_path)
            if os.path.basename(rel) != rel or rel in ("", ".", ".."):  # a shard lives in the checkpoint
                raise ValueError(f"shard name {rel!r} points outside the checkpoint")
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - pickle, attribute and type errors of a damaged file alike
        raise CheckpointError(f"{os.path.join(path, _METADATA_FILE)}: cannot be read ({type(e).__name__}: "
                              f"{str(e)[:300]}); the file is damaged") from e
    for rel, nbytes in sorted(need.items()):
        shard = os.path.join(path, rel)
        try:
            size = os.stat(shard).st_size
        except OSError as e:
            raise CheckpointError(f"{shard}: missing ({e.strerror}); the model/optimizer state of {path!r} is "
                                  f"incomplete") from e
        if size < nbytes:
            raise CheckpointError(f"{shard}: {size} bytes, the metadata names {nbytes}; the shard is truncated")
    return extra


def load_checkpoint(actor, path: str) -> None:
    """Restore ``actor`` from ``path`` written by :func:`save_checkpoint` on any rank count.
    A missing or damaged file raises :class:`CheckpointError` naming it (checked first by
    :func:`verify_checkpoint`, so a refused metadata global is named rather than lost in DCP's error)."""
    extra = verify_checkpoint(path)
    state = _dcp_state(actor)
    try:
        dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP's own error derives from BaseException
        raise CheckpointError(f"{path}: the model/optimizer state (DCP files) cannot be read "
                              f"({type(e).__name__}: {str(e)[:300]})") from e
    from areal_fast.trainer.parallel.expert import local_state

    state = local_state(state)  # expert parallelism: the experts were loaded in place, as this rank's rows
    try:  # a checkpoint of another model or optimizer, or an edited scheduler state
        set_model_state_dict(actor.model, state["model"], options=_model_options(actor, strict=False))
        set_optimizer_state_dict(actor.model, actor.optimizer, state["optim"])
        actor.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng_cpu"])
        if extra["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng_cuda"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: the saved state does not fit this trainer ({type(e).__name__}: "
                              f"{str(e)[:300]})") from e
    actor.version = extra["version"]


def export_hf(actor, path: str, dtype: torch.dtype | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write ``config.json`` and ``model*.safetensors`` (HF names, unsharded) to ``path`` from rank 0;
    loadable by ``AutoModelForCausalLM.from_pretrained`` and by :class:`PPOActor`. Collective.
    A LoRA actor writes its adapter (PEFT's directory) and, with ``lora.save_merged``, the merged
    model in ``path/merged`` (``trainer/lora.py``)."""
    from safetensors.torch import save_file

    from areal_fast.weights.experts import to_checkpoint_state

    if getattr(actor, "lora", None) is not None:
        from areal_fast.trainer.lora import export_adapter

        export_adapter(actor, path, dtype)
        return

    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in actor.iter_full_params(dtype):
        if not rank0:
            continue
        t = t.detach().cpu().contiguous()
        if size and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        # MoE: the fused expert tensors as the checkpoint's per-expert ones (what SGLang and vLLM load)
        shards[-1].update((n, p if p is t else p.clone()) for n, p in to_checkpoint_state({name: t}).items())
        size += t.nbytes
    if rank0:
        actor.hf_config.save_pretrained(path)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, sh in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, os.path.join(path, fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(sh, fname))
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    dist.barrier()
