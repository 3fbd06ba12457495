"""The CUDA interval copy against the reference on the same device, at every alignment.

Every test runs twice: on CUDA (marked ``gpu``) and on the CPU with the C++ CPU routine (the
``native`` backend), so the tests' own logic - offsets, expected slices, plan bookkeeping - runs in
CI every day and a slip in it shows there, not on the rare GPU machine.

The kernel picks a vector width per chunk from the source and destination addresses and copies
only a misaligned head and tail element by element; these tests walk the element offsets of both
sides through a whole vector period, for every cast, with runs shorter than a vector, spanning
several chunks, and strided rows. They also exercise the plan kept on the device between calls:
the same plan again (no upload), a different plan, and another stream.
"""

import numpy as np
import pytest
import torch

from areal_fast.weights.interval_copy import interval_copy, interval_copy_ref
from areal_fast.weights.plan import dtype_code

# the device and the backend interval_copy must pick on it
DEVICES = [pytest.param(("cpu", "native"), id="cpu"), pytest.param(("cuda", "cuda"), id="cuda", marks=pytest.mark.gpu)]

CHUNK = 16384  # kChunkElems in interval_copy.cu: runs longer than this span several blocks
PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
         (torch.float16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
         (torch.uint8, torch.uint8)]


def _source(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    x = torch.randn(n, generator=g) * 1e3
    x[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])  # NaN, inf, signed zero, denormal
    return x.to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise, except that any NaN matches any NaN (NaN payloads are no contract of the copy)."""
    if got.dtype.is_floating_point:
        nan = torch.isnan(got)
        if not torch.equal(nan, torch.isnan(want)):
            return False
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _run_both(src, dst_shape, dst_dtype, iv, backend):
    out = torch.zeros(dst_shape, dtype=dst_dtype, device=src.device)
    ref = out.clone()
    assert interval_copy([src], [out], iv) == backend
    interval_copy_ref([src], [ref], iv)
    _sync(src.device.type)
    return out, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sdt,ddt", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_every_alignment_and_length(sdt, ddt, device):
    dev, backend = device
    sc, dc = dtype_code(sdt), dtype_code(ddt)
    src = _source(3 * CHUNK + 64, sdt).to(dev)
    for length in (1, 3, 9, 37, CHUNK + 5, 2 * CHUNK + 17):
        # 8 elements: a whole vector period of every dtype pair (16 bytes / 2). The CPU twin walks
        # the long runs at three offsets only (torch's CPU casts of 64 x 48k elements take a minute).
        offsets = range(8) if dev == "cuda" or length < 64 else (0, 3, 7)
        for so in offsets:
            for do in offsets:
                iv = np.array([[0, so, 0, 0, do, 0, length, 1, sc, dc]], np.int64)
                out, ref = _run_both(src, length + 8, ddt, iv, backend)
                assert _same(out, ref), f"{sdt}->{ddt} length {length} src offset {so} dst offset {do}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sdt,ddt", PAIRS[:4], ids=lambda d: str(d).replace("torch.", ""))
def test_strided_rows(sdt, ddt, device):
    dev, backend = device
    src = _source(64 * 301, sdt).to(dev)
    # 50 rows of 257 elements, source rows 301 apart from offset 3, destination rows 263 apart from 1
    iv = np.array([[0, 3, 301, 0, 1, 263, 257, 50, dtype_code(sdt), dtype_code(ddt)]], np.int64)
    out, ref = _run_both(src, 263 * 51, ddt, iv, backend)
    assert _same(out, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_kept_on_device_follows_data_plans_and_streams(device):
    dev, backend = device
    n = 5 * CHUNK + 3
    src = _source(n, torch.float32).to(dev)
    out = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    iv = np.array([[0, 0, 0, 0, 0, 0, n, 1, 1, 2]], np.int64)
    assert interval_copy([src], [out], iv) == backend
    _sync(dev)
    assert _same(out, src.to(torch.bfloat16))
    src.mul_(-3)  # same plan, same pointers: the device table is reused, the new data is copied
    interval_copy([src], [out], iv)
    _sync(dev)
    assert _same(out, src.to(torch.bfloat16))
    # a different plan (another destination and more intervals) must replace the cached one
    out2 = torch.zeros(2 * n, dtype=torch.float16, device=dev)
    iv2 = np.array([[0, 0, 0, 0, n, 0, n, 1, 1, 3], [0, 1, 0, 0, 0, 0, n - 1, 1, 1, 3]], np.int64)
    interval_copy([src], [out2], iv2)
    _sync(dev)
    assert _same(out2[n:], src.to(torch.float16)) and _same(out2[: n - 1], src[1:].to(torch.float16))
    if dev != "cuda":
        return
    # another stream, back to the first plan: ordered after the previous launches
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        src2 = src * 2
        interval_copy([src2], [out], iv)
    side.synchronize()
    assert _same(out, src2.to(torch.bfloat16))
