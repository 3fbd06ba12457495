"""Reshard plans: Python wrappers of the C++ planner (``csrc/reshard/planner.cpp``) and a
pure-Python reference that must produce identical arrays.

A plan is a set of copy *intervals*, int64 rows of ``INTERVAL_COLS`` columns
``(src_idx, src_off, src_ld, dst_idx, dst_off, dst_ld, len, rows, src_dtype, dst_dtype)``:
``rows`` runs of ``len`` elements, run k from element ``src_off + k*src_ld`` of source
``src_idx`` to element ``dst_off + k*dst_ld`` of destination ``dst_idx`` (offsets in elements of
each side's dtype), executed by :func:`areal_fast.weights.interval_copy.interval_copy`.

``backend=`` on every planner: 'native' (C++), 'reference' or None (:func:`areal_fast.dispatch.select`,
op ``weights.plan``: native when the core is built, else the reference with a warning).

Sources are 2-D ``[rows, cols]`` views (dim 0 x the rest) that are full (``n_ranks=1``) or
sharded on dim 0 over ``n_ranks`` like FSDP2 (``torch.chunk``: rank r holds rows
``[r*c, (r+1)*c)`` clipped, ``c = ceil(rows / n_ranks)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from areal_fast.dispatch import native, select

INTERVAL_COLS = 10
BLOCK_COLS = 9  # src, row0, col0, n_rows, n_cols, dst_idx, dst_off, dst_ld, dst_dtype
SRC_IDX, SRC_OFF, SRC_LD, DST_IDX, DST_OFF, DST_LD, LEN, ROWS, SRC_DTYPE, DST_DTYPE = range(INTERVAL_COLS)
SEG_ALIGN = 16  # gather segments start 16-byte aligned (vector loads in the CUDA kernel)

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.uint8: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3,
    torch.float64: 4, torch.int32: 5, torch.int64: 6, torch.int16: 7,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
CASTS = {(1, 2), (1, 3), (2, 1), (3, 1)}  # fp32 <-> bf16 / fp16, besides same-dtype copies


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported by the reshard core ({list(DTYPE_CODES)})") from None


def rows_cols(shape) -> tuple[int, int]:
    """2-D view of a shape: (dim 0, product of the rest); a scalar is (1, 1)."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def shard_rows(rows: int, n_ranks: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a dim-0 sharded tensor held by ``rank`` (FSDP2 / torch.chunk)."""
    c = -(-rows // n_ranks)
    return min(rank * c, rows), min((rank + 1) * c, rows)


def _i64(x, name: str) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(x, dtype=np.int64))
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D")
    return a


# ---------------------------------------------------------------------------------------- buckets
def assign_buckets(nbytes, align, bucket_bytes: int, backend: str | None = None):
    """Greedy order-preserving packing -> (bucket [T], byte offset [T], bucket_bytes [B])."""
    nbytes, align = _i64(nbytes, "nbytes"), _i64(align, "align")
    if select("weights.plan", None, backend=backend) == "reference":
        return assign_buckets_ref(nbytes, align, bucket_bytes)
    return native().reshard_assign_buckets(nbytes, align, int(bucket_bytes))


