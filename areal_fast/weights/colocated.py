"""The per-TP-rank shards of a colocated weight update, built one bucket at a time (the transport that
sends them through CUDA IPC is SGLang's: ``areal_fast/backends/sglang/colocated.py``).

Each trainer rank allocates its TP rank's SGLang-layout buffer (``1/tp`` of the model in the sent
dtype, plus the vocabulary padding) and plans it once (``plan_tp_shard``: qkv / gate_up stacking,
TP splits, replicated kv heads, vocabulary padding, cast), then fills it **one bucket at a time**
(:func:`build_tp_shard_streamed`): the HF tensors of a bucket of at most ``weights.bucket_bytes``
(a larger tensor alone) are materialised whole (``DTensor.full_tensor()``, one all-gather per
tensor, cast to the sent dtype on the shard before the gather), copied into the buffer by one
interval-copy launch, and freed before the next bucket; so the extra memory is one bucket, not
the model (a 7B model gathered whole in fp32 is 30.5 GB on every GPU).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from areal_fast.weights.interval_copy import interval_copy
from areal_fast.weights.layout import ModelSpec
from areal_fast.weights.plan import (
    CASTS,
    CODE_DTYPES,
    DST_DTYPE,
    DST_IDX,
    DST_LD,
    DST_OFF,
    INTERVAL_COLS,
    LEN,
    ROWS,
    SRC_IDX,
    TPShardPlan,
    consecutive_buckets,
    dtype_code,
    plan_tp_shard,
)


def unwritten_ranges(intervals: np.ndarray, buffer_bytes: int, dst: int = 0) -> np.ndarray:
    """``[k, 2]`` byte ranges ``[start, end)`` of destination ``dst`` (``buffer_bytes`` long) that
    no interval writes: what must be zeroed by hand (vocabulary padding rows, alignment gaps).
    A strided interval covers its rows, not the gaps between them."""
    iv = np.asarray(intervals, np.int64).reshape(-1, INTERVAL_COLS)
    iv = iv[(iv[:, DST_IDX] == dst) & (iv[:, LEN] * iv[:, ROWS] > 0)]
    es = np.array([CODE_DTYPES[c].itemsize for c in range(len(CODE_DTYPES))], np.int64)[iv[:, DST_DTYPE]]
    dense = (iv[:, ROWS] == 1) | (iv[:, DST_LD] == iv[:, LEN])  # one run each: offset .. offset + rows * len
    starts = [iv[dense, DST_OFF] * es[dense]]
    ends = [starts[0] + iv[dense, LEN] * iv[dense, ROWS] * es[dense]]
    sp = iv[~dense]
    if len(sp):  # strided: one run per row
        rows = sp[:, ROWS]
        row = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
        e = np.repeat(es[~dense], rows)
        s0 = (np.repeat(sp[:, DST_OFF], rows) + row * np.repeat(sp[:, DST_LD], rows)) * e
        starts.append(s0)
        ends.append(s0 + np.repeat(sp[:, LEN], rows) * e)
    start, end = np.concatenate(starts), np.concatenate(ends)
    order = np.argsort(start, kind="stable")
    start, end = start[order], np.maximum.accumulate(end[order]) if len(order) else end
    # a gap before each run that starts past everything written before it, and one at the end
    gap_start = np.concatenate([[0], end])
    gap_end = np.concatenate([start, [buffer_bytes]])
    keep = gap_end > gap_start
    return np.stack([gap_start[keep], gap_end[keep]], 1)


def _alloc(nbytes: int, device: torch.device) -> torch.Tensor:
    """The shard buffer, uninitialised (tests hand out garbage here to see that nothing relies on zeros)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def build_tp_shard(full: dict[str, torch.Tensor], spec: ModelSpec, tp: int, tp_rank: int,
                   dtype: torch.dtype = torch.bfloat16, plan: TPShardPlan | None = None
                   ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], TPShardPlan]:
    """TP rank ``tp_rank``'s SGLang-layout parameters from full HF tensors, in one buffer (works on
    CPU too; tests compare it with :func:`areal_fast.weights.layout.hf_to_sglang`).

    Only the bytes no interval writes are zeroed (the vocabulary padding rows and the 16-byte
    alignment gaps, :func:`unwritten_ranges`): zero-filling the whole buffer first would write
    every byte twice, ~15 GB a 7B update.
    """
    return build_tp_shard_streamed(full, spec, tp, tp_rank, dtype, plan)


