"""Execute reshard plans: copy many intervals between many tensors in one call, casting dtype.

Backends: ``cuda`` (``csrc/reshard/interval_copy.cu``, one kernel launch on the current
stream), ``native`` (the C++ CPU routine in ``csrc/reshard/interval_copy_cpu.cpp``) and
``reference`` (:func:`interval_copy_ref`, torch slicing + ``copy_``, which defines the result
bit for bit: fp32 -> bf16/fp16 round to nearest even like ``Tensor.to``).
:func:`areal_fast.dispatch.select` (op ``weights.interval_copy``) chooses: cuda for CUDA tensors
when the core has CUDA, native for CPU tensors, else the reference; ``backend=`` or
``AREAL_FAST_BACKEND`` force one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from areal_fast import dispatch as _backend
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
)

_ITEMSIZE = np.array([CODE_DTYPES[c].itemsize for c in range(len(CODE_DTYPES))], np.int64)


def _extent_bytes(iv: np.ndarray, off: int, ld: int, dt: int) -> np.ndarray:
    """One past the last byte each interval touches on one side."""
    last = iv[:, off] + np.maximum(iv[:, ROWS] - 1, 0) * iv[:, ld] + iv[:, LEN]
    return np.where(iv[:, LEN] * iv[:, ROWS] > 0, last * _ITEMSIZE[iv[:, dt]], 0)


def check_bounds(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], iv: np.ndarray) -> None:
    """Raise ValueError if an interval reads or writes outside its tensor (a segfault otherwise)."""
    if iv.ndim != 2 or iv.shape[1] != INTERVAL_COLS:
        raise ValueError(f"intervals must have shape [n, {INTERVAL_COLS}], got {iv.shape}")
    if len(iv) == 0:
        return
    for side, ts, idx, off, ld, dt in (("source", srcs, SRC_IDX, SRC_OFF, SRC_LD, SRC_DTYPE),
                                       ("destination", dsts, DST_IDX, DST_OFF, DST_LD, DST_DTYPE)):
        if iv[:, idx].min() < 0 or iv[:, idx].max() >= len(ts):
            raise ValueError(f"an interval names {side} {int(iv[:, idx].max())} but only {len(ts)} were given")
        if iv[:, dt].min() < 0 or iv[:, dt].max() >= len(_ITEMSIZE):
            raise ValueError(f"an interval has an unknown {side} dtype code")
        for i, t in enumerate(ts):
            if not t.is_contiguous():
                raise ValueError(f"{side} tensor {i} is not contiguous")
        cap = np.array([t.numel() * t.element_size() for t in ts], np.int64)
        ext = _extent_bytes(iv, off, ld, dt)
        bad = np.nonzero(ext > cap[iv[:, idx]])[0]
        if len(bad):
            k = int(bad[0])
            raise ValueError(f"interval {k} reaches byte {int(ext[k])} of {side} tensor {int(iv[k, idx])}, "
                             f"which has {int(cap[iv[k, idx]])} bytes")
        if iv[:, off].min() < 0:
            raise ValueError(f"an interval has a negative {side} offset")


def _typed_runs(t: torch.Tensor, code: int, off: int, ld: int, length: int, rows: int) -> torch.Tensor:
    dt = CODE_DTYPES[code]
    es = dt.itemsize
    b = t.reshape(-1).view(torch.uint8)
    seg = b[off * es : (off + (rows - 1) * ld + length) * es].view(dt)
    return seg.as_strided((rows, length), (ld, 1), seg.storage_offset())


def _as_intervals(intervals) -> np.ndarray:
    iv = np.ascontiguousarray(np.asarray(intervals, dtype=np.int64))
    if iv.size == 0:
        return iv.reshape(0, INTERVAL_COLS)
    if iv.ndim != 2 or iv.shape[1] != INTERVAL_COLS:
        raise ValueError(f"intervals must have shape [n, {INTERVAL_COLS}], got {iv.shape}")
    return iv


def interval_copy_ref(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], intervals: np.ndarray) -> None:
    """Reference: each interval as a strided view copied with ``Tensor.copy_`` (torch casting)."""
    iv = _as_intervals(intervals)
    check_bounds(srcs, dsts, iv)
    for row in iv.tolist():
        si, so, sl, di, do, dl, n, rows, sdt, ddt = row
        if n * rows == 0:
            continue
        d = _typed_runs(dsts[di], ddt, do, dl, n, rows)
        d.copy_(_typed_runs(srcs[si], sdt, so, sl, n, rows))


def _ptrs(ts: Sequence[torch.Tensor]) -> np.ndarray:
    return np.array([t.data_ptr() for t in ts], dtype=np.int64)


def interval_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], intervals: np.ndarray,
                  backend: str | None = None, n_threads: int = 0, check: bool = True) -> str:
    """Copy ``intervals`` (see :mod:`areal_fast.weights.plan`) from ``srcs`` into ``dsts``.

    All tensors must be contiguous and on one device. Returns the backend that ran. On CUDA
    the copy is asynchronous on the current stream (like ``Tensor.copy_``). ``check=False``
    skips the bounds check (only for plans already checked against these exact shapes).
    """
    iv = _as_intervals(intervals)
    devs = {t.device for t in list(srcs) + list(dsts)}
    if len(devs) > 1:
        raise ValueError(f"interval_copy: tensors are on several devices {sorted(map(str, devs))}")
    dev = next(iter(devs)) if devs else torch.device("cpu")
    want = _backend.select("weights.interval_copy", dev, backend=backend)
    if want == "reference":
        interval_copy_ref(srcs, dsts, iv)
        return "reference"
    if check:
        check_bounds(srcs, dsts, iv)
    if want == "native":
        _backend.native().interval_copy_cpu(_ptrs(srcs), _ptrs(dsts), iv, int(n_threads))
        return "native"
    stream = torch.cuda.current_stream(dev).cuda_stream  # "cuda"
    _backend.native().interval_copy_cuda(_ptrs(srcs), _ptrs(dsts), iv, int(stream))
    return "cuda"
