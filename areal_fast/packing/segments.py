"""Varlen packing ops: padded <-> packed tensors, and reordering whole sequences.

A *packed* batch stores the B sequences of a batch back to back: per-token tensors ``[T, ...]``
with ``cu_seqlens`` (int32 ``[B+1]``, ``cu_seqlens[0] = 0``, sequence ``b`` is rows
``cu_seqlens[b]:cu_seqlens[b+1]``), the layout of flash-attention's varlen kernels.

* :func:`pack` / :func:`unpack`: right-padded ``[B, L, ...]`` <-> packed ``[T, ...]``;
  ``pack`` also returns ``position_ids`` (int64 ``[T]``, restarting at 0 for every sequence;
  int64 because Hugging Face models and rotary embeddings take LongTensor positions).
* :func:`gather_segments` reorders whole sequences (e.g. into the micro-batch order
  ``Plan.order`` of :func:`areal_fast.packing.plan_microbatches`) for one tensor or a list
  of per-token tensors of any dtypes and widths in ONE kernel launch;
  :func:`scatter_segments` is its inverse (per-token outputs back into the original order).

Each op has a pure-PyTorch reference (``*_ref``, differentiable through torch) and dispatches
with :func:`areal_fast.dispatch.select` among ``triton``, ``interpret`` (the same Triton kernels
in the CPU interpreter, only when asked for) and ``reference``. The kernel paths are differentiable too (autograd
Functions: pack <-> unpack and gather <-> scatter are each other's backward). All results are
exact copies, so every backend gives bitwise-identical outputs.

Device syncs: ``pack`` needs the token count on the host (one sync when ``lengths`` is a device
tensor); ``unpack``/``gather``/``scatter`` need none except for input validation, which costs
one sync and can be turned off with ``validate=False`` once inputs are known to be good.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from areal_fast.dispatch import select

Tensors = torch.Tensor | Sequence[torch.Tensor]


# ----------------------------------------------------------------------------- references


def pack_ref(padded: torch.Tensor, lengths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference :func:`pack`: boolean-mask indexing of the valid (left) part of each row."""
    B, L = padded.shape[:2]
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=padded.device)
    mask = torch.arange(L, device=padded.device)[None, :] < lengths[:, None]  # [B, L]
    packed = padded[mask]
    position_ids = torch.arange(L, device=padded.device).expand(B, L)[mask]
    cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=padded.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return packed, cu_seqlens, position_ids


def unpack_ref(packed: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, pad_value=0) -> torch.Tensor:
    """Reference :func:`unpack` (every sequence must fit in ``max_len``)."""
    lengths = cu_seqlens.diff().to(torch.int64)
    B = lengths.numel()
    mask = torch.arange(max_len, device=packed.device)[None, :] < lengths[:, None]
    out = packed.new_full((B, max_len, *packed.shape[1:]), pad_value)
    out[mask] = packed
    return out


def _segment_rows_ref(cu_seqlens: torch.Tensor, order: torch.Tensor, T: int):
    """For each token of the reordered layout, its row in the original layout; and new cu_seqlens."""
    cu = cu_seqlens.to(torch.int64)
    order = order.to(device=cu.device, dtype=torch.int64)
    new_lengths = cu.diff()[order]
    new_cu = torch.zeros_like(cu)
    new_cu[1:] = torch.cumsum(new_lengths, 0)
    seg = torch.repeat_interleave(torch.arange(order.numel(), device=cu.device), new_lengths, output_size=T)
    rows = cu[:-1][order][seg] + torch.arange(T, device=cu.device) - new_cu[:-1][seg]
    return rows, new_cu.to(torch.int32)


def gather_segments_ref(tensors: Tensors, cu_seqlens: torch.Tensor, order):
    """Reference :func:`gather_segments`: ``index_select`` with a per-token row index."""
    single = isinstance(tensors, torch.Tensor)
    ts = [tensors] if single else list(tensors)
    rows, new_cu = _segment_rows_ref(cu_seqlens, torch.as_tensor(order), ts[0].shape[0])
    outs = [t.index_select(0, rows.to(t.device)) for t in ts]
    return (outs[0] if single else outs), new_cu


def scatter_segments_ref(tensors: Tensors, cu_seqlens: torch.Tensor, order):
    """Reference :func:`scatter_segments`: ``index_select`` with the inverse row index."""
    single = isinstance(tensors, torch.Tensor)
    ts = [tensors] if single else list(tensors)
    T = ts[0].shape[0]
    rows, _ = _segment_rows_ref(cu_seqlens, torch.as_tensor(order), T)
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(T, device=rows.device)
    outs = [t.index_select(0, inverse.to(t.device)) for t in ts]
    return outs[0] if single else outs


