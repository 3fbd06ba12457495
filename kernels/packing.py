"""Triton kernels for varlen sequence packing: segment copies (pack, gather, scatter) and unpack.

Every kernel here moves raw bytes: a per-token tensor ``[T, ...]`` is viewed as ``[T, W]``
*words* (int64, int32, int16 or uint8, the widest that divides a row's bytes and the data
pointers), so one kernel serves every dtype (int64, int32, fp32, bf16, bool, ...) bitwise,
and the 8-byte words let Triton emit 16-byte vector loads when rows are 16-byte aligned.

Two kernels:

* ``_segment_copy_kernel`` walks the tokens of one packed layout (described by ``cu``, int32
  ``[B+1]``) and pairs each token with a row of another layout: token ``t`` of segment ``j``
  (found by binary search in ``cu``) pairs with row ``other_start[j] + (t - cu[j])``. With
  ``SCATTER=False`` it copies other -> walked layout, else walked -> other. This is
  ``pack`` (other = padded rows, ``other_start[b] = b * L``; it also writes position ids),
  ``gather_segments`` (walked = new order, other = old order) and ``scatter_segments``.
  It takes a *tuple* of tensors: grid axis 1 is the tensor index and each tensor has its own
  word type and tile shape (constexpr), so a whole list of per-token tensors that differ in
  dtype and width moves in ONE launch.
* ``_unpack_kernel`` walks the padded rows ``[B * max_len]`` (no search: ``b = r // max_len``)
  and writes every output row exactly once, either the packed row or the pad row, so the
  output needs no separate fill pass.

Tiles: ~``TILE_WORDS`` words per tile when rows are *vector rows* (``W % 16 == 0`` words and
16-byte aligned pointers, Triton's specialisations: 16-byte loads, a few rows per thread), and
~``SCALAR_TILE_WORDS`` otherwise. A scalar tile of 4096 words gives each of 128 threads 32 rows
with their own 64-bit addresses: 200-255 registers on sm_90a, and a launch mixing such widths
with 1-word columns (int64 [T, 3, 5], fp32 [T, 5], bf16 [T, 3], int64, int32) 255 registers and
16 bytes spilled inside the copy loop under Triton 3.9; at 1024 words the single columns take
56-80 registers and that launch 80-114 (docs/static_sm90.md).

Grids never grow past ``MAX_PROGRAMS`` along axis 0: programs stride over token blocks, so
any T works (CUDA's axis-0 limit is 2**31 - 1 blocks, but the cap also keeps the launch small).

The launchers take tensors that the caller (``areal_fast.packing.segments``) has already
validated; they only check what they need to be memory-safe (shapes, contiguity, devices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# 65535 programs: the CUDA limit of grid axes 1-2 and far more than needed to fill 132 SMs
# of an H100 (~500 programs per SM); past that, programs loop over token blocks.
MAX_PROGRAMS = 65535
# Target words per tile (one loop iteration of one program): 4096 int64 words = 32 KiB in
# flight per program, enough to saturate HBM with a few programs per SM. Rows that cannot be
# moved by 16-byte accesses (see ``vector_rows``) get SCALAR_TILE_WORDS: 8 words per thread at
# 4 warps, because every row a thread touches costs it two 64-bit addresses.
TILE_WORDS = 4096
SCALAR_TILE_WORDS = 1024
MAX_BLOCK_W = 256  # words per row chunk (2 KiB of int64); wider rows loop over chunks
MIN_BLOCK_T, MAX_BLOCK_T = 16, 1024
# Triton compiles one binary per specialisation of a launch: every constexpr, each pointer's word
# type and 16-byte alignment, and for each plain int argument whether it equals 1 (folded into the
# code) or is divisible by 16. Kept, because they change the code: the word type, a tensor's width in
# words (1: a column moves as one contiguous run over tokens; a multiple of 16: 16-byte row accesses,
# see ``vector_rows``), the tile (BLOCK_*), SCATTER (which side is contiguous over tokens), WRITE_POS
# and HAS_PAD (no pad load when the pad is zero bytes). Not specialised: the counts below, which only
# bound loops, feed masks and a binary search, or divide an index by a runtime value (M); a T that
# happens to be 16-divisible, one sequence (B == 1, N_ITERS == 1) or one block gained nothing and cost
# one more cold compile each time a new combination came by (the packing GPU test compiled 84 variants
# cold, 51 without them). The segment copy's block count per tensor is derived in the kernel from T and
# its BLOCK_T, not passed: Triton 3.9 specialises the elements of a tuple argument whatever
# do_not_specialize says, so a tensor that fits one block would be one more variant.
SEGMENT_COPY_RUNTIME = ("T", "B", "N_ITERS")
UNPACK_RUNTIME = ("n_rows", "M", "n_blocks")

_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _segment_of(cu, t, B, N_ITERS):
    """Largest j in [0, B) with cu[j] <= t, for each token t (< cu[B]), by binary search.

    Zero-length segments are skipped naturally (cu[j] == cu[j+1] <= t means j+1 also qualifies).
    ``N_ITERS = B.bit_length()`` halvings reduce the B+1 candidates to one.
    """
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + B
    for _ in range(N_ITERS):
        mid = (lo + hi + 1) // 2  # in [1, B] while lo < hi, == lo once converged: always in bounds
        up = tl.load(cu + mid).to(tl.int64) <= t
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    return lo


@triton.jit
def _segment_copy_one(
    src, dst, W, cu, other_start, pos, T, B, N_ITERS,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, SCATTER: tl.constexpr, WRITE_POS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = (T - 1) // BLOCK_T + 1  # T >= 1 (the launcher returns early on T == 0); no overflow near 2**31
    for blk in range(pid, n_blocks, nprog):
        # int64 before the multiply: blk * BLOCK_T overflows int32 past 2**31 tokens
        t = (tl.zeros([BLOCK_T], tl.int64) + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        tc = tl.minimum(t, T - 1)  # keep the search and the loads in bounds for the tail block
        seg = _segment_of(cu, tc, B, N_ITERS)
        offset = tc - tl.load(cu + seg).to(tl.int64)
        other = tl.load(other_start + seg) + offset
        if WRITE_POS:
            tl.store(pos + t, offset, mask=tmask)
        if SCATTER:
            src_row = t
            dst_row = other
        else:
            src_row = other
            dst_row = t
        src_base = src + src_row[:, None] * W
        dst_base = dst + dst_row[:, None] * W
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            m = tmask[:, None] & (cols < W)[None, :]
            vals = tl.load(src_base + cols[None, :], mask=m)
            tl.store(dst_base + cols[None, :], vals, mask=m)


@triton.jit(do_not_specialize=SEGMENT_COPY_RUNTIME)
def _segment_copy_kernel(
    srcs, dsts, widths, cu, other_start, pos, T, B, N_ITERS,
    N_TENSORS: tl.constexpr, BLOCK_TS: tl.constexpr, BLOCK_WS: tl.constexpr,
    SCATTER: tl.constexpr, WRITE_POS: tl.constexpr,
):
    """Grid (programs over token blocks, tensors). Tensor i is [rows, widths[i]] words."""
    k = tl.program_id(1)
    for i in tl.static_range(N_TENSORS):
        if k == i:
            _segment_copy_one(
                srcs[i], dsts[i], widths[i], cu, other_start, pos, T, B, N_ITERS,
                BLOCK_TS[i], BLOCK_WS[i], SCATTER, WRITE_POS and i == 0,
            )


@triton.jit(do_not_specialize=UNPACK_RUNTIME)
def _unpack_kernel(
    src, dst, pad_row, cu, n_rows, M, W, n_blocks,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HAS_PAD: tl.constexpr,
):
    """dst[b * M + s] = src[cu[b] + s] if s < cu[b+1] - cu[b] else pad_row (zero bytes if not HAS_PAD)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for blk in range(pid, n_blocks, nprog):
        r = (tl.zeros([BLOCK_T], tl.int64) + blk) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = r < n_rows
        b = r // M
        s = r - b * M
        start = tl.load(cu + b, mask=rmask, other=0).to(tl.int64)
        end = tl.load(cu + b + 1, mask=rmask, other=0).to(tl.int64)
        valid = rmask & (s < end - start)
        src_base = src + (start + s)[:, None] * W
        dst_base = dst + r[:, None] * W
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            cmask = cols < W
            vals = tl.load(src_base + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0)
            if HAS_PAD:
                pad = tl.load(pad_row + cols, mask=cmask, other=0)
                vals = tl.where(valid[:, None], vals, pad[None, :])
            tl.store(dst_base + cols[None, :], vals, mask=rmask[:, None] & cmask[None, :])


