"""Server side of SGLang's weight-update protocol for the embedded engine (see docs/sglang.md).

Group rendezvous exactly as SGLang (and vLLM / OpenRLHF before it) do it, so a trainer written for
SGLang joins us unchanged: ``rendezvous("tcp://addr:port", rank, world_size)`` -> the store is wrapped
in ``PrefixStore(group_name, store)`` -> ``_new_process_group_helper(..., group_name=group_name)``.
The trainer is rank 0 and hosts the TCP store; this server (tensor parallel size 1) is
``rank_offset``. No default process group is created in the server.

Every wait is bounded by ``timeout_s`` (the group's timeout): a trainer that joins and then never
sends makes the update call fail with a clear message instead of blocking the engine.

Transfer layouts, in the order of ``names``:
- per tensor (any ``load_format`` but "flattened_bucket"): one broadcast per tensor;
- ``flattened_bucket``: ONE uint8 broadcast holding the tensors packed back to back (tensor i starts
  where tensor i-1 ends, no padding), as SGLang's ``FlattenedTensorBucket`` lays them out. A tensor
  whose byte offset is not a multiple of its element size cannot be viewed in place: SGLang 0.5.23
  refuses such a bucket before receiving, older releases fail after receiving it.

Delta updates (``areal_fast.weights.delta``) arrive as ordinary entries with marked names
(``NAME#delta_idx:SHAPE`` + ``NAME#delta_val``); :meth:`WeightReceiver.load` applies them in place with
the delta codec's kernels. The server advertises it in /server_info as ``engine: areal_fast.embedded``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from areal_fast.weights.delta_wire import apply_named, check_delta, split_entries
from areal_fast.weights.fp8 import dequantize_state, wire_view

# Names SGLang skips on load (buffers recomputed by the model, never sent by a well-behaved trainer).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
DEFAULT_GROUP_TIMEOUT_S = 120.0  # one bucket (~1 GB) takes seconds; a silent trainer fails after this


@dataclass
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (SGLang sends torch attribute names without 'torch.')."""
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string like 'bfloat16', got {name!r}")
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def flattened_bucket_layout(metas: list[TensorMeta]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a flattened bucket (back to back) and the total size in bytes."""
    offsets, end = [], 0
    for m in metas:
        offsets.append(end)
        end += m.nbytes
    return offsets, end


def unaligned_tensor(metas: list[TensorMeta]) -> str | None:
    """The message SGLang gives for the first tensor at an offset its dtype cannot be viewed at, or None."""
    offsets, _ = flattened_bucket_layout(metas)
    for m, off in zip(metas, offsets):
        item = torch.empty((), dtype=m.dtype).element_size()
        if off % item:
            return f"Unaligned received tensor {m.name}: byte offset {off}, dtype {m.dtype}"
    return None


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
):
    """Create a process group that is not the default group (SGLang's ``init_custom_process_group``)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightReceiver:
    """Holds the weight-update groups of one server and loads received tensors into the HF model."""

    def __init__(self, model: torch.nn.Module, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S):
        self.model = model
        self.device = next(model.parameters()).device
        self.timeout_s = timeout_s
        self.groups: dict[str, object] = {}
        self._params = dict(model.named_parameters(remove_duplicate=False))
        # MoE: the checkpoint's per-expert names (what the weight sync sends) write into views of
        # the fused expert parameters; the fused names are accepted as well
        from areal_fast.weights.experts import checkpoint_views

        self._params.update(checkpoint_views(self._params))

    # -------------------------------------------------------------- groups
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists; destroy it first")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs the engine on --device cuda; use 'gloo' on CPU")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if backend == "gloo" and master_address.startswith("127."):
            # gloo binds the interface its hostname resolves to; on loopback rendezvous force "lo"
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        pg = init_custom_process_group(
            backend, f"tcp://{master_address}:{master_port}", world_size, rank_offset, group_name,
            timeout_s=self.timeout_s,
        )
        self.groups[group_name] = pg

    def destroy_group(self, group_name: str) -> None:
        import torch.distributed as dist

        pg = self.groups.pop(group_name, None)
        if pg is None:
            raise ValueError(f"no weight update group named {group_name!r}")
        dist.destroy_process_group(pg)

    # -------------------------------------------------------------- transfer
    def receive(self, metas: list[TensorMeta], group_name: str, load_format: str | None,
                check_alignment: bool = True) -> list[tuple[str, torch.Tensor]]:
        """Receive the broadcasts of one update call (rank 0 sends); returns HF-named tensors.

        Touches no model state, so it may run off the scheduler thread; each broadcast fails after
        the group's timeout when the trainer sends nothing.
        """
        import torch.distributed as dist

        pg = self.groups.get(group_name)
        if pg is None:
            raise ValueError(f"no weight update group named {group_name!r}; call /init_weights_update_group")
        if load_format == "flattened_bucket":
            if not metas:
                raise ValueError("Cannot create empty tensor bucket")
            bad = unaligned_tensor(metas)
            if bad and check_alignment:
                raise ValueError(bad)  # refused before anything is received, as SGLang 0.5.23 does
            offsets, total = flattened_bucket_layout(metas)
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, src=0, group=pg)
            if bad:  # what older SGLang hits when it views the received bytes
                raise RuntimeError(f"cannot view the received bucket: {bad}")
            return [(m.name, buf[off:off + m.nbytes].view(m.dtype).view(m.shape)) for m, off in zip(metas, offsets)]
        out = []
        for m in metas:
            t = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            dist.broadcast(wire_view(t), src=0, group=pg)  # FP8 as its bytes: gloo has no FP8 type
            out.append((m.name, t))
        return out

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (dtype cast) and apply delta entries in place
        (``areal_fast.weights.delta_wire``: only the changed elements, bitwise); unknown names, bad
        shapes and indices outside a parameter raise before anything is written."""
        whole, deltas = split_entries(dequantize_state(named))  # FP8 weights + scales -> dequantised weights
        todo = [(n, t) for n, t in whole if not n.endswith(_SKIPPED_SUFFIXES)]
        deltas = {n: d for n, d in deltas.items() if not n.endswith(_SKIPPED_SUFFIXES)}
        unknown = [n for n, _ in todo if n not in self._params] + [n for n in deltas if n not in self._params]
        if unknown:
            raise ValueError(f"unknown parameter names {unknown[:5]} (model has e.g. {list(self._params)[:3]})")
        for n, t in todo:
            p = self._params[n]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"shape mismatch for {n}: model {tuple(p.shape)}, received {tuple(t.shape)}")
        for n, (shape, idx, _val) in deltas.items():
            check_delta(n, self._params[n], shape, idx)
        with torch.no_grad():
            for n, t in todo:
                self._params[n].copy_(t)
            for n, (_shape, idx, val) in deltas.items():
                apply_named(n, self._params[n], idx, val)

    def read_from_disk(self, model_path: str) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the ``*.safetensors`` files of a Hugging Face checkpoint directory."""
        import glob

        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path!r}")
        named = []
        for f in files:
            named.extend(load_file(f, device=str(self.device)).items())
        return named