# ----------------------------------------------------------------------------- kernel paths


def _kernels():
    from areal_fast.kernels import packing

    return packing


def _pack_kernel(padded: torch.Tensor, cu: torch.Tensor, T: int, with_pos: bool):
    B, L = padded.shape[:2]
    rest = padded.shape[2:]
    src = padded.contiguous().view(B * L, *rest)
    packed = torch.empty((T, *rest), dtype=padded.dtype, device=padded.device)
    pos = torch.empty(T, dtype=torch.int64, device=padded.device) if with_pos else None
    other_start = torch.arange(B, dtype=torch.int64, device=padded.device) * L
    _kernels().segment_copy([src], [packed], cu, other_start, scatter=False, pos=pos)
    return packed, pos


def _pad_row(like: torch.Tensor, pad_value) -> torch.Tensor | None:
    """One row of ``pad_value`` in ``like``'s dtype, or None when it is all zero bytes."""
    row = torch.full(like.shape[1:], pad_value, dtype=like.dtype)  # on the host: checking it is free
    if not row.reshape(-1).view(torch.uint8).any():
        return None
    return row.to(like.device)


def _unpack_kernel(packed: torch.Tensor, cu: torch.Tensor, max_len: int, pad_value):
    B = cu.numel() - 1
    out = torch.empty((B, max_len, *packed.shape[1:]), dtype=packed.dtype, device=packed.device)
    _kernels().unpack_rows(packed.contiguous(), out, cu, max_len, _pad_row(packed, pad_value))
    return out


def _segment_kernel(tensors, cu_new: torch.Tensor, old_start: torch.Tensor, scatter: bool):
    srcs = [t.contiguous() for t in tensors]
    dsts = [torch.empty_like(s) for s in srcs]
    _kernels().segment_copy(srcs, dsts, cu_new, old_start, scatter=scatter)
    return dsts


class _PackFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, cu, T):
        packed, pos = _pack_kernel(padded, cu, T, with_pos=True)
        ctx.save_for_backward(cu)
        ctx.shape = padded.shape
        ctx.mark_non_differentiable(pos)
        return packed, pos

    @staticmethod
    def backward(ctx, grad_packed, _grad_pos):
        (cu,) = ctx.saved_tensors
        return _unpack_kernel(grad_packed, cu, ctx.shape[1], 0), None, None


class _UnpackFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed, cu, max_len, pad_value):
        ctx.save_for_backward(cu)
        ctx.T = packed.shape[0]
        return _unpack_kernel(packed, cu, max_len, pad_value)

    @staticmethod
    def backward(ctx, grad_padded):
        (cu,) = ctx.saved_tensors
        grad, _ = _pack_kernel(grad_padded, cu, ctx.T, with_pos=False)
        return grad, None, None, None


class _SegmentFn(torch.autograd.Function):
    """gather (scatter=False) or scatter (True) of several tensors; backward is the other one."""

    @staticmethod
    def forward(ctx, cu_new, old_start, scatter, *tensors):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(cu_new, old_start)
        ctx.scatter = scatter
        outs = _segment_kernel(tensors, cu_new, old_start, scatter)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        cu_new, old_start = ctx.saved_tensors
        want = [i for i, g in enumerate(grads) if g is not None and ctx.needs_input_grad[3 + i]]
        result = [None] * len(grads)
        if want:
            back = _segment_kernel([grads[i] for i in want], cu_new, old_start, not ctx.scatter)
            for i, g in zip(want, back):
                result[i] = g
        return (None, None, None, *result)


# ----------------------------------------------------------------------------- input checks


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_cu(op: str, cu_seqlens, device) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"{op}: cu_seqlens must be a torch.Tensor (int32 [B+1]), got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{op}: cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"{op}: cu_seqlens must be 1-D with B+1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    return cu_seqlens.to(device).contiguous()


