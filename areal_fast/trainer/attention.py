"""Varlen attention over packed sequences, registered in transformers' ``AttentionInterface``.

The trainer packs the sequences of a micro-batch end to end into one row ``[1, T]`` and passes
``cu_seq_lens_q/k`` (int32 [S+1]) and ``max_length_q/k`` through the model's ``**kwargs`` to
every attention layer. Since ``areal_varlen`` has no entry in transformers' mask interface,
``create_causal_mask`` returns None and no [T, T] mask is ever built.

Kernels, in order of preference for ``impl="auto"``:
- ``flash_attn``: ``flash_attn_varlen_func`` (CUDA, when flash-attn is installed);
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, torch >= 2.9), called through
  ``torch_varlen_call``, which adapts to the installed signature: 2.10 takes ``is_causal=``, 2.11
  ``window_size=`` (causal is ``(-1, 0)``), 2.13 adds ``enable_gqa=``;
- ``sdpa_loop``: one ``scaled_dot_product_attention(is_causal=True)`` per sequence: exact
  everywhere (CPU tests), O(S) kernel launches.

Grouped-query heads (``Hq = r * Hkv``, Qwen2.5-7B: 28 and 4) reach every kernel as they are, never
repeated to ``[T, Hq, D]`` (at 32k tokens and 28 layers the repeated K/V saved for the backward are
13 GB): flash-attn and torch's flash kernel read ``Hkv < Hq`` directly (torch 2.10 - 2.12 pass K/V
to it unchanged, 2.13 wants ``enable_gqa=True``), SDPA takes ``enable_gqa=True`` (torch >= 2.5).
K/V are repeated only where the kernel cannot take them: a ``varlen_attn`` that routes the call to
cuDNN without choosing per call (:func:`varlen_gqa_native`), an SDPA older than 2.5.

Inside a context-parallel block (``parallel/context.py``'s ``ulysses``) each rank holds a share of
the row's tokens: the forward exchanges it for a share of the heads over every token, runs the same
kernel over the whole row's ``cu_seqlens``, and exchanges back (Ulysses).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from areal_fast.trainer.parallel import context

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


@functools.cache
def _sdpa_takes_gqa() -> bool:
    """Does ``scaled_dot_product_attention`` take ``enable_gqa`` (torch >= 2.5)?"""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 5)


def sdpa_gqa(q, k, v, head_dim: int, **kw):
    """``scaled_dot_product_attention`` with ``Hkv`` dividing ``Hq`` on dimension ``head_dim`` of
    ``q``/``k``/``v``: ``enable_gqa`` where SDPA has it, else K/V repeated to the query heads."""
    hq, hkv = q.shape[head_dim], k.shape[head_dim]
    if hq != hkv:
        if _sdpa_takes_gqa():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        k = k.repeat_interleave(hq // hkv, dim=head_dim)
        v = v.repeat_interleave(hq // hkv, dim=head_dim)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def varlen_attention_ref(query, key, value, cu_seqlens, scaling, sliding_window=None):
    """Reference: per-sequence causal SDPA. query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]
    (query head ``h`` reads KV head ``h // (Hq / Hkv)``, the grouping of transformers)."""
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        q = query[s:e].transpose(0, 1)  # [Hq, L, D]
        k = key[s:e].transpose(0, 1)  # [Hkv, L, D]
        v = value[s:e].transpose(0, 1)
        if sliding_window is None:
            o = sdpa_gqa(q, k, v, -3, is_causal=True, scale=scaling)
        else:
            pos = torch.arange(e - s, device=q.device)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
            o = sdpa_gqa(q, k, v, -3, attn_mask=mask, scale=scaling)
        out[s:e] = o.transpose(0, 1)
    return out


def varlen_attention_bucketed(query, key, value, cu_seqlens, scaling, sliding_window=None):
    """:func:`varlen_attention_ref` with one causal SDPA per distinct sequence LENGTH instead of one
    per sequence: the sequences of a length are gathered into a batch ``[B, H, L, D]`` (one
    ``index_select`` of the row), and the outputs put back in place (one more). Each (sequence, head)
    is the same 3-D SDPA problem as in the reference, so the result is the reference's bit for bit,
    forward and backward (tests/trainer/test_trainer_attention.py). A
    packed micro-batch of many short sequences (the tiny recipe: ~130 of 5-25 tokens, ~20 lengths)
    makes ~7x fewer kernel calls and no per-sequence slice and copy-back in the backward.
    A sliding window goes to the reference."""
    if sliding_window is not None:
        return varlen_attention_ref(query, key, value, cu_seqlens, scaling, sliding_window)
    bounds = cu_seqlens.tolist()
    by_len: dict[int, list[int]] = {}
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            by_len.setdefault(e - s, []).append(s)
    if len(by_len) == len(bounds) - 1:  # every length once: nothing to batch
        return varlen_attention_ref(query, key, value, cu_seqlens, scaling)
    order, pieces = [], []
    for n, starts in by_len.items():
        order.append((torch.tensor(starts)[:, None] + torch.arange(n)).reshape(-1))
        pieces.append((len(starts), n))
    perm = torch.cat(order).to(query.device)
    hq = query.shape[1]
    q, k, v = (x.index_select(0, perm) for x in (query, key, value))
    outs, at = [], 0
    for b, n in pieces:
        sl = slice(at, at + b * n)
        at += b * n
        # [B * H, L, D]: the reference's 3-D call [H, L, D] for B sequences at once (a 4-D batch takes
        # another SDPA route and differs in the last bits); GQA's grouping h -> h // r holds across B
        qb, kb, vb = (x[sl].unflatten(0, (b, n)).transpose(1, 2).flatten(0, 1) for x in (q, k, v))
        o = sdpa_gqa(qb, kb, vb, -3, is_causal=True, scale=scaling)
        outs.append(o.unflatten(0, (b, hq)).transpose(1, 2).reshape(b * n, hq, o.shape[-1]))
    out = torch.cat(outs)
    if perm.numel() == query.shape[0]:  # every token is in some sequence: invert the permutation
        return out.index_select(0, torch.argsort(perm))
    return torch.zeros_like(query).index_copy(0, perm, out)


@functools.cache
def _varlen_params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def varlen_gqa_native(fn, device: torch.device) -> bool:
    """Does ``fn`` (a ``varlen_attn``) take K/V with ``Hkv < Hq`` heads for tensors on ``device``?

    Every release sends the call to torch's flash kernel (flash-attn 2), which reads grouped heads
    directly, unless its module routes CUDA calls to cuDNN (``_should_use_cudnn``, a constant
    ``False`` in 2.10 - 2.13) without choosing a backend per call (``_select_backend``, which leaves
    cuDNN for GQA calls): there K/V must be repeated. A check that fails counts as cuDNN."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    if mod is None or hasattr(mod, "_select_backend") or torch.device(device).type != "cuda":
        return True
    probe = getattr(mod, "_should_use_cudnn", None)
    if probe is None:
        return True
    try:
        return not probe(torch.device(device).index or 0)
    except Exception:  # noqa: BLE001 - unknown: repeat, which every backend takes
        return False


def torch_varlen_call(fn, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, sliding_window=None,
                      native_gqa: bool | None = None):
    """``(args, kwargs)`` for a causal ``fn(*args, **kwargs)`` = ``torch.nn.attention.varlen.varlen_attn``
    of the installed torch, whose keywords changed between releases:

    - causality: ``window_size=(-1, 0)`` (2.11+) or ``is_causal=True`` (2.10);
    - sliding window of ``W`` keys (the query and the ``W - 1`` before it, as the reference):
      ``window_size=(W - 1, 0)``; refused where the function has no ``window_size``;
    - grouped-query heads (``Hq = r * Hkv``): K/V go as they are, with ``enable_gqa=True`` where
      the function has it (2.13+; it refuses ``Hq != Hkv`` without); only where the kernel cannot
      take them (``native_gqa`` False; None: :func:`varlen_gqa_native` for ``q``'s device) are
      K and V repeated ``r`` times along the head dimension (query head ``h`` reads KV head
      ``h // r``, the grouping of transformers and of the reference).
    """
    params = _varlen_params(fn)
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"varlen attention: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if sliding_window is None else (int(sliding_window) - 1, 0)
    elif "is_causal" in params:
        if sliding_window is not None:
            raise NotImplementedError(
                f"attn_impl='torch_varlen': the installed torch {torch.__version__} varlen_attn has no window_size, "
                f"so sliding_window={sliding_window} cannot be honoured; use attn_impl='flash_attn' or 'sdpa_loop'")
        kwargs["is_causal"] = True
    else:
        raise TypeError(f"torch {torch.__version__} varlen_attn takes neither window_size nor is_causal: "
                        f"unknown signature {sorted(params)}; use attn_impl='sdpa_loop'")
    if hq != hkv:
        if native_gqa is None:
            native_gqa = varlen_gqa_native(fn, q.device)
        if not native_gqa:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        elif "enable_gqa" in params:
            kwargs["enable_gqa"] = True
    return (q, k, v, cu_q, cu_k, max_q, max_k), kwargs


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
        if attention_mask is not None:
            out = sdpa_gqa(query, key, value, 1, attn_mask=attention_mask, scale=scaling)
        else:
            out = sdpa_gqa(query, key, value, 1, is_causal=query.shape[2] > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    cu_k = cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
    max_q = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    max_k = int(max_length_k) if max_length_k is not None else max_q

    def kernel(q, k, v):
        return varlen_kernel(q, k, v, cu_seq_lens_q, cu_k, max_q, max_k, scaling, sliding_window)

    group = context.active_group()
    if group is None:
        return kernel(q, k, v).unsqueeze(0), None
    # a context-parallel share: the boundaries are the whole row's, the tokens 1 / cp of it
    cp = group.size()
    # checked where the boundaries are, without waiting for the device (a host sync in every layer
    # otherwise): on a CPU it raises here, on a GPU as a device-side assert at the next sync
    torch._assert_async(cu_seq_lens_q[-1] == q.shape[0] * cp,
                        f"context parallelism: a share of {q.shape[0]} tokens on {cp} ranks, but cu_seqlens do not "
                        f"end at {q.shape[0] * cp} (the whole padded row's boundaries are needed)")
    return context.ulysses_attention(q, k, v, kernel, group).unsqueeze(0), None


def varlen_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scaling, sliding_window=None):
    """The selected kernel on q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] (causal per sequence)."""
    impl = resolve_impl(_selected["impl"], q.device)
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)
    if impl == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True,
                                      window_size=window)
    if impl == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        args, kwargs = torch_varlen_call(varlen_attn, q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k,
                                         max_q, max_k, scaling, sliding_window)
        return varlen_attn(*args, **kwargs)
    return varlen_attention_bucketed(q, k, v, cu_q, scaling, sliding_window)


def register(impl: str = "auto") -> str:
    """Register ``areal_varlen`` with transformers (idempotent) and pick the kernel; returns the name."""
    from transformers import AttentionInterface

    if impl != "auto" and impl not in _IMPLS:
        raise ValueError(f"attention impl must be 'auto' or one of {_IMPLS}, got {impl!r}")
    _selected["impl"] = impl
    AttentionInterface.register(ATTN_NAME, varlen_attention_forward)
    return ATTN_NAME
