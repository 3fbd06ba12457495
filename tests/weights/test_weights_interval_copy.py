"""Interval copy: the C++ CPU routine is bitwise equal to torch (``Tensor.to`` / ``copy_``),
including fp32 -> bf16/fp16 rounding of ties, overflow, denormals and infinities, odd element
offsets, strided runs, gathers from many sources and scatters into many destinations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_fast.weights.interval_copy import check_bounds, interval_copy, interval_copy_ref
from areal_fast.weights.plan import DTYPE_CODES, INTERVAL_COLS


def _special_f32(n: int, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    bits = g.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)  # random bit patterns: all classes
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                        0x00000001, 0x807FFFFF, 0x00400000, 0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x7F7FFFFF,
                        0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x387FC000], np.uint32)
    bits[: len(special)] = special  # NaNs, infs, denormals, ties to even, fp16 overflow/underflow edges
    return torch.from_numpy(bits.view(np.float32).copy())


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    """Bitwise, except that any NaN matches any NaN: torch's own NaN bits differ between its
    vectorised (0xFFFF) and scalar (0x7FC0) bf16 paths, so NaN payloads are not a contract."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    ib = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got[~nan].view(ib), want[~nan].view(ib))


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 4099])
def test_fp32_cast_bitwise(dst, n):
    x = _special_f32(max(n, 32))[:n]
    y = torch.empty(n, dtype=dst)
    iv = [[0, 0, n, 0, 0, n, n, 1, DTYPE_CODES[torch.float32], DTYPE_CODES[dst]]]
    assert interval_copy([x], [y], iv) == "native"
    _assert_same_bits(y, x.to(dst))


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_widening_is_exact(src):
    x = torch.from_numpy(np.arange(2**16, dtype=np.uint16).view(np.int16)).view(src)  # every 16-bit pattern
    y = torch.empty(x.numel(), dtype=torch.float32)
    interval_copy([x], [y], [[0, 0, 0, 0, 0, 0, x.numel(), 1, DTYPE_CODES[src], 1]])
    _assert_same_bits(y, x.float())


def test_odd_offsets_strides_many_sources_and_scatter():
    g = torch.Generator().manual_seed(1)
    srcs = [_special_f32(37 * 5, 1).view(37, 5), torch.randn(11, generator=g).to(torch.bfloat16),
            torch.arange(13, dtype=torch.int64), _special_f32(3 * 9, 2)]
    # one flat byte buffer with mixed dtypes at odd element offsets, written by strided runs
    iv = np.array([
        [0, 3, 5, 0, 1, 3, 2, 7, 1, 2],     # 7 rows x 2 cols of src0 at col 3 -> bf16 elems 1.. (ld 3)
        [1, 1, 1, 0, 23, 1, 9, 1, 2, 2],    # 9 bf16 at bf16 elem 23 (byte 46)
        [2, 5, 1, 0, 9, 1, 3, 1, 6, 6],     # 3 int64 at int64 elem 9 (byte 72)
        [3, 1, 9, 0, 33, 4, 3, 3, 1, 1],    # fp32 strided rows -> fp32 elems 33.. ld 4
        [3, 4, 9, 0, 50, 5, 5, 2, 1, 3],    # fp32 -> fp16 at fp16 elem 50 (byte 100)
    ], np.int64)
    a = torch.zeros(200, dtype=torch.uint8)
    b = a.clone()
    interval_copy(srcs, [a], iv)
    interval_copy_ref(srcs, [b], iv)
    assert torch.equal(a, b)
    # ... and back: scatter from the flat buffer into several typed tensors
    back = np.array([[0, 23, 1, 1, 2, 1, 9, 1, 2, 2], [0, 1, 3, 0, 0, 4, 2, 7, 2, 1]], np.int64)
    outs_a = [torch.zeros(7, 4), torch.zeros(11, dtype=torch.bfloat16)]
    outs_b = [t.clone() for t in outs_a]
    interval_copy([a], outs_a, back)
    interval_copy_ref([b], outs_b, back)
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(outs_a[1][2:].view(torch.int16), srcs[1][1:10].view(torch.int16))


