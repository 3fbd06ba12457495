"""Delta updates on the wire and on the server (see :mod:`areal_fast.weights.delta` for the sender).

An update call's entries are whole tensors under their own names, and deltas as two entries:
``NAME#delta_idx:D0xD1`` (int32 flat indices into the tensor of that shape) and ``NAME#delta_val``
(the new values, in the tensor's dtype). Torch and the codec only: the embedded engine and the
SGLang applier import this without the trainer's gather machinery.
"""

from __future__ import annotations

import torch

from areal_fast.weights.delta_codec import delta_apply

__all__ = ["DELTA_IDX", "DELTA_VAL", "delta_name", "parse_delta_name", "split_entries", "check_delta",
           "check_indices", "apply_named"]

DELTA_IDX = "#delta_idx"
DELTA_VAL = "#delta_val"


def delta_name(name: str, shape) -> str:
    """The index entry's name: the tensor, the marker and its shape (``w#delta_idx:896x4864``), so a
    server can map flat indices to a tensor it has to locate through its own loader."""
    return f"{name}{DELTA_IDX}:{'x'.join(str(int(s)) for s in shape)}"


def parse_delta_name(entry: str) -> tuple[str, str, tuple[int, ...] | None] | None:
    """``(tensor name, 'idx' | 'val', shape or None)`` of a delta entry, None for a whole tensor."""
    if DELTA_VAL in entry and entry.endswith(DELTA_VAL):
        return entry[: -len(DELTA_VAL)], "val", None
    head, sep, tail = entry.rpartition(DELTA_IDX + ":")
    if not sep:
        return None
    try:
        shape = tuple(int(s) for s in tail.split("x")) if tail else ()
    except ValueError:
        raise ValueError(f"delta entry {entry!r}: bad shape {tail!r}") from None
    return head, "idx", shape


Delta = tuple[tuple[int, ...] | None, torch.Tensor, torch.Tensor]  # (shape, int32 indices, values)


def split_entries(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Delta]]:
    """``(whole tensors, {name: (shape, idx, val)})`` of one update call's entries; a delta missing
    its index or its values raises ValueError naming it."""
    whole, idx, val = [], {}, {}
    for entry, t in named:
        parsed = parse_delta_name(entry)
        if parsed is None:
            whole.append((entry, t))
        elif parsed[1] == "idx":
            idx[parsed[0]] = (parsed[2], t)
        else:
            val[parsed[0]] = t
    lonely = sorted(set(idx) ^ set(val))
    if lonely:
        raise ValueError(f"delta entries without their pair (index or values) for {lonely[:5]}")
    deltas = {}
    for n, (shape, i) in idx.items():
        v = val[n]
        if i.dtype != torch.int32 or i.shape != v.shape or i.dim() != 1:
            raise ValueError(f"delta for {n}: indices {i.dtype}{tuple(i.shape)} and values "
                             f"{v.dtype}{tuple(v.shape)} do not pair")
        deltas[n] = (shape, i, v)
    return whole, deltas


def check_delta(name: str, param: torch.Tensor, shape, idx: torch.Tensor) -> None:
    """Refuse a delta that does not fit ``param`` before anything is written."""
    if shape is not None and tuple(shape) != tuple(param.shape):
        raise ValueError(f"delta for {name}: computed for shape {tuple(shape)}, the parameter is {tuple(param.shape)}")
    check_indices(name, param.numel(), idx)


def check_indices(name: str, numel: int, idx: torch.Tensor) -> None:
    """Refuse flat indices outside a tensor of ``numel`` elements (negative or ``>= numel``), naming
    the tensor and the first bad index (the smallest negative one, else the largest)."""
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= numel:
            raise ValueError(f"delta for {name}: index {lo if lo < 0 else hi} outside {numel} elements")


def apply_named(name: str, param: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> None:
    """Write a delta into ``param`` in place. Same dtype: the codec's apply, bitwise. Another dtype
    (an fp32 engine fed bf16): the changed elements are cast like a whole load would cast them."""
    idx, val = idx.to(param.device), val.to(param.device)
    with torch.no_grad():
        if param.dtype == val.dtype and param.is_contiguous():
            delta_apply(param.data, idx, val, check=False)
        else:
            param.data.view(-1)[idx.long()] = val.to(param.dtype)
