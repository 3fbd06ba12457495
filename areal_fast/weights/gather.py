"""FSDP2 shards -> flattened buckets of full HF tensors on trainer rank 0, pipelined.

Per bucket every trainer rank packs its dim-0 shards of the bucket's tensors into one send
segment with the interval-copy kernel (casting fp32 -> bf16 on the way), ONE ``gather`` to
rank 0 collects the segments (rank 0 is the only rank that talks to the servers, so a gather
moves 1/N of an all-gather's bytes), and rank 0 unpacks them into the bucket buffer with a
second interval copy. Bucket k+1 is packed and gathered (async work handle; NCCL runs it on
its own stream) while the consumer sends bucket k (double buffers on every side).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from areal_fast.weights.interval_copy import interval_copy
from areal_fast.weights.layout import clean_name, is_skipped
from areal_fast.weights.plan import (
    CASTS,
    DST_OFF,
    SRC_OFF,
    BucketPlan,
    dtype_code,
    plan_fsdp_buckets,
    rows_cols,
    shard_rows,
)


@dataclass
class Sources:
    """The tensors to send: HF names, full shapes, the local (shard) tensors of this rank."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    local: list[torch.Tensor]
    n_ranks: int  # 1: every tensor is full on each rank; N: dim-0 FSDP2 shards over N ranks

    def key(self, dtypes) -> tuple:
        return (tuple(self.names), tuple(self.shapes), tuple(t.dtype for t in self.local), tuple(dtypes), self.n_ranks)


def collect_sources(model_or_state, group=None, skip: Callable[[str], bool] | None = None) -> Sources:
    """Tensors of an nn.Module (``state_dict(keep_vars=True)``, tied duplicates dropped by identity)
    or of a ``{name: tensor}`` dict. DTensors must be ``Shard(0)`` over the whole trainer group."""
    from torch.distributed.tensor import DTensor, Shard

    state = model_or_state.state_dict(keep_vars=True) if isinstance(model_or_state, torch.nn.Module) else model_or_state
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    names, shapes, local, seen, kinds = [], [], [], set(), set()
    for raw_name, t in state.items():
        name = clean_name(raw_name)
        if is_skipped(name) or (skip is not None and skip(name)) or id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),) and 1 < t.device_mesh.size() < world:
            loc = _expert_rows(t, world, rank, group)  # an expert-parallel tensor: this rank's FSDP2 rows of it
            kinds.add("sharded")
        elif isinstance(t, DTensor):
            if tuple(t.placements) != (Shard(0),) or t.device_mesh.size() != world:
                raise ValueError(f"{name}: DTensor placements {t.placements} over a mesh of "
                                 f"{t.device_mesh.size()}; only Shard(0) over all {world} ranks is supported")
            loc = t.to_local().detach()
            lo, hi = shard_rows(t.shape[0], world, rank)
            if loc.shape[0] != hi - lo:
                raise ValueError(f"{name}: local shard has {loc.shape[0]} rows, FSDP2 chunking says {hi - lo}")
            kinds.add("sharded")
        else:
            loc = t.detach()
            kinds.add("full")
        if not loc.is_contiguous():
            loc = loc.contiguous()
        names.append(name)
        shapes.append(tuple(t.shape))
        local.append(loc)
    if len(kinds) > 1:
        raise ValueError("mix of FSDP2-sharded and plain tensors; shard every parameter with fully_shard")
    n_ranks = world if kinds == {"sharded"} else 1
    return Sources(names, shapes, local, n_ranks)


def _expert_rows(t, world: int, rank: int, group) -> torch.Tensor:
    """Rows ``shard_rows(E, world, rank)`` of an expert-parallel DTensor (``Shard(0)`` over one expert-parallel
    group of ``ep`` consecutive ranks, the same experts in every such group): the members of this rank's group
    trade the rows each one's FSDP2-style shard needs (one ``all_to_all_single``), so the gather's plan and the
    bytes on the wire are the data-parallel ones."""
    mesh = t.device_mesh
    ep_group = mesh.get_group()
    members = dist.get_process_group_ranks(ep_group)  # global ranks, in ep index order
    if group is not None:
        members = [dist.get_group_rank(group, g) for g in members]
    local = t.to_local().detach().contiguous()
    e_local, total = local.shape[0], t.shape[0]
    first = mesh.get_local_rank() * e_local
    cols = local[0].numel() if e_local else 0

    def overlap(lo, hi, a, b):
        return max(lo, a), max(max(lo, a), min(hi, b))

    send, in_splits, out_splits = [], [], []
    my_lo, my_hi = shard_rows(total, world, rank)
    for i, q in enumerate(members):
        a, b = overlap(*shard_rows(total, world, q), first, first + e_local)
        send.append(local[a - first: b - first].reshape(-1))
        in_splits.append((b - a) * cols)
        a, b = overlap(my_lo, my_hi, i * e_local, (i + 1) * e_local)
        out_splits.append((b - a) * cols)
    out = local.new_empty(sum(out_splits))
    dist.all_to_all_single(out, torch.cat(send), out_splits, in_splits, group=ep_group)
    return out.view((my_hi - my_lo,) + tuple(t.shape[1:]))


