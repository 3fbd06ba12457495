"""Varlen attention over packed sequences, registered in transformers' ``AttentionInterface``.

The trainer packs the sequences of a micro-batch end to end into one row ``[1, T]`` and passes
``cu_seq_lens_q/k`` (int32 [S+1]) and ``max_length_q/k`` through the model's ``**kwargs`` to
every attention layer. Since ``areal_varlen`` has no entry in transformers' mask interface,
``create_causal_mask`` returns None and no [T, T] mask is ever built.

Kernels, in order of preference for ``impl="auto"``:
- ``flash_attn``: ``flash_attn_varlen_func`` (CUDA, when flash-attn is installed);
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, torch >= 2.9);
- ``sdpa_loop``: one ``scaled_dot_product_attention(is_causal=True)`` per sequence: exact
  everywhere (CPU tests), O(S) kernel launches.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ATTN_NAME = "areal_varlen"
_IMPLS = ("flash_attn", "torch_varlen", "sdpa_loop")
_selected = {"impl": "auto"}


@functools.cache
def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _has_torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, device: torch.device) -> str:
    """The kernel ``impl`` maps to on ``device``; raises if an explicit one cannot run there."""
    on_cuda = device.type == "cuda"
    if impl == "auto":
        if on_cuda and _has_flash_attn():
            return "flash_attn"
        if on_cuda and _has_torch_varlen():
            return "torch_varlen"
        return "sdpa_loop"
    if impl not in _IMPLS:
        raise ValueError(f"attention impl must be 'auto' or one of {_IMPLS}, got {impl!r}")
    if impl == "flash_attn" and not (on_cuda and _has_flash_attn()):
        raise RuntimeError("attn_impl='flash_attn' needs CUDA and the flash-attn package")
    if impl == "torch_varlen" and not (on_cuda and _has_torch_varlen()):
        raise RuntimeError("attn_impl='torch_varlen' needs CUDA and torch.nn.attention.varlen")
    return impl


def varlen_attention_ref(query, key, value, cu_seqlens, scaling, sliding_window=None):
    """Reference: per-sequence causal SDPA. query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]."""
    n_rep = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        q = query[s:e].transpose(0, 1)  # [Hq, L, D]
        k = key[s:e].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        v = value[s:e].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        if sliding_window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        else:
            pos = torch.arange(e - s, device=q.device)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out[s:e] = o.transpose(0, 1)
    return out


def varlen_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
):
    """transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None).

    Without ``cu_seq_lens_q`` (e.g. a plain unpacked call) it is ordinary causal SDPA per row.
    """
    if dropout:
        raise ValueError("areal_varlen attention does not implement dropout (the trainer runs with dropout 0)")
    if cu_seq_lens_q is None:
        n_rep = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(n_rep, dim=1)
        v = value.repeat_interleave(n_rep, dim=1)
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=scaling)
        else:
            out = F.scaled_dot_product_attention(query, k, v, is_causal=query.shape[2] > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    cu_k = cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
    max_q = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    max_k = int(max_length_k) if max_length_k is not None else max_q
    impl = resolve_impl(_selected["impl"], q.device)
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
    if impl == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q, k, v, cu_seq_lens_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True, window_size=window
        )
    elif impl == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        # varlen_attn is causal-only; window (left, 0) keeps it causal with an optional sliding window
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_k, max_q, max_k, scale=scaling, window_size=(window[0], 0),
                          enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = varlen_attention_ref(q, k, v, cu_seq_lens_q, scaling, sliding_window)
    return out.unsqueeze(0), None


def register(impl: str = "auto") -> str:
    """Register ``areal_varlen`` with transformers (idempotent) and pick the kernel; returns the name."""
    from transformers import AttentionInterface

    if impl != "auto" and impl not in _IMPLS:
        raise ValueError(f"attention impl must be 'auto' or one of {_IMPLS}, got {impl!r}")
    _selected["impl"] = impl
    AttentionInterface.register(ATTN_NAME, varlen_attention_forward)
    return ATTN_NAME
