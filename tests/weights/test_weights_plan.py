"""Reshard planner: C++ == Python reference, and coverage (every byte of every destination
written exactly once, every source element read once, offsets aligned to the dtype size)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fast.weights.plan import (
    CODE_DTYPES,
    DST_DTYPE,
    DST_IDX,
    DST_LD,
    DST_OFF,
    INTERVAL_COLS,
    LEN,
    ROWS,
    SRC_DTYPE,
    SRC_IDX,
    SRC_LD,
    SRC_OFF,
    assign_buckets,
    consecutive_buckets,
    plan_blocks,
    plan_fsdp_buckets,
    shard_rows,
)

# (src, dst) dtype codes the sync uses: fp32 master -> bf16, bf16 as is, int64 buffers as is
PAIRS = [(1, 2), (2, 2), (1, 1), (6, 6), (1, 3), (0, 0)]
SETTINGS = dict(max_examples=60, deadline=None)


def _runs(iv: np.ndarray, side: str):
    """Yield (buffer index, first byte, n bytes) of every run on one side."""
    idx, off, ld, dt = (SRC_IDX, SRC_OFF, SRC_LD, SRC_DTYPE) if side == "src" else (DST_IDX, DST_OFF, DST_LD, DST_DTYPE)
    for row in iv.tolist():
        es = CODE_DTYPES[row[dt]].itemsize
        for k in range(row[ROWS]):
            yield row[idx], (row[off] + k * row[ld]) * es, row[LEN] * es


def _count(n_bytes: int, runs) -> np.ndarray:
    c = np.zeros(n_bytes, np.int64)
    for _, a, n in runs:
        assert a >= 0 and a + n <= n_bytes
        c[a : a + n] += 1
    return c


tensors = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.sampled_from(PAIRS)), min_size=1, max_size=12)


@settings(**SETTINGS)
@given(tensors, st.integers(1, 5), st.integers(1, 2000))
def test_fsdp_bucket_plan(ts, n_ranks, bucket_bytes):
    rows = [t[0] for t in ts]
    cols = [t[1] for t in ts]
    sdt = [t[2][0] for t in ts]
    ddt = [t[2][1] for t in ts]
    p = plan_fsdp_buckets(rows, cols, sdt, ddt, n_ranks, bucket_bytes)
    ref = plan_fsdp_buckets(rows, cols, sdt, ddt, n_ranks, bucket_bytes, backend="reference")
    for f in ("bucket", "offset", "bucket_bytes", "seg_bytes"):
        np.testing.assert_array_equal(getattr(p, f), getattr(ref, f), err_msg=f)
    for a, b in zip(p.pack + p.pack_bounds + p.unpack, ref.pack + ref.pack_bounds + ref.unpack):
        np.testing.assert_array_equal(a, b)
    es = [CODE_DTYPES[d].itemsize for d in ddt]
    nbytes = [r * c * e for r, c, e in zip(rows, cols, es)]
    assert list(p.bucket) == sorted(p.bucket)  # names order preserved
    for b in range(p.n_buckets):
        ts_b = p.tensors_of(b).tolist()
        assert p.bucket_bytes[b] <= bucket_bytes or len(ts_b) == 1
        assert p.seg_bytes[b] % 16 == 0
        # unpack: every tensor byte of the bucket written exactly once, alignment gaps never
        cover = _count(int(p.bucket_bytes[b]), _runs(p.unpack[b], "dst"))
        want = np.zeros_like(cover)
        for t in ts_b:
            assert p.offset[t] % es[t] == 0
            want[p.offset[t] : p.offset[t] + nbytes[t]] = 1
        np.testing.assert_array_equal(cover, want)
        # the unpack reads each rank's packed bytes exactly once, and those are what the pack wrote
        read = _count(n_ranks * int(p.seg_bytes[b]), _runs(p.unpack[b], "src"))
        written = np.zeros_like(read)
        for r in range(n_ranks):
            w = _count(int(p.seg_bytes[b]), _runs(p.pack_intervals(r, b), "dst"))
            written[r * p.seg_bytes[b] : (r + 1) * p.seg_bytes[b]] = w
            # each local shard is read whole, once
            for t in ts_b:
                lo, hi = shard_rows(rows[t], n_ranks, r)
                runs = [x for x in _runs(p.pack_intervals(r, b), "src") if x[0] == t]
                sz = CODE_DTYPES[sdt[t]].itemsize
                np.testing.assert_array_equal(_count((hi - lo) * cols[t] * sz, runs), 1)
        np.testing.assert_array_equal(read, written)
        assert written.max(initial=0) <= 1


blocks_st = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30),
                               st.integers(0, 30)), min_size=1, max_size=10)


@settings(**SETTINGS)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=4, max_size=4), blocks_st,
       st.integers(1, 4), st.booleans())
def test_block_plan(srcs, raw_blocks, n_ranks, cast):
    rows = [s[0] for s in srcs]
    cols = [s[1] for s in srcs]
    sdt = [1] * 4
    ddt = 2 if cast else 1
    blocks, dst_end = [], [0, 0]
    for i, (t, a, b, c, d) in enumerate(raw_blocks):
        r0, nr = sorted((a % (rows[t] + 1), b % (rows[t] + 1)))
        c0, nc = sorted((c % (cols[t] + 1), d % (cols[t] + 1)))
        nr, nc = nr - r0, nc - c0
        ld = nc + (i % 3 == 0)  # some destinations wider than the block (column slices)
        di = i % 2
        blocks.append([t, r0, c0, nr, nc, di, dst_end[di], ld, ddt])
        dst_end[di] += nr * ld
    ivs = plan_blocks(rows, cols, sdt, n_ranks, blocks)
    ref = plan_blocks(rows, cols, sdt, n_ranks, blocks, backend="reference")
    assert len(ivs) == n_ranks
    for a, b in zip(ivs, ref):
        np.testing.assert_array_equal(a, b)
    es = CODE_DTYPES[ddt].itemsize
    for di in range(2):
        cover = np.zeros(dst_end[di] * es, np.int64)
        for iv in ivs:
            c = _count(len(cover), [x for x in _runs(iv, "dst") if x[0] == di])
            cover += c
        want = np.zeros_like(cover)
        for _t, _r0, _c0, nr, nc, bdi, off, ld, _ in blocks:
            if bdi == di:
                for k in range(nr):
                    want[(off + k * ld) * es : (off + k * ld + nc) * es] = 1
        np.testing.assert_array_equal(cover, want)


def test_assign_buckets_alignment_and_big_tensors():
    nbytes = [3, 8, 100, 2, 2, 7]
    align = [1, 4, 2, 2, 8, 1]
    b, off, sizes = assign_buckets(nbytes, align, 16)
    rb, roff, rsizes = assign_buckets(nbytes, align, 16, backend="reference")
    np.testing.assert_array_equal(b, rb)
    np.testing.assert_array_equal(off, roff)
    np.testing.assert_array_equal(sizes, rsizes)
    assert off.tolist() == [0, 4, 0, 0, 8, 0]  # 8 B aligned at 4; 100 B alone; 2 B @0, 2 B @8 (align 8)
    assert b.tolist() == [0, 0, 1, 2, 2, 3] and sizes.tolist() == [12, 100, 10, 7]


def test_consecutive_buckets_group_in_order_a_larger_item_alone():
    """The unaligned grouping the senders and the colocated path bucket by (zero-byte items join the open group)."""
    assert consecutive_buckets([3, 8, 100, 2, 0, 14, 16], 16) == [[0, 1], [2], [3, 4, 5], [6]]
    assert consecutive_buckets([], 16) == []


def test_interval_layout_constant():
    from areal_fast.dispatch import native

    assert native().RESHARD_INTERVAL_COLS == INTERVAL_COLS


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_bad_inputs_are_named(impl):
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_fsdp_buckets([2], [2], [1], [2], 1, 0, backend=impl)
    with pytest.raises(ValueError, match="tensor 0: cast"):
        plan_fsdp_buckets([2], [2], [6], [2], 1, 64, backend=impl)
    with pytest.raises(ValueError, match="block 0"):
        plan_blocks([2], [2], [1], 1, [[0, 1, 0, 2, 2, 0, 0, 2, 1]], backend=impl)
