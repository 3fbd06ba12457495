"""Fused LM head + decoupled-PPO loss: the [T, V] logits are never held whole.

The tokens are processed in chunks of ``chunk_size`` rows: logits of a chunk = h_c @ W^T (+ b),
the loss kernel's statistics on it (forward), and in the backward the chunk's logits are
recomputed, dloss/dlogits is written into them in place, and grad_hidden = dz @ W and
grad_weight += dz^T @ h_c are matmuls. Peak extra memory is one chunk of logits plus an fp32
grad_weight accumulator ([V, H]); the materialised path holds [T, V] logits, their gradient and
fp32 temporaries.

Cost. Token-level importance (the default): every token's loss depends only on its own l_t and
H_t, so g_t and e_t are known as soon as a chunk's statistics are, and the gradients are
computed during the forward (``single_pass``): 3 GEMMs, as the bare lm_head (forward + two
backward GEMMs), plus the memory-bound loss kernels. Sequence-level importance couples the
tokens of a sequence: the forward keeps only [T] statistics and the backward recomputes each
chunk's logits, 4 GEMMs (4/3 of the bare lm_head).

FSDP2. ``weight`` must be the full (unsharded) [V, H] lm_head weight. With FSDP2
(``fully_shard``), a parameter is only unsharded inside its module's forward (pre-forward
all-gather) and re-sharded after it, and the backward all-gathers it again through the hooks on
that module. So the trainer must call this function where FSDP has the weight unsharded and
autograd records it, either

  * inside the forward of the module that owns ``lm_head`` (e.g. replace ``lm_head.forward`` by a
    function that returns the loss, or a wrapper module sharded together with ``lm_head``), using
    ``lm_head.weight`` there: FSDP's backward hooks re-gather it and reduce-scatter the gradient;
  * or, when ``lm_head`` is part of the root FSDP module (``reshard_after_forward`` of the root is
    False), after the model forward with the root unsharded; or call ``lm_head.unshard()``
    before and ``lm_head.reshard()`` after the backward (costs one all-gather's memory).

Passing a sharded DTensor raises a ValueError (the chunk GEMMs need a plain local tensor).
Tied embeddings are fine: the gradient flows to the tied parameter as for any matmul.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from areal_fast.dispatch import select

from . import custom_ops  # (also registers torch.ops.areal_fast.*)
from .custom_ops import GradPath, fused_linear_grad_path  # noqa: F401  (public: which grad_weight GEMM runs)
from .loss_config import PPOLossConfig, resolve_loss_config
from .objective import aggregation_weights, check_token_inputs, ppo_objective
from .ppo_loss_ref import math_dtype
from .types import PPOLossOutput

AVAILABLE = ("triton", "interpret", "reference")
# Rows per chunk. grad_weight += dz^T @ h_c reads and writes the fp32 [V, H] accumulator once per
# chunk: 8 V H bytes, 4.4 GB at H = 3584, V = 151,936. At T = 32k, 1,024-row chunks made that
# 32 times (~140 GB, ~47 ms at 3 TB/s); 4,096 rows make it 8 times (~35 GB, ~12 ms), for a chunk
# of logits of 1.2 GB in bf16. Smaller chunks also lose GEMM efficiency ([1024, H] @ [H, V]
# runs near peak on H100; Liger's rule gives 128 rows at T = 4096, H = 3584).
TARGET_CHUNK = 4096
# Never fewer rows than this, even when memory is short (a [256, H] @ [H, V] GEMM still fills
# an H100; below it the chunk loop's launches and the accumulator traffic dominate).
MIN_CHUNK = 256
# The chunk's logits, and the buffers that live beside them (the previous chunk's logits while
# the next GEMM runs, the Triton kernels' output), may take this share of the free memory.
CHUNK_MEMORY_FRACTION = 0.25
# Buffers of [rows, V] in the logits dtype alive at once per chunk: the logits (dz is written
# into them in place) and the next chunk's logits allocated before the previous ones are freed.
CHUNK_BUFFERS = 2


def default_chunk_size(T: int, H: int, V: int, *, itemsize: int = 2, free_bytes: int | None = None) -> int:
    """Rows per chunk: the larger of ``TARGET_CHUNK`` and Liger-Kernel's rule (a chunk of logits
    about the size of ``hidden``: ``next_pow2(T / ceil(V / H))``, which grows past the target only
    for T beyond ~180k at H = 3584), then fewer when ``CHUNK_MEMORY_FRACTION`` of ``free_bytes``
    (device memory free now; None: no bound, e.g. on CPU) cannot hold ``CHUNK_BUFFERS`` chunks of
    [rows, V] logits of ``itemsize`` bytes: rounded down to a multiple of ``MIN_CHUNK``, never
    fewer than ``MIN_CHUNK``. Never more than T."""
    per_hidden = T / max(1, math.ceil(V / max(H, 1)))
    rows = max(TARGET_CHUNK, 1 << max(0, math.ceil(math.log2(max(per_hidden, 1)))))
    if free_bytes is not None:
        fit = int(CHUNK_MEMORY_FRACTION * max(free_bytes, 0)) // (CHUNK_BUFFERS * max(V, 1) * itemsize)
        rows = min(rows, max(MIN_CHUNK, fit // MIN_CHUNK * MIN_CHUNK))
    return max(1, min(T, rows))


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take: the driver's free memory plus what torch's
    caching allocator holds unused. None on CPU, or while torch.compile traces (no device query)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _check_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_size) -> int:
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and type(t) is not Tensor and not isinstance(t, torch.nn.Parameter) \
                and hasattr(t, "placements"):
            raise ValueError(f"{name} is a DTensor (sharded); pass the unsharded local tensor "
                             "(see the FSDP2 note in areal_fast.ops.fused_linear)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must have shape [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.device != hidden.device or labels.dtype.is_floating_point:
        raise ValueError(f"labels must be an integer tensor on {hidden.device}, got {labels.dtype} on {labels.device}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device}, hidden on {hidden.device}")
    T, H = hidden.shape
    if chunk_size is None:
        return default_chunk_size(T, H, weight.shape[0], itemsize=hidden.element_size(),
                                  free_bytes=free_device_bytes(hidden.device))
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def fused_linear_decoupled_ppo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    prox_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    config: PPOLossConfig | None = None,
    normalizer: float | Tensor | None = None,
    single_pass: bool | None = None,
    backend: str | None = None,
    **overrides,
) -> PPOLossOutput:
    """:func:`areal_fast.ops.decoupled_ppo_loss` of ``logits = hidden @ weight.T (+ bias)``
    (same ``config`` and keyword ``overrides``).

    ``hidden`` [T, H] (final hidden states, already shifted like the labels), ``weight`` [V, H]
    the full lm_head weight (see the module docstring for FSDP2), same dtype. Gradients flow to
    hidden, weight and bias. ``chunk_size`` rows per chunk (default: ``default_chunk_size``).
    ``single_pass`` (default: when ``importance_level="token"``): compute the gradients during
    the forward (3 GEMMs, no recompute); they are held (grad_hidden [T, H], grad_weight [V, H]
    in the weight dtype) until the backward. Otherwise the backward recomputes the logits.
    fp64 ``hidden``/``weight`` compute in fp64 on every backend (the Triton kernels are fp32-only:
    the reference formulas run then) and give an fp64 loss; ``logprobs``/``entropy`` are fp32.
    """
    chunk = _check_linear(hidden, weight, bias, labels, chunk_size)
    cfg = resolve_loss_config(config, overrides)
    check_token_inputs(hidden.shape[0], hidden.device, labels, behav_logprobs, advantages, loss_mask,
                       prox_logprobs, ref_logprobs, cu_seqlens, cfg)
    be = select("ppo_loss", hidden.device, available=AVAILABLE, backend=backend)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if single_pass is None:
        single_pass = cfg.importance_level == "token"
    if single_pass and cfg.importance_level != "token":
        raise ValueError("single_pass=True needs importance_level='token' (sequence-level ratios couple tokens)")
    if single_pass and torch.is_grad_enabled() and any(needs):
        # Gradients in the forward (3 GEMMs); the loss value and stats come from the same
        # per-token function, evaluated on the detached [T] statistics.
        coef = aggregation_weights(loss_mask, cu_seqlens, normalizer, cfg, math_dtype(hidden.dtype), hidden.device)
        # detached inputs: the op has no autograd formula; attach_grads below carries the gradients
        logp, ent, gh, gw, gb = custom_ops.fused_linear_ppo_single_pass(
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), labels, behav_logprobs,
            advantages, loss_mask, prox_logprobs, ref_logprobs, coef, cfg, chunk, be, *needs, cu_seqlens=cu_seqlens)
        with torch.no_grad():
            loss, stats = ppo_objective(logp, ent, behav_logprobs, advantages, loss_mask, prox=prox_logprobs,
                                        ref=ref_logprobs, cu_seqlens=cu_seqlens, normalizer=normalizer, cfg=cfg)
        loss = torch.ops.areal_fast.attach_grads(loss, hidden, weight, bias, gh, gw, gb)
        return PPOLossOutput(loss=loss, logprobs=logp.float(), entropy=ent.float(), stats=stats)
    logp, ent, _ = torch.ops.areal_fast.fused_linear_token_stats(hidden, weight, bias, labels,
                                                                 float(cfg.temperature), chunk, be)
    loss, stats = ppo_objective(logp, ent, behav_logprobs, advantages, loss_mask, prox=prox_logprobs,
                                ref=ref_logprobs, cu_seqlens=cu_seqlens, normalizer=normalizer, cfg=cfg)
    return PPOLossOutput(loss=loss, logprobs=logp.detach().float(), entropy=ent.detach().float(), stats=stats)


def fused_linear_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                                temperature: float = 1.0, return_entropy: bool = False,
                                chunk_size: int | None = None, backend: str | None = None):
    """:func:`areal_fast.ops.token_logprobs` of ``hidden @ weight.T (+ bias)``, chunked, no grad."""
    chunk = _check_linear(hidden, weight, bias, labels, chunk_size)
    temperature = PPOLossConfig(temperature=temperature).temperature  # the loss's own check
    be = select("ppo_loss", hidden.device, available=AVAILABLE, backend=backend)
    with torch.no_grad():
        logp, ent, _ = torch.ops.areal_fast.fused_linear_token_stats(hidden, weight, bias, labels,
                                                                     float(temperature), chunk, be)
    logp, ent = logp.float(), ent.float()  # fp32 [T] like token_logprobs (fp64 inputs compute in fp64)
    return (logp, ent) if return_entropy else logp