# ----------------------------------------------------------------------------- launchers


def _on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device), not on cuda:0."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (everything after dim 0)."""
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n * t.element_size()


def word_dtype(nbytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """Widest word type dividing ``nbytes`` and every tensor's data pointer."""
    for size, dtype in _WORD_DTYPES:
        if nbytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    raise AssertionError("unreachable: 1-byte words always fit")


def as_words(t: torch.Tensor, dtype: torch.dtype, words: int) -> torch.Tensor:
    """Contiguous ``t`` as a ``[rows, words]`` tensor of ``dtype`` words over the same memory."""
    flat = t.reshape(-1).view(torch.uint8).view(dtype)  # 1-D, so only the total size must divide
    return flat.view(-1, words)


def words_of(nbytes: int, dtype: torch.dtype) -> int:
    return nbytes // torch.empty((), dtype=dtype).element_size()


def vector_rows(words: int, *tensors: torch.Tensor) -> bool:
    """Whether rows of ``words`` words of ``tensors`` move by 16-byte accesses: Triton knows a row
    offset is 16-word aligned only when ``words % 16 == 0``, and a pointer only when it is
    16-byte aligned."""
    return words % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def tile_shape(words: int, vector: bool | None = None) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_W) for rows of ``words`` words: ~TILE_WORDS words per tile for vector rows,
    ~SCALAR_TILE_WORDS otherwise (``vector=None``: ``words % 16 == 0``, aligned pointers assumed)."""
    if vector is None:
        vector = words % 16 == 0
    block_w = min(triton.next_power_of_2(max(words, 1)), MAX_BLOCK_W)
    tile = TILE_WORDS if vector else SCALAR_TILE_WORDS
    block_t = max(MIN_BLOCK_T, min(MAX_BLOCK_T, tile // block_w))
    return block_t, block_w


def segment_copy(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    cu: torch.Tensor,
    other_start: torch.Tensor,
    *,
    scatter: bool,
    pos: torch.Tensor | None = None,
    max_programs: int = MAX_PROGRAMS,
) -> None:
    """Copy rows segment by segment, for all tensors in one launch.

    ``cu`` (int32 [B+1]) describes the walked layout of ``T = cu[-1]`` tokens and
    ``other_start`` (int64 [B]) the first row of each segment in the other layout. Without
    ``scatter``: ``dsts[i][t] = srcs[i][other(t)]`` (dsts have T rows); with ``scatter``:
    ``dsts[i][other(t)] = srcs[i][t]`` (srcs have T rows). ``pos`` (int64 [T]), if given,
    receives each token's offset in its segment. All tensors contiguous, src/dst pairs of equal
    row bytes; ``T`` is taken from the walked side's rows so no device sync is needed.
    """
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(f"need matching non-empty src/dst lists, got {len(srcs)} and {len(dsts)}")
    walked = srcs[0] if scatter else dsts[0]
    T = walked.shape[0]
    B = cu.numel() - 1
    if T == 0 or B == 0:
        return
    assert cu.dtype == torch.int32 and other_start.dtype == torch.int64
    assert cu.is_contiguous() and other_start.is_contiguous() and other_start.numel() == B
    wsrcs, wdsts, widths, n_blocks, block_ts, block_ws = [], [], [], [], [], []
    for s, d in zip(srcs, dsts):
        assert s.is_contiguous() and d.is_contiguous() and s.device == d.device == cu.device
        nbytes = row_bytes(s)
        assert nbytes == row_bytes(d) and s.dtype == d.dtype
        if nbytes == 0:
            continue  # [T, 0] tensors: nothing to move
        wd = word_dtype(nbytes, s, d)
        W = words_of(nbytes, wd)
        ws, wdst = as_words(s, wd, W), as_words(d, wd, W)
        assert (ws if scatter else wdst).shape[0] == T
        bt, bw = tile_shape(W, vector_rows(W, ws, wdst))
        wsrcs.append(ws)
        wdsts.append(wdst)
        widths.append(ws.shape[1])
        n_blocks.append(triton.cdiv(T, bt))
        block_ts.append(bt)
        block_ws.append(bw)
    if not wsrcs:
        if pos is None:
            return
        # Only position ids wanted (zero-width data): copy a dummy 1-byte-per-token column.
        dummy = torch.empty(T, 1, dtype=torch.uint8, device=cu.device)
        wsrcs, wdsts, widths = [dummy], [dummy], [1]
        bt, bw = tile_shape(1)
        n_blocks, block_ts, block_ws = [triton.cdiv(T, bt)], [bt], [bw]
    grid = (min(max(n_blocks), max_programs), len(wsrcs))
    with _on_device(cu):
        _segment_copy_kernel[grid](
            tuple(wsrcs), tuple(wdsts), tuple(widths), cu, other_start,
            pos if pos is not None else other_start, T, B, B.bit_length(),
            N_TENSORS=len(wsrcs), BLOCK_TS=tuple(block_ts), BLOCK_WS=tuple(block_ws),
            SCATTER=bool(scatter), WRITE_POS=pos is not None,
        )


def unpack_rows(
    packed: torch.Tensor,
    out: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    pad_row: torch.Tensor | None = None,
    *,
    max_programs: int = MAX_PROGRAMS,
) -> None:
    """Fill ``out`` ([B, max_len, ...], contiguous) from ``packed`` ([T, ...], contiguous).

    Rows past a sequence's length get ``pad_row`` (a tensor of one row's bytes, same dtype as
    ``out``) or zero bytes when it is None. Sequences longer than ``max_len`` are truncated.
    """
    B = cu.numel() - 1
    n_rows = B * max_len
    nbytes = row_bytes(out) // max(max_len, 1) if out.dim() >= 2 else 0
    if n_rows == 0 or nbytes == 0:
        return
    assert cu.dtype == torch.int32 and cu.is_contiguous() and out.is_contiguous() and packed.is_contiguous()
    assert row_bytes(packed) == nbytes and packed.dtype == out.dtype
    ptrs = (packed, out) + ((pad_row,) if pad_row is not None else ())
    wd = word_dtype(nbytes, *ptrs)
    W = words_of(nbytes, wd)
    wsrc, wdst = as_words(packed, wd, W), as_words(out, wd, W)
    wpad = as_words(pad_row, wd, W) if pad_row is not None else wdst
    bt, bw = tile_shape(W, vector_rows(W, wsrc, wdst, wpad))
    n_blocks = triton.cdiv(n_rows, bt)
    with _on_device(cu):
        _unpack_kernel[(min(n_blocks, max_programs),)](
            wsrc, wdst, wpad, cu, n_rows, max_len, W, n_blocks,
            BLOCK_T=bt, BLOCK_W=bw, HAS_PAD=pad_row is not None,
        )
