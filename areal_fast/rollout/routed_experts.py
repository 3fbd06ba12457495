"""The routed experts a server returns per token (routing replay's record, docs/moe.md), decoded.

* vLLM (0.32's completion API, server flag ``--enable-return-routed-experts``): each choice's
  ``routed_experts`` is base64 of ``.npy`` bytes, shape ``(tokens, layers, top_k)``, an unsigned or
  int32 dtype; the header carries shape and dtype.
* SGLang (0.5.23, server argument ``enable_return_routed_experts``, request flag
  ``return_routed_experts``): ``meta_info["routed_experts"]`` is base64 of the raw int32 bytes of a
  ``(tokens, layers, top_k)`` tensor; the shape is not sent, the model config gives layers and top-k.

Both decode to an int16 array ``[tokens, layers, top_k]`` (expert ids fit: below 32768), the
dtype of the per-token column the trainer would replay; None stays None (routing not returned).
The encoders (:func:`to_vllm`, :func:`to_sglang`) write each server's field the way its own code
does; the embedded engine answers with them.
"""

from __future__ import annotations

import base64
import io

import numpy as np


def from_vllm(field: str | None) -> np.ndarray | None:
    """A vLLM choice's ``routed_experts`` as int16 ``[tokens, layers, top_k]``."""
    if field is None:
        return None
    arr = np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False)
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"routed_experts: expected an integer array [tokens, layers, top_k], got "
                         f"{arr.dtype} {arr.shape}")
    return _as_int16(arr)


def from_sglang(field: str | None, num_layers: int, top_k: int) -> np.ndarray | None:
    """SGLang's ``meta_info["routed_experts"]`` as int16 ``[tokens, num_layers, top_k]``."""
    if field is None:
        return None
    raw = base64.b64decode(field)
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


def _as_int16(arr: np.ndarray) -> np.ndarray:
    if arr.size and (arr.max() >= 2**15 or arr.min() < -1):
        raise ValueError(f"routed_experts: expert ids outside [-1, 32767] (min {arr.min()}, max {arr.max()})")
    return arr.astype(np.int16)