def send_dtypes(src: Sources, dtype: torch.dtype | None) -> list[torch.dtype]:
    """Floating tensors are sent as ``dtype`` (None: as they are); others unchanged."""
    out = []
    for n, t in zip(src.names, src.local):
        d = t.dtype
        if dtype is not None and d.is_floating_point and d != dtype:
            if (dtype_code(d), dtype_code(dtype)) not in CASTS:
                raise ValueError(f"{n}: cannot cast {d} to {dtype} (supported: fp32 <-> bf16/fp16)")
            d = dtype
        out.append(d)
    return out


@dataclass
class Bucket:
    index: int
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # byte offsets in data
    data: torch.Tensor  # uint8, exactly the flattened bucket (ends where the last tensor ends)
    last: bool = False  # the last bucket of this update

    def tensor(self, i: int) -> torch.Tensor:
        n = int(np.prod(self.shapes[i], dtype=np.int64)) * self.dtypes[i].itemsize
        return self.data[self.offsets[i] : self.offsets[i] + n].view(self.dtypes[i]).view(self.shapes[i])


class BucketGatherer:
    """Plans once per (names, shapes, dtypes) and streams buckets to a consumer on rank 0."""

    def __init__(self, bucket_bytes: int, group=None, device: torch.device | None = None,
                 encode: Callable[[Bucket], Bucket] | None = None):
        self.bucket_bytes = int(bucket_bytes)
        # rank 0's transform of each gathered bucket before it is consumed (``weights/fp8.py``'s
        # quantisation: every transport then sends the encoded layout); None: sent as gathered
        self.encode = encode
        self.group = group
        self.device = device
        self._plans: dict = {}
        # CPU packing threads (0: all cores). The pack overlaps gloo's own copies of the previous
        # bucket, which need cores too; 1 keeps the overlap from starving them on small machines.
        self.pack_threads = int(os.environ.get("AREAL_FAST_PACK_THREADS", "0"))

    def plan(self, src: Sources, dtypes: list[torch.dtype]) -> BucketPlan:
        key = src.key(dtypes) + (self.bucket_bytes,)
        p = self._plans.get(key)
        if p is None:
            rc = np.array([rows_cols(s) for s in src.shapes], np.int64).reshape(-1, 2)
            p = plan_fsdp_buckets(rc[:, 0], rc[:, 1], [dtype_code(t.dtype) for t in src.local],
                                  [dtype_code(d) for d in dtypes], src.n_ranks, self.bucket_bytes)
            self._plans = {key: p}  # keep one: the model does not change shape between steps
        return p

    def run(self, src: Sources, dtypes: list[torch.dtype], consume: Callable | None) -> None:
        """``consume(bucket) -> handle`` (rank 0 only) starts sending a bucket and returns an object
        with ``wait()``; it is waited before the next bucket is handed over. Collective over the group."""
        plan = self.plan(src, dtypes)
        n = plan.n_ranks
        rank = dist.get_rank(self.group) if n > 1 else 0
        is0 = rank == 0
        dev = self.device or (src.local[0].device if src.local else torch.device("cpu"))
        nb = plan.n_buckets
        if nb == 0:
            return
        max_seg = int(plan.seg_bytes.max())
        send = [torch.empty(max_seg, dtype=torch.uint8, device=dev) for _ in range(min(2, nb))]
        gbuf = [torch.empty(n * max_seg, dtype=torch.uint8, device=dev) for _ in range(min(2, nb))] if (
            is0 and n > 1) else None
        bbuf = [torch.empty(int(plan.bucket_bytes.max()), dtype=torch.uint8, device=dev)
                for _ in range(min(2, nb))] if (is0 and n > 1) else None
        dst0 = dist.get_global_rank(self.group, 0) if (n > 1 and self.group is not None) else 0

        def start(b):
            seg = int(plan.seg_bytes[b])
            s = send[b % 2][:seg]
            interval_copy(src.local, [s], plan.pack_intervals(rank, b), n_threads=self.pack_threads)
            if n == 1:
                return None, s
            g = gbuf[b % 2][: n * seg] if is0 else None
            parts = [g[r * seg : (r + 1) * seg] for r in range(n)] if is0 else None
            return dist.gather(s, gather_list=parts, dst=dst0, group=self.group, async_op=True), g

        pending, handle, err = start(0), None, None
        for b in range(nb):
            work, g = pending
            if work is not None:
                work.wait()
            if is0:
                ts = plan.tensors_of(b).tolist()
                up = plan.unpack[b]
                if n == 1 and bool((up[:, SRC_OFF] == up[:, DST_OFF]).all()):
                    out = g[: int(plan.bucket_bytes[b])]  # one rank: the segment already is the bucket
                else:
                    out = bbuf[b % 2][: int(plan.bucket_bytes[b])]
                    interval_copy([g], [out], up)
                bucket = Bucket(b, [src.names[t] for t in ts], [dtypes[t] for t in ts], [src.shapes[t] for t in ts],
                                [int(plan.offset[t]) for t in ts], out, last=b == nb - 1)
                try:  # after a failure keep gathering, so the other ranks do not hang
                    if handle is not None:
                        handle, h = None, handle
                        h.wait()
                    if err is None and consume is not None:
                        handle = consume(bucket if self.encode is None else self.encode(bucket))
                except Exception as e:  # noqa: BLE001 - re-raised after the loop
                    err = err or e
            if b + 1 < nb:
                pending = start(b + 1)  # overlaps the consumer's send of bucket b
        try:
            if handle is not None:
                handle.wait()
        except Exception as e:  # noqa: BLE001
            err = err or e
        if err is not None:
            raise err
