"""The routed experts a server returns per token (routing replay's record, docs/moe.md), decoded.

* vLLM (0.32's completion API, server flag ``--enable-return-routed-experts``): each choice's
  ``routed_experts`` is base64 of ``.npy`` bytes, shape ``(tokens, layers, top_k)``, an unsigned or
  int32 dtype; the header carries shape and dtype.
* SGLang (0.5.23, server argument ``enable_return_routed_experts``, request flag
  ``return_routed_experts``): ``meta_info["routed_experts"]`` is base64 of the raw int32 bytes of a
  ``(tokens, layers, top_k)`` tensor; the shape is not sent, the model config gives layers and top-k.

Both decode to an int16 array ``[tokens, layers, top_k]`` (expert ids fit: below 32768), the
dtype of the per-token column the trainer would replay; None stays None (routing not returned).
:func:`check_expert_ids` holds the ids to the model's expert count (``[0, num_experts)``, -1: a
position not recorded): replaying one past it would index past the router's experts (a device assert
on CUDA); the rollout client applies it to every answer, whichever server sent it. Whatever a
field holds, a decoder raises ``ValueError`` naming what is wrong (the rollout client's malformed
answer), never another exception: a field of another type, bytes that are not base64 or not
``.npy``, a header whose shape the bytes do not fill.
The encoders (:func:`to_vllm`, :func:`to_sglang`) write each server's field the way its own code
does; the embedded engine answers with them.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np
from numpy.lib import format as npy_format


def from_vllm(field: str | None) -> np.ndarray | None:
    """A vLLM choice's ``routed_experts`` as int16 ``[tokens, layers, top_k]``. ValueError for
    anything else than base64 of a ``.npy`` integer array of three dimensions."""
    if field is None:
        return None
    arr = _npy(_b64(field, "base64 of .npy bytes"))
    if arr.ndim != 3:
        raise ValueError(f"routed_experts: expected an integer array [tokens, layers, top_k], got "
                         f"{arr.dtype} {arr.shape}")
    return _as_int16(arr)


def from_sglang(field: str | None, num_layers: int, top_k: int) -> np.ndarray | None:
    """SGLang's ``meta_info["routed_experts"]`` as int16 ``[tokens, num_layers, top_k]``."""
    if field is None:
        return None
    raw = _b64(field, "base64 of int32 bytes")
    row = 4 * num_layers * top_k
    if len(raw) % row:
        raise ValueError(f"routed_experts: {len(raw)} bytes are not whole tokens of {num_layers} layers x "
                         f"{top_k} int32 experts")
    return _as_int16(np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k))


def vllm_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM 0.32 / 0.33 sends routing in (``RoutedExpertsCapturer``: the narrowest of
    uint8 and uint16 that holds every expert id, by the model's expert count)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def to_vllm(rows: np.ndarray, num_experts: int) -> str:
    """``rows`` (``[tokens, layers, top_k]``) as a vLLM choice's ``routed_experts``: base64 of the
    ``.npy`` bytes (``np.save``, as vLLM's ``numpy2base64``) in :func:`vllm_dtype`."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(rows, dtype=vllm_dtype(num_experts)), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def to_sglang(rows: np.ndarray) -> str:
    """``rows`` (``[tokens, layers, top_k]``) as SGLang's ``meta_info["routed_experts"]``: base64 of
    the raw little-endian int32 bytes, no header (no rows: the empty string, as SGLang sends)."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def check_expert_ids(rows: np.ndarray, num_experts: int | None) -> None:
    """ValueError when ``rows`` holds an id outside ``[0, num_experts)`` (-1, a position not
    recorded, is allowed); without ``num_experts``, outside what int16 holds."""
    if not rows.size:
        return
    hi, lo = int(rows.max()), int(rows.min())
    if num_experts is not None and (hi >= num_experts or lo < -1):
        raise ValueError(f"routed_experts: expert ids outside [0, {num_experts}) of the model's {num_experts} "
                         f"experts (min {lo}, max {hi}; -1: not recorded)")
    if hi >= 2**15 or lo < -1:
        raise ValueError(f"routed_experts: expert ids outside [-1, 32767] (min {lo}, max {hi})")


def _b64(field: object, what: str) -> bytes:
    if type(field) is not str:  # a JSON number, list or object where the servers send a string
        raise ValueError(f"routed_experts: expected {what} (a string), got a {type(field).__name__}")
    try:
        return base64.b64decode(field, validate=True)
    except ValueError as e:  # binascii.Error, and a non-ASCII character
        raise ValueError(f"routed_experts: not {what}: {e}") from None


def _npy(raw: bytes) -> np.ndarray:
    """The integer array of ``.npy`` bytes, read from its header without ``np.load``: a header naming
    a shape the bytes do not hold (np.load would allocate it first), another format (an ``.npz``, a
    pickle) or a dtype other than a plain integer one is a ValueError."""
    buf = io.BytesIO(raw)
    try:
        version = npy_format.read_magic(buf)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(buf)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(buf)
        else:
            raise ValueError(f".npy format version {version} (1.0 and 2.0 are what np.save writes)")
    except (ValueError, SyntaxError, TypeError) as e:
        raise ValueError(f"routed_experts: not .npy bytes of an array: {e}") from None
    if dtype.kind not in "iu" or dtype.hasobject or dtype.itemsize > 8:
        raise ValueError(f"routed_experts: expected an integer array [tokens, layers, top_k], got dtype {dtype}")
    if any(d < 0 for d in shape):
        raise ValueError(f"routed_experts: the .npy header names the shape {shape}")
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw) - buf.tell():
        raise ValueError(f"routed_experts: the .npy header names {shape} {dtype} ({count * dtype.itemsize} bytes), "
                         f"the field holds {len(raw) - buf.tell()}")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=buf.tell()).reshape(shape, order="F" if fortran else "C")


def _as_int16(arr: np.ndarray) -> np.ndarray:
    check_expert_ids(arr, None)  # what int16 holds
    return arr.astype(np.int16)
