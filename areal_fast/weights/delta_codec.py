"""The delta codec: which elements of a 16-bit tensor changed between two versions, and applying
such a delta in place, bitwise.

Encoding: **indices + values**. A change costs 4 bytes of int32 index + 2 bytes of value, so a
delta of ``n`` changes out of ``N`` elements is ``6n`` bytes against ``2N`` for the whole tensor
(break-even at 33 % changed). A bitmask + values costs ``N/8 + 2n``: it wins only above
``n/N = 3.1 %``. At RL learning rates AdamW changes 0.1-3 % of the bf16 elements per step
(``bench/bench_delta.py``, results in ``docs/weight_sync.md``), mostly below that line, and indices
also apply with one scatter and need no decode pass, so indices + values it is.

Elements are compared as 16-bit words (``int16`` views), never as floats: ``-0.0`` vs ``0.0`` is a
change, NaN equals itself bit for bit, and a NaN payload travels unchanged. Indices are ascending
int32 (a tensor of 2**31 elements or more is always sent whole).

Ops and backends (:func:`areal_fast.dispatch.select`):

* ``weights.delta_encode``: triton (``kernels/delta.py``, CUDA tensors), native (C++
  ``csrc/reshard/delta_cpu.cpp``, CPU tensors), interpret (the Triton kernel on CPU, tests),
  reference (:func:`delta_encode_ref`, which defines the result);
* ``weights.delta_apply``: the same four; reference :func:`delta_apply_ref`.
"""

from __future__ import annotations

import torch

from areal_fast import dispatch as _backend

__all__ = ["delta_encode", "delta_apply", "delta_encode_ref", "delta_apply_ref", "delta_bytes", "MAX_WORDS",
           "WORD_DTYPES"]

WORD_DTYPES = (torch.bfloat16, torch.float16, torch.int16)
MAX_WORDS = 2**31 - 1  # int32 indices


def delta_bytes(n_changed: int) -> int:
    """Bytes a delta of ``n_changed`` elements takes on the wire (int32 index + 16-bit value)."""
    return 6 * int(n_changed)


def _words(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype not in WORD_DTYPES:
        raise ValueError(f"delta codec: {what} has dtype {t.dtype}; only 16-bit tensors "
                         f"({', '.join(map(str, WORD_DTYPES))}) are encoded")
    if not t.is_contiguous():
        raise ValueError(f"delta codec: {what} (shape {tuple(t.shape)}) is not contiguous")
    if t.numel() > MAX_WORDS:
        raise ValueError(f"delta codec: {what} has {t.numel()} elements, more than int32 indices address")
    return t.view(torch.int16).reshape(-1)


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        raise ValueError(f"delta codec: old {old.dtype}{tuple(old.shape)} on {old.device} and new "
                         f"{new.dtype}{tuple(new.shape)} on {new.device} must match in dtype, shape and device")
    return _words(old, "old"), _words(new, "new")


# --------------------------------------------------------------------------------- reference
def delta_encode_ref(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (ascending int32 flat indices where the bit patterns differ, new values there in
    ``new``'s dtype)."""
    a, b = _check_pair(old, new)
    idx = torch.nonzero(a != b).reshape(-1)
    return idx.to(torch.int32), b[idx].view(new.dtype)


def delta_apply_ref(dst: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> None:
    """Reference: ``dst.view(-1)[idx] = val`` on the bit patterns."""
    w, i, v = _check_apply(dst, idx, val)
    _check_range(w, i)
    w[i.long()] = v


def _check_apply(dst: torch.Tensor, idx: torch.Tensor, val: torch.Tensor):
    w = _words(dst, "dst")
    if idx.dtype != torch.int32 or idx.dim() != 1:
        raise ValueError(f"delta apply: idx must be a 1-D int32 tensor, got {idx.dtype}{tuple(idx.shape)}")
    if val.dtype != dst.dtype or val.shape != idx.shape:
        raise ValueError(f"delta apply: val must be {dst.dtype}{tuple(idx.shape)} like dst and idx, got "
                         f"{val.dtype}{tuple(val.shape)}")
    if idx.device != dst.device or val.device != dst.device:
        raise ValueError(f"delta apply: dst on {dst.device}, idx on {idx.device}, val on {val.device}")
    return w, idx.contiguous(), val.contiguous().view(torch.int16)


def _check_range(w: torch.Tensor, idx: torch.Tensor) -> None:
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= w.numel():
            bad = lo if lo < 0 else hi
            raise ValueError(f"delta apply: index {bad} is outside a tensor of {w.numel()} elements")


# ------------------------------------------------------------------------------------ dispatch
def delta_encode(old: torch.Tensor, new: torch.Tensor, backend: str | None = None, max_changed: int | None = None,
                 n_threads: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Changes from ``old`` to ``new`` as (int32 indices, values in their dtype), equal to
    :func:`delta_encode_ref`; None when more than ``max_changed`` elements changed (the count
    is taken first, so a tensor sent whole costs one read of both, no index arrays)."""
    a, b = _check_pair(old, new)
    want = _backend.select("weights.delta_encode", old.device, backend=backend)
    if want == "reference":
        idx, val = delta_encode_ref(old, new)
        return None if max_changed is not None and idx.numel() > max_changed else (idx, val)
    if want == "native":
        lib = _backend.native()
        n = a.numel()
        total = int(lib.delta_count_cpu(a.data_ptr(), b.data_ptr(), n, n_threads))
        if max_changed is not None and total > max_changed:
            return None
        idx = torch.empty(total, dtype=torch.int32)
        val = torch.empty(total, dtype=torch.int16)
        got = lib.delta_encode_cpu(a.data_ptr(), b.data_ptr(), n, idx.data_ptr(), val.data_ptr(), total, n_threads)
        assert got == total, (got, total)
        return idx, val.view(new.dtype)
    from areal_fast.kernels import delta as k  # triton / interpret

    counts = k.count_blocks(a, b)
    total = int(counts.sum())
    if max_changed is not None and total > max_changed:
        return None
    idx, val = k.encode(a, b, counts, total)
    return idx, val.view(new.dtype)


def delta_apply(dst: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, backend: str | None = None,
                n_threads: int = 0, check: bool = True) -> str:
    """``dst.view(-1)[idx] = val`` bitwise, in place; returns the backend that ran. An index outside
    ``dst`` raises ValueError before anything is written (``check=False`` skips that test on the
    GPU paths, which costs a device sync; the C++ path always checks)."""
    w, i, v = _check_apply(dst, idx, val)
    want = _backend.select("weights.delta_apply", dst.device, backend=backend)
    if want == "reference":
        delta_apply_ref(dst, idx, val)
        return want
    if want == "native":
        try:
            _backend.native().delta_apply_cpu(w.data_ptr(), w.numel(), i.data_ptr(), v.data_ptr(), i.numel(),
                                              n_threads)
        except ValueError as e:  # std::invalid_argument
            raise ValueError(str(e)) from None
        return want
    if check:
        _check_range(w, i)
    from areal_fast.kernels import delta as k

    k.apply(w, i, v)
    return want