def _gather_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``t`` is materialised in: a sharded floating tensor is cast to the sent dtype on its
    shard, before the all-gather (half the bytes gathered and held for fp32 -> bf16; the cast is
    elementwise, so the bits equal the interval copy's cast); a full tensor as it is (the copy casts)."""
    from torch.distributed.tensor import DTensor

    if (isinstance(t, DTensor) and t.dtype != dtype and t.dtype.is_floating_point
            and (dtype_code(t.dtype), dtype_code(dtype)) in CASTS):
        return dtype
    return t.dtype


def materialize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full tensor of ``t`` (a DTensor shard: all-gathered, cast first per :func:`_gather_dtype`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        d = _gather_dtype(t, dtype)
        t = (t.to(d) if d != t.dtype else t).full_tensor()
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def source_buckets(nbytes: list[int], bucket_bytes: int | None) -> list[list[int]]:
    """Consecutive groups of tensors of at most ``bucket_bytes`` together (a larger tensor alone);
    None: one group of all."""
    if bucket_bytes is None:
        return [list(range(len(nbytes)))] if nbytes else []
    return consecutive_buckets(nbytes, bucket_bytes)


def build_tp_shard_streamed(sources: dict[str, torch.Tensor], spec: ModelSpec, tp: int, tp_rank: int,
                            dtype: torch.dtype = torch.bfloat16, plan: TPShardPlan | None = None,
                            bucket_bytes: int | None = None,
                            full_of: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = materialize,
                            ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], TPShardPlan]:
    """:func:`build_tp_shard` from full tensors or FSDP2 ``Shard(0)`` DTensors, materialising the
    sources ``bucket_bytes`` at a time (in the HF order, the same on every rank: the all-gathers
    are collective), each bucket copied into the buffer by one interval copy and freed before the
    next. Peak extra memory: the buffer plus one bucket (a tensor larger than a bucket alone)."""
    names = list(spec.hf_shapes())
    ts = [sources[n] for n in names]
    src_dt = [_gather_dtype(t, dtype) for t in ts]
    if plan is None:
        plan = plan_tp_shard(spec, tp, tp_rank, names, [tuple(t.shape) for t in ts],
                             [dtype_code(d) for d in src_dt], dtype)
    device = ts[0].device if ts else torch.device("cpu")
    buf = _alloc(plan.buffer_bytes, device)
    for a, b in unwritten_ranges(plan.intervals[0], plan.buffer_bytes).tolist():
        buf[a:b].zero_()
    iv = np.asarray(plan.intervals[0], np.int64).reshape(-1, INTERVAL_COLS)
    nbytes = [t.numel() * d.itemsize for t, d in zip(ts, src_dt)]
    for group in source_buckets(nbytes, bucket_bytes):
        local = np.full(len(ts), -1, np.int64)
        local[group] = np.arange(len(group))
        sub = iv[local[iv[:, SRC_IDX]] >= 0].copy()
        sub[:, SRC_IDX] = local[sub[:, SRC_IDX]]
        srcs = [full_of(ts[i], dtype) for i in group]
        interval_copy(srcs, [buf], sub)
        del srcs  # on CUDA the copy is queued on the current stream: the allocator reuses the memory after it
    named = []
    for n, shp, off in zip(plan.names, plan.shapes, plan.offsets.tolist()):
        nb = dtype.itemsize * torch.Size(shp).numel()
        named.append((n, buf[off : off + nb].view(dtype).view(shp)))
    return buf, named, plan