def _check_cu_values(op: str, cu: torch.Tensor, T: int, rows_name: str, extra=()) -> None:
    """One device sync: cu[0] == 0, non-decreasing, cu[-1] == T, plus ``extra`` (name, bool tensor)."""
    diffs = cu.diff()
    flags = [cu[0] == 0, (diffs >= 0).all() if diffs.numel() else cu[0] == 0, cu[-1] == T]
    flags += [f for _, f in extra]
    ok = torch.stack(flags).tolist()
    if not ok[0]:
        raise ValueError(f"{op}: cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    if not ok[1]:
        i = int(torch.nonzero(diffs < 0)[0])
        raise ValueError(
            f"{op}: cu_seqlens must be non-decreasing, got cu_seqlens[{i}] = {int(cu[i])} > "
            f"cu_seqlens[{i + 1}] = {int(cu[i + 1])}"
        )
    if not ok[2]:
        raise ValueError(f"{op}: cu_seqlens[-1] = {int(cu[-1])} tokens but {rows_name} has {T} rows")
    for (msg, _), good in zip(extra, ok[3:]):
        if not good:
            raise ValueError(f"{op}: {msg()}")


def _as_tensor_list(op: str, tensors) -> tuple[list[torch.Tensor], bool]:
    single = isinstance(tensors, torch.Tensor)
    ts = [tensors] if single else list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
        raise TypeError(
            f"{op}: expected a tensor or a non-empty list/tuple of tensors, got {type(tensors).__name__}"
        )
    T, dev = None, ts[0].device
    for i, t in enumerate(ts):
        if t.dim() < 1:
            raise ValueError(f"{op}: tensors[{i}] is 0-d; per-token tensors need shape [T, ...]")
        if t.device != dev:
            raise ValueError(f"{op}: tensors[{i}] is on {t.device} but tensors[0] is on {dev}")
        if T is not None and t.shape[0] != T:
            raise ValueError(
                f"{op}: all tensors must have the same number of tokens (dim 0); tensors[0] has {T}, "
                f"tensors[{i}] has {t.shape[0]} (shape {tuple(t.shape)})"
            )
        T = t.shape[0]
    return ts, single


def _check_order(op: str, order, B: int, device) -> torch.Tensor:
    if not isinstance(order, torch.Tensor):
        order = torch.from_numpy(np.ascontiguousarray(np.asarray(order)))
    if order.numel() == 0:
        order = order.to(torch.int64)  # an empty list arrives as float64
    if not _is_int_dtype(order.dtype):
        raise TypeError(f"{op}: order must hold integers, got {order.dtype}")
    if order.dim() != 1 or order.numel() != B:
        raise ValueError(
            f"{op}: order must be 1-D with one entry per sequence (B = {B} from cu_seqlens), "
            f"got shape {tuple(order.shape)}"
        )
    return order.to(device=device, dtype=torch.int64)


def _permutation_check(order: torch.Tensor, B: int):
    in_range = ((order >= 0) & (order < B)).all()
    counts = torch.bincount(order.clamp(0, max(B - 1, 0)), minlength=B)
    flag = in_range & (counts == 1).all() if B else torch.tensor(True, device=order.device)
    shown = order[:16].tolist()
    msg = lambda: (  # noqa: E731 - built lazily, only when the check fails
        f"order must be a permutation of range({B}) (B from cu_seqlens), got "
        f"{shown}{' ...' if B > 16 else ''}"
    )
    return msg, flag


# ----------------------------------------------------------------------------- public ops


def pack(padded: torch.Tensor, lengths, *, backend: str | None = None):
    """Right-padded ``[B, L, ...]`` -> ``(packed [T, ...], cu_seqlens int32 [B+1], position_ids int64 [T])``.

    ``lengths`` (``[B]`` ints in ``0..L``; tensor, array or list) says how many leading rows of each
    sequence are valid. Differentiable w.r.t. ``padded`` (the pad rows get zero gradient).
    """
    op = "pack"
    if not isinstance(padded, torch.Tensor) or padded.dim() < 2:
        got = tuple(padded.shape) if isinstance(padded, torch.Tensor) else type(padded).__name__
        raise ValueError(f"{op}: padded must be a tensor [B, L, ...], got {got}")
    B, L = padded.shape[:2]
    lt = lengths if isinstance(lengths, torch.Tensor) else torch.as_tensor(np.asarray(lengths))
    if lt.numel() == 0:
        lt = lt.to(torch.int64)
    if not _is_int_dtype(lt.dtype):
        raise TypeError(f"{op}: lengths must hold integers, got {lt.dtype}")
    if lt.dim() != 1 or lt.numel() != B:
        raise ValueError(f"{op}: lengths must have shape [B] = [{B}], got {tuple(lt.shape)}")
    # Check on the host copy when lengths come from the host (no device sync), else one sync.
    lt = lt.to(torch.int64)
    T = 0
    if B:
        lo, hi, T = torch.stack([lt.min(), lt.max(), lt.sum()]).tolist()
        if lo < 0 or hi > L:
            i = int(torch.nonzero((lt < 0) | (lt > L))[0])
            raise ValueError(f"{op}: lengths[{i}] = {int(lt[i])} is outside 0..L = 0..{L} (padded.shape[1])")
    lt = lt.to(padded.device)
    which = select("packing.pack", padded.device, backend=backend)
    if which == "reference":
        return pack_ref(padded, lt)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=padded.device)
    cu[1:] = torch.cumsum(lt, 0)
    if torch.is_grad_enabled() and padded.requires_grad:
        packed, pos = _PackFn.apply(padded, cu, T)
    else:
        packed, pos = _pack_kernel(padded, cu, T, with_pos=True)
    return packed, cu, pos