def test_threaded_large_copy():
    x = torch.randn(3 << 20)  # 12 MiB: split into 1 MiB chunks over 2 threads
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    iv = [[0, 0, 1 << 20, 0, 0, 1 << 20, 1 << 20, 3, 1, 2]]
    interval_copy([x], [y], iv, n_threads=2)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_bounds_and_inputs_are_checked():
    x, y = torch.zeros(10), torch.zeros(10)
    with pytest.raises(ValueError, match="interval 0 reaches byte 44 of destination tensor 0"):
        interval_copy([x], [y], [[0, 0, 0, 0, 5, 0, 6, 1, 1, 1]])
    with pytest.raises(ValueError, match="names source 1"):
        interval_copy([x], [y], [[1, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="unsupported dtypes"):
        interval_copy([x], [y], [[0, 0, 0, 0, 0, 0, 1, 1, 1, 6]], check=False)
    with pytest.raises(ValueError, match=f"shape \\[n, {INTERVAL_COLS}\\]"):
        interval_copy([x], [y], np.zeros((1, 4), np.int64), backend="reference")


# Two intervals into one 65,536-byte buffer: 100 strided rows of 5 fp32 -> bf16 at bf16 element 1
# (ld 9, bytes 2..1,792), then 999 fp32 at fp32 element 5,001 (bytes 20,004..24,000). Shared by the
# CPU bounds check and the GPU test, so the GPU test can never write outside its buffer again.
MIXED_BUF_BYTES = 1 << 16
MIXED_PLAN = [[0, 3, 7, 0, 1, 9, 5, 100, 1, 2], [0, 1, 0, 0, 5001, 0, 999, 1, 1, 1]]


def test_mixed_plan_is_in_bounds_and_matches_reference():
    x = _special_f32(100_003)
    buf = torch.zeros(MIXED_BUF_BYTES, dtype=torch.uint8)
    check_bounds([x], [buf], np.asarray(MIXED_PLAN, np.int64))  # raises if any byte lies outside
    ref = buf.clone()
    interval_copy([x], [buf], MIXED_PLAN)
    interval_copy_ref([x], [ref], MIXED_PLAN)
    assert torch.equal(buf, ref)
    assert ref[20_004:24_000].any() and not ref[24_000:].any()
    with pytest.raises(ValueError, match="destination tensor 0"):  # the old plan (bytes 80,004..84,000)
        check_bounds([x], [buf], np.asarray([[0, 1, 0, 0, 20001, 0, 999, 1, 1, 1]], np.int64))


# the device and the backend interval_copy must pick there: the GPU test's logic runs on the CPU
# (the C++ routine) in CI too, so a slip in it (once: n slots compared with n - 2) shows every day
DEVICES = [pytest.param(("cpu", "native"), id="cpu"), pytest.param(("cuda", "cuda"), id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_matches_reference(device):
    dev, backend = device
    n = 100_003
    x = _special_f32(n).to(dev)
    y = torch.zeros(n + 5, dtype=torch.bfloat16, device=dev)
    iv = [[0, 2, 0, 0, 5, 0, n - 2, 1, 1, 2]]  # x[2:] (n - 2 elements) -> y[5 : n + 3]
    assert interval_copy([x], [y], iv) == backend
    _assert_same_bits(y[5 : n + 3].cpu(), x[2:].to(torch.bfloat16).cpu())
    assert not y[:5].any() and not y[n + 3 :].any()
    buf = torch.zeros(MIXED_BUF_BYTES, dtype=torch.uint8, device=dev)
    ref = buf.clone()
    check_bounds([x], [buf], np.asarray(MIXED_PLAN, np.int64))
    assert interval_copy([x], [buf], MIXED_PLAN) == backend
    interval_copy_ref([x], [ref], MIXED_PLAN)
    assert torch.equal(buf.cpu(), ref.cpu())
