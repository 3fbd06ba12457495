"""Compact per-token columns: how the sample record (``areal_fast.sample``) holds its tokens, from
the rollout client through the workflow and the controller's buffer to the trainer.

Every per-token field from the rollout client to the trainer is an ``array.array``:

======================  ========  ==========================================================
field                   typecode  element
======================  ========  ==========================================================
token ids, versions     ``'i'``   C int (int32): vocabularies and weight versions fit in 31 bits
behaviour log-probs     ``'f'``   C float (float32): the precision the trainer computes with
loss mask               ``'B'``   unsigned char: 1 model token, 0 context (prompt, tool, feedback)
routed experts          ``'h'``   int16: MoE routing, ``layers x top_k`` expert ids a position
                                  (-1: not recorded); empty when the servers returned none
======================  ========  ==========================================================

Why: as Python lists, each token costs a list slot plus a boxed float (and a boxed int above 256),
~5 GB at 16k requests x 4k tokens instead of ~0.9 GB, and every full collection of the garbage
collector walks every element of every list (~22% of the controller's CPU at 256 servers / 16,384 in
flight). An array is one object whose elements are raw C values: the collector visits it once,
whatever its length; copying or concatenating two of the same type is a ``memcpy``; the trainer views
it as a tensor without a per-element loop (``torch.frombuffer``).

Why float32 log-probs: the trainer's behaviour log-probs are a float32 tensor
(``areal_fast.trainer.batch``), so a float64 column was rounded to float32 there anyway; rounding on
entry gives the trainer the same value, bit for bit, at half the memory (the buffer of finished groups
is most of the controller's memory at long answers). SGLang computes log-probs in float32, so its
values are float32 numbers already and round-trip exactly.

An array indexes, slices, iterates and has ``len`` like a list, but compares equal only to another
array (``array('i', [1]) == [1]`` is False) and ``+`` needs an array on both sides: compare with
``list(x)`` or ``x.tolist()``. :func:`column` converts what a user gives (a list, a tuple, a tensor,
an array of another typecode) on entry; an array of the right typecode is used as it is, not copied.

Checkpoints hold the buffered groups' columns as raw little-endian bytes in ``buffer.bin``
(``areal_fast/buffer.py``); a column in JSON is ``{"__array__": typecode, "b64": base64 of its
little-endian bytes}`` (:func:`encode_column`).
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Iterable

TOKEN_ARRAY = "i"  # token ids and versions: C int (vocabularies and versions fit in 31 bits)
LOGPROB_ARRAY = "f"  # log-probs: C float (float32): the precision the trainer computes with
MASK_ARRAY = "B"  # loss mask: one byte a token, 0 or 1
ROUTING_ARRAY = "h"  # routed experts: int16 expert ids (below 32768), -1 where not recorded
COLUMN_KEY = "__array__"  # marks an encoded column in a checkpoint's JSON
# bytes an item of each column typecode
ITEMSIZE = {code: array(code).itemsize
            for code in (TOKEN_ARRAY, LOGPROB_ARRAY, MASK_ARRAY, ROUTING_ARRAY)}
_BINARY = bytes((0, 1))
_ZERO = b"\x00"
_ONES = array(MASK_ARRAY, [1])

__all__ = ["ITEMSIZE", "LOGPROB_ARRAY", "MASK_ARRAY", "ROUTING_ARRAY", "TOKEN_ARRAY", "column",
           "encode_column", "is_binary_mask", "json_default", "logprobs", "mask", "min_model_version", "routing",
           "routing_from_rows", "tokens"]


def column(values: Iterable, typecode: str, name: str) -> array:
    """``values`` as an ``array(typecode)``: the same object when it already is one, else a new array
    (a list, tuple, tensor, or an array of another typecode, converted element by element).

    ``name`` names the field in the error when an element does not fit (a float where token ids are
    expected, a negative mask entry, a token id beyond int32). Bytes and strings are refused: an
    array would read their raw bytes as numbers."""
    if type(values) is array and values.typecode == typecode:
        return values
    if isinstance(values, bytes | bytearray | memoryview | str):
        raise TypeError(f"{name}: expected a sequence of numbers, got {type(values).__name__}")
    try:
        return array(typecode, values)
    except (TypeError, OverflowError, ValueError) as e:
        kind = {"d": "floats", "B": "0/1 entries", "h": "int16 expert ids"}.get(typecode, "int32 token ids or versions")
        raise type(e)(f"{name}: expected {kind}: {e}") from None


def tokens(values: Iterable = (), name: str = "token ids") -> array:
    """Token ids (or versions) as ``array('i')``."""
    return column(values, TOKEN_ARRAY, name)


def logprobs(values: Iterable = (), name: str = "log-probs") -> array:
    """Log-probs as ``array('f')`` (float32, see the module docstring)."""
    return column(values, LOGPROB_ARRAY, name)


def mask(values: Iterable = (), name: str = "loss_mask") -> array:
    """A loss mask as ``array('B')`` (check it with :func:`is_binary_mask`)."""
    return column(values, MASK_ARRAY, name)


def routing(values: Iterable = (), name: str = "routed_experts") -> array:
    """Routed experts (flat, ``layers x top_k`` a position) as ``array('h')``."""
    return column(values, ROUTING_ARRAY, name)


def routing_from_rows(rows) -> array:
    """A numpy ``[positions, width]`` routing (any integer dtype) as the ``array('h')`` column: one copy
    (into int16 when it is another dtype, then into the array)."""
    import numpy as np  # a dependency of the package; only routing needs it here

    out = array(ROUTING_ARRAY)
    flat = np.ascontiguousarray(rows, dtype=np.int16).reshape(-1)  # 1-D: a view of it casts to bytes
    out.frombytes(memoryview(flat).cast("B"))
    return out


def is_binary_mask(m) -> bool:
    """Every entry is 0 or 1. For an ``array('B')`` this runs in C (``bytes.translate``), not per token."""
    if isinstance(m, array) and m.typecode == MASK_ARRAY:
        return not bytes(m).translate(None, _BINARY)
    return all(x in (0, 1) for x in m)


# Above this many tokens numpy's minimum (~1.8 us a call whatever the length) beats ``min()`` of the
# array (~20 ns a token: it makes an int object per element); measured on our 2-core machine.
_NUMPY_MIN_TOKENS = 128


def min_model_version(versions: array, loss_mask: array | None = None) -> int | None:
    """The oldest version among the model tokens (None without any): tokens with loss mask 0 and
    tokens with a negative version (context, labelled -1; a version the server named in a form that
    cannot be ordered) do not count. ``versions`` is an ``array('i')``, ``loss_mask`` an
    ``array('B')``; no Python loop over the tokens (numpy above a few hundred tokens)."""
    n = len(versions)
    if not n:
        return None
    if n < _NUMPY_MIN_TOKENS:
        if loss_mask is None or _ZERO not in bytes(loss_mask):
            m = min(versions)
            if m >= 0:
                return m
        return min((v for v, b in zip(versions, loss_mask or _ONES * n) if b and v >= 0), default=None)
    import numpy as np  # a dependency of the package; imported only when a long column needs it

    v = np.frombuffer(versions, dtype=np.intc)
    if loss_mask is None or _ZERO not in bytes(loss_mask):
        m = int(v.min())
        if m >= 0:
            return m
        keep = v >= 0
    else:
        keep = (np.frombuffer(loss_mask, dtype=np.uint8) != 0) & (v >= 0)
    return int(v[keep].min()) if keep.any() else None


# ----------------------------------------------------------------------------- checkpoints


def encode_column(a: array) -> dict:
    """A column as JSON: typecode and base64 of its little-endian bytes (see the module docstring)."""
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return {COLUMN_KEY: a.typecode, "b64": base64.b64encode(a).decode("ascii")}


def json_default(obj):
    """``default=`` for ``json.dumps``: arrays as encoded columns; anything else is an error."""
    if isinstance(obj, array):
        return encode_column(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