def assign_buckets_ref(nbytes, align, bucket_bytes: int):
    if bucket_bytes <= 0:
        raise ValueError("assign_buckets: bucket_bytes must be > 0")
    bucket, offset, sizes = [], [], []
    cur, empty = 0, True
    for nb, al in zip(np.asarray(nbytes).tolist(), np.asarray(align).tolist()):
        off = -(-cur // al) * al
        if not empty and off + nb > bucket_bytes:
            sizes.append(cur)
            cur, off = 0, 0
        bucket.append(len(sizes))
        offset.append(off)
        cur, empty = off + nb, False
    if not empty:
        sizes.append(cur)
    return (np.array(bucket, np.int64), np.array(offset, np.int64), np.array(sizes, np.int64))


def consecutive_buckets(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The indices of ``nbytes`` in order, grouped as :func:`assign_buckets` packs them without alignment:
    consecutive items of at most ``bucket_bytes`` together, a larger one alone."""
    if not len(nbytes):
        return []
    bucket = assign_buckets(nbytes, np.ones(len(nbytes), np.int64), bucket_bytes)[0].tolist()
    out: list[list[int]] = [[] for _ in range(bucket[-1] + 1)]
    for i, b in enumerate(bucket):
        out[b].append(i)
    return out


def _emit(out: list, src_idx, src_off, src_ld, dst_idx, dst_off, dst_ld, length, rows, sdt, ddt):
    """Reference twin of emit() in planner.cpp (same coalescing rule)."""
    if length <= 0 or rows <= 0:
        return
    if rows == 1:
        src_ld = dst_ld = length
        if out:
            p = out[-1]
            if (p[ROWS] == 1 and p[SRC_IDX] == src_idx and p[DST_IDX] == dst_idx and p[SRC_DTYPE] == sdt
                    and p[DST_DTYPE] == ddt and p[SRC_OFF] + p[LEN] == src_off and p[DST_OFF] + p[LEN] == dst_off):
                p[LEN] += length
                p[SRC_LD] = p[DST_LD] = p[LEN]
                return
    out.append([src_idx, src_off, src_ld, dst_idx, dst_off, dst_ld, length, rows, sdt, ddt])


def _as_intervals(rows: list) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, INTERVAL_COLS)


# ------------------------------------------------------------------------------------------ blocks
def plan_blocks(src_rows, src_cols, src_dtype, n_ranks: int, blocks, backend: str | None = None) -> list[np.ndarray]:
    """Intervals per source rank that copy each block (rows x cols of a source) to its
    destination; see BlockCol in planner.h for the block columns."""
    src_rows, src_cols, src_dtype = _i64(src_rows, "src_rows"), _i64(src_cols, "src_cols"), _i64(src_dtype, "src_dtype")
    blocks = np.ascontiguousarray(np.asarray(blocks, dtype=np.int64).reshape(-1, BLOCK_COLS))
    if select("weights.plan", None, backend=backend) == "reference":
        return plan_blocks_ref(src_rows, src_cols, src_dtype, n_ranks, blocks)
    return native().reshard_plan_blocks(src_rows, src_cols, src_dtype, int(n_ranks), blocks)


def plan_blocks_ref(src_rows, src_cols, src_dtype, n_ranks: int, blocks) -> list[np.ndarray]:
    if n_ranks < 1:
        raise ValueError("plan_blocks: n_ranks must be >= 1")
    out: list[list] = [[] for _ in range(n_ranks)]
    for b, (t, row0, col0, nr, nc, di, doff, dld, ddt) in enumerate(np.asarray(blocks).tolist()):
        if not 0 <= t < len(src_rows):
            raise ValueError(f"plan_blocks: block {b} names source {t}")
        rows, cols, sdt = int(src_rows[t]), int(src_cols[t]), int(src_dtype[t])
        if row0 < 0 or nr < 0 or row0 + nr > rows or col0 < 0 or nc < 0 or col0 + nc > cols:
            raise ValueError(f"plan_blocks: block {b} is outside source {t} [{rows}, {cols}]")
        if sdt != ddt and (sdt, ddt) not in CASTS:
            raise ValueError(f"plan_blocks: block {b}: cast from dtype {sdt} to {ddt} is not supported")
        full = nc == cols and dld == cols
        for r in range(n_ranks):
            lo, hi = shard_rows(rows, n_ranks, r)
            a, e = max(lo, row0), min(hi, row0 + nr)
            if a >= e:
                continue
            so, do = (a - lo) * cols + col0, doff + (a - row0) * dld
            if full:
                _emit(out[r], t, so, cols, di, do, cols, (e - a) * cols, 1, sdt, ddt)
            else:
                _emit(out[r], t, so, cols, di, do, dld, nc, e - a, sdt, ddt)
    return [_as_intervals(o) for o in out]


# ------------------------------------------------------------------------------- FSDP2 -> buckets
@dataclass(frozen=True)
class BucketPlan:
    """FSDP2 shards -> flattened buckets of full tensors.

    Bucket b holds tensors ``tensors_of(b)``; tensor t sits at byte ``offset[t]``. Rank r packs
    ``pack_intervals(r, b)`` (source t = its local shard of tensor t, destination 0 = its send
    segment of ``seg_bytes[b]`` bytes); a gather puts segment r at byte ``r * seg_bytes[b]`` of
    rank 0's gather buffer, and ``unpack[b]`` (bytes, gather buffer -> bucket buffer) finishes.
    """

    n_ranks: int
    bucket: np.ndarray
    offset: np.ndarray
    bucket_bytes: np.ndarray
    seg_bytes: np.ndarray
    pack: list
    pack_bounds: list
    unpack: list

    @property
    def n_buckets(self) -> int:
        return len(self.bucket_bytes)

    def tensors_of(self, b: int) -> np.ndarray:
        return np.nonzero(self.bucket == b)[0]

    def pack_intervals(self, rank: int, b: int) -> np.ndarray:
        lo, hi = self.pack_bounds[rank][b], self.pack_bounds[rank][b + 1]
        return self.pack[rank][lo:hi]


def plan_fsdp_buckets(rows, cols, src_dtype, dst_dtype, n_ranks: int, bucket_bytes: int,
                      backend: str | None = None) -> BucketPlan:
    args = [_i64(x, n) for x, n in ((rows, "rows"), (cols, "cols"), (src_dtype, "src_dtype"), (dst_dtype, "dst_dtype"))]
    if select("weights.plan", None, backend=backend) == "reference":
        return plan_fsdp_buckets_ref(*args, n_ranks, bucket_bytes)
    d = native().reshard_plan_fsdp_buckets(*args, int(n_ranks), int(bucket_bytes))
    return BucketPlan(n_ranks, d["bucket"], d["offset"], d["bucket_bytes"], d["seg_bytes"], list(d["pack"]),
                      list(d["pack_bounds"]), list(d["unpack"]))


def plan_fsdp_buckets_ref(rows, cols, src_dtype, dst_dtype, n_ranks: int, bucket_bytes: int) -> BucketPlan:
    n = len(rows)
    for t in range(n):
        s, d = int(src_dtype[t]), int(dst_dtype[t])
        if s != d and (s, d) not in CASTS:
            raise ValueError(f"plan_fsdp_buckets: tensor {t}: cast from dtype {s} to {d} is not supported")
    es = [CODE_DTYPES[int(d)].itemsize for d in dst_dtype]
    nbytes = [int(rows[t]) * int(cols[t]) * es[t] for t in range(n)]
    bucket, offset, sizes = assign_buckets_ref(nbytes, es, bucket_bytes)
    nb = len(sizes)
    pack = [[] for _ in range(n_ranks)]
    bounds = [[0] * (nb + 1) for _ in range(n_ranks)]
    unpack, seg_bytes = [], []
    for b in range(nb):
        ts = [t for t in range(n) if bucket[t] == b]
        seg_off = {}
        seg_end = [0] * n_ranks
        for r in range(n_ranks):
            bounds[r][b] = len(pack[r])
            for t in ts:
                lo, hi = shard_rows(int(rows[t]), n_ranks, r)
                off = -(-seg_end[r] // es[t]) * es[t]
                elems = (hi - lo) * int(cols[t])
                seg_off[t, r] = off
                seg_end[r] = off + elems * es[t]
                _emit(pack[r], t, 0, elems, 0, off // es[t], elems, elems, 1, int(src_dtype[t]), int(dst_dtype[t]))
        seg = -(-max(seg_end) // SEG_ALIGN) * SEG_ALIGN
        seg_bytes.append(seg)
        up: list = []
        for t in ts:
            for r in range(n_ranks):
                lo, hi = shard_rows(int(rows[t]), n_ranks, r)
                rb = int(cols[t]) * es[t]
                _emit(up, 0, r * seg + seg_off[t, r], 0, 0, int(offset[t]) + lo * rb, 0, (hi - lo) * rb, 1, 0, 0)
        unpack.append(_as_intervals(up))
    for r in range(n_ranks):
        bounds[r][nb] = len(pack[r])
    return BucketPlan(n_ranks, bucket, offset, sizes, np.array(seg_bytes, np.int64),
                      [_as_intervals(p) for p in pack], [np.array(b, np.int64) for b in bounds], unpack)


# ----------------------------------------------------------------------------- per-TP-rank shards
@dataclass(frozen=True)
class TPShardPlan:
    """HF tensors (full or FSDP2 shards) -> one flat buffer per TP rank in SGLang layout.

    ``names[i]``/``shapes[i]``/``offsets[i]`` (bytes) describe the SGLang parameters in the
    buffer of ``buffer_bytes``; ``intervals[r]`` are source rank r's copies (dst_idx 0 = buffer).
    Vocabulary padding rows are not written (the buffer must start zeroed).
    """

    names: list
    shapes: list
    offsets: np.ndarray
    buffer_bytes: int
    intervals: list


def plan_tp_shard(spec, tp: int, tp_rank: int, hf_names: list, hf_shapes: list, src_dtype, dst_dtype: torch.dtype,
                  n_ranks: int = 1, backend: str | None = None) -> TPShardPlan:
    """Plan the SGLang-layout buffer of TP rank ``tp_rank`` (``spec``: layout.ModelSpec) from the HF
    tensors ``hf_names`` (full when ``n_ranks=1``, else FSDP2 dim-0 shards over ``n_ranks``)."""
    index = {n: i for i, n in enumerate(hf_names)}
    rc = [rows_cols(s) for s in hf_shapes]
    ddt = dtype_code(dst_dtype)
    es = dst_dtype.itemsize
    names, shapes, offsets, blocks, cur = [], [], [], [], 0
    for p in spec.sglang_params(tp, tp_rank):
        cur = -(-cur // 16) * 16  # every parameter 16-byte aligned
        names.append(p.name)
        shapes.append(p.shape)
        offsets.append(cur)
        prow, pcol = p.rows_cols
        for pc in p.pieces:
            if pc.hf_name not in index:
                raise ValueError(f"plan_tp_shard: {p.name} needs {pc.hf_name!r}, which is not among the sources")
            blocks.append([index[pc.hf_name], pc.row0, pc.col0, pc.n_rows, pc.n_cols, 0,
                           cur // es + pc.dst_row0 * pcol, pcol, ddt])
        cur += prow * pcol * es
    sdt = [int(x) for x in src_dtype]
    ivs = plan_blocks([r for r, _ in rc], [c for _, c in rc], sdt, n_ranks, blocks, backend=backend)
    return TPShardPlan(names, shapes, np.array(offsets, np.int64), -(-cur // 16) * 16, ivs)
