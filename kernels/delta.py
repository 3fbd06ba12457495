"""Triton kernels of the delta weight codec (see ``areal_fast.weights.delta_codec``).

A tensor is viewed as 16-bit *words* (int16), so bf16 and fp16 are compared as bit patterns:
-0.0 vs 0.0 and NaN payloads are changes like any other, and the round trip is bitwise.

* ``_count_kernel``: changed words per block of ``BLOCK`` words.
* ``_encode_kernel``: each block writes its changes at its offset (the exclusive sum of the
  counts, computed by the launcher with ``torch.cumsum``) in block order, ranked inside the block
  by ``tl.cumsum``: the indices come out ascending with no sort, like the C++ twin.
* ``_apply_kernel``: ``dst[idx[k]] = val[k]`` (indices distinct, so writes never collide).

The launchers take tensors the caller has validated (same device, contiguous, 16-bit words,
fewer than 2**31 words, indices inside ``dst``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 2048 words (4 KiB of bf16) per program: one count per 2048 words is 0.2% extra traffic, and a
# block this size keeps the in-block scan in registers.
BLOCK = 2048


@triton.jit
def _count_kernel(old, new, counts, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(old + offs, mask=m, other=0)
    b = tl.load(new + offs, mask=m, other=0)
    changed = (a != b) & m
    tl.store(counts + pid, tl.sum(changed.to(tl.int32), axis=0))


@triton.jit
def _encode_kernel(old, new, starts, idx_out, val_out, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(old + offs, mask=m, other=0)
    b = tl.load(new + offs, mask=m, other=0)
    c = ((a != b) & m).to(tl.int32)
    pos = tl.load(starts + pid) + tl.cumsum(c, axis=0) - c
    keep = c > 0
    tl.store(idx_out + pos, offs.to(tl.int32), mask=keep)
    tl.store(val_out + pos, b, mask=keep)


@triton.jit
def _apply_kernel(dst, idx, val, M, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < M
    i = tl.load(idx + offs, mask=m, other=0)
    v = tl.load(val + offs, mask=m, other=0)
    tl.store(dst + i.to(tl.int64), v, mask=m)


def count_blocks(old_w: torch.Tensor, new_w: torch.Tensor) -> torch.Tensor:
    """int32 changed-word count of every block (on the device; no host sync)."""
    n = old_w.numel()
    grid = (triton.cdiv(n, BLOCK),)
    counts = torch.empty(grid[0], dtype=torch.int32, device=old_w.device)
    if n:
        _count_kernel[grid](old_w, new_w, counts, n, BLOCK=BLOCK)
    return counts


def encode(old_w: torch.Tensor, new_w: torch.Tensor, counts: torch.Tensor, total: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 positions, int16 words) of the ``total`` changes counted by :func:`count_blocks`."""
    dev = old_w.device
    idx = torch.empty(total, dtype=torch.int32, device=dev)
    val = torch.empty(total, dtype=torch.int16, device=dev)
    if total:
        starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
        _encode_kernel[(counts.numel(),)](old_w, new_w, starts, idx, val, old_w.numel(), BLOCK=BLOCK)
    return idx, val


def apply(dst_w: torch.Tensor, idx: torch.Tensor, val_w: torch.Tensor) -> None:
    m = idx.numel()
    if m:
        _apply_kernel[(triton.cdiv(m, BLOCK),)](dst_w, idx, val_w, m, BLOCK=BLOCK)