def unpack(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int | None = None,
    pad_value=0,
    *,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Packed ``[T, ...]`` -> right-padded ``[B, max_len, ...]`` filled with ``pad_value`` past each length.

    ``max_len=None`` uses the longest sequence (a device sync). With ``validate`` (default) a
    sequence longer than ``max_len`` is an error; without it, such sequences are truncated by the
    kernels (the reference then fails). Differentiable w.r.t. ``packed``.
    """
    op = "unpack"
    if not isinstance(packed, torch.Tensor) or packed.dim() < 1:
        got = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"{op}: packed must be a tensor [T, ...], got {got}")
    cu = _check_cu(op, cu_seqlens, packed.device)
    lengths = cu.diff()
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    max_len = int(max_len)
    if max_len < 0:
        raise ValueError(f"{op}: max_len must be >= 0, got {max_len}")
    if validate:
        too_long = lambda: (  # noqa: E731
            f"sequence {int(torch.argmax(lengths))} has {int(lengths.max())} tokens > max_len = {max_len}"
        )
        fits = (lengths <= max_len).all() if lengths.numel() else torch.tensor(True, device=cu.device)
        _check_cu_values(op, cu, packed.shape[0], "packed", extra=[(too_long, fits)])
    which = select("packing.unpack", packed.device, backend=backend)
    if which == "reference":
        return unpack_ref(packed, cu, max_len, pad_value)
    if torch.is_grad_enabled() and packed.requires_grad:
        return _UnpackFn.apply(packed, cu, max_len, pad_value)
    return _unpack_kernel(packed, cu, max_len, pad_value)


def _segments(op: str, tensors, cu_seqlens, order, backend, validate, scatter: bool):
    ts, single = _as_tensor_list(op, tensors)
    device, T = ts[0].device, ts[0].shape[0]
    cu = _check_cu(op, cu_seqlens, device)
    B = cu.numel() - 1
    order_t = _check_order(op, order, B, device)
    if validate:
        _check_cu_values(op, cu, T, "tensors[0]", extra=[_permutation_check(order_t, B)])
    which = select(f"packing.{op}", device, backend=backend)
    if which == "reference":
        if scatter:
            return scatter_segments_ref(tensors if single else ts, cu, order_t), None
        return gather_segments_ref(tensors if single else ts, cu, order_t)
    cu64 = cu.to(torch.int64)
    cu_new = torch.zeros_like(cu)
    cu_new[1:] = torch.cumsum(cu64.diff()[order_t], 0)
    old_start = cu64[:-1][order_t].contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        outs = list(_SegmentFn.apply(cu_new, old_start, scatter, *ts))
    else:
        outs = _segment_kernel(ts, cu_new, old_start, scatter)
    return (outs[0] if single else outs), cu_new


def gather_segments(
    tensors: Tensors, cu_seqlens: torch.Tensor, order, *, backend: str | None = None, validate: bool = True
):
    """Reorder whole sequences: output sequence ``j`` is input sequence ``order[j]``.

    ``tensors`` is one per-token tensor ``[T, ...]`` or a list/tuple of them (any dtypes and
    trailing shapes, same T), moved in ONE kernel launch. ``order`` (a permutation of
    ``range(B)``; tensor, numpy array such as ``Plan.order``, or list). Returns
    ``(reordered, new_cu_seqlens)`` where ``reordered`` is a tensor or a list like the input.
    """
    return _segments("gather_segments", tensors, cu_seqlens, order, backend, validate, scatter=False)


def scatter_segments(
    tensors: Tensors, cu_seqlens: torch.Tensor, order, *, backend: str | None = None, validate: bool = True
):
    """Inverse of :func:`gather_segments`: put reordered per-token tensors back in the original order.

    Takes the SAME ``cu_seqlens`` (of the original order) and ``order`` as the gather, so
    ``scatter_segments(gather_segments(x, cu, order)[0], cu, order) == x``. Returns the tensor or
    list of tensors only (the original ``cu_seqlens`` are the caller's).
    """
    return _segments("scatter_segments", tensors, cu_seqlens, order, backend, validate, scatter=True)[0]
