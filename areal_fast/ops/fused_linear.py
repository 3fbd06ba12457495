"""Fused LM head + decoupled-PPO loss: the [T, V] logits are never held whole.

The tokens are processed in chunks of ``chunk_size`` rows: logits of a chunk = h_c @ W^T (+ b),
the loss kernel's statistics on it (forward), and in the backward the chunk's logits are
recomputed, dloss/dlogits is written into them in place, and grad_hidden = dz @ W and
grad_weight += dz^T @ h_c are matmuls. Peak extra memory is one chunk of logits plus an fp32
grad_weight accumulator ([V, H]); the materialised path holds [T, V] logits, their gradient and
fp32 temporaries.

Cost: one forward GEMM and three in the backward (recompute + two gradient GEMMs), i.e.
4/3 of the bare lm_head GEMMs; the recompute is what lets the objective couple tokens
(sequence-level ratios, any normaliser) while keeping memory at one chunk.

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

from areal_fast.backend import select

from . import custom_ops  # noqa: F401  (registers torch.ops.areal_fast.*)
from .ppo_objective import PPOLossConfig, check_token_inputs, ppo_objective
from .types import PPOLossOutput

AVAILABLE = ("triton", "interpret", "reference")
# At least 1024 rows per chunk: [1024, H] @ [H, V] GEMMs run near peak on H100, while smaller
# chunks (Liger's heuristic gives 128 rows at T = 4096, H = 3584, V = 151936) lose efficiency.
MIN_CHUNK = 1024


def default_chunk_size(T: int, H: int, V: int) -> int:
    """Rows per chunk so that a chunk of logits is about the size of ``hidden`` (T * H).

    ``next_pow2(T / ceil(V / H))`` (Liger-Kernel's rule), at least ``MIN_CHUNK``, at most T.
    """
    rows = T / max(1, math.ceil(V / max(H, 1)))
    chunk = 1 << max(0, math.ceil(math.log2(max(rows, 1))))
    return max(1, min(T, max(MIN_CHUNK, chunk)))


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
    T, H = hidden.shape
    if chunk_size is None:
        return default_chunk_size(T, H, weight.shape[0])
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
    temperature: float = 1.0,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = None,
    behav_weight_mode: str = "mask",
    importance_level: str = "token",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    loss_agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    backend: str | None = None,
) -> PPOLossOutput:
    """:func:`areal_fast.ops.decoupled_ppo_loss` of ``logits = hidden @ weight.T (+ bias)``.

    ``hidden`` [T, H] (final hidden states, already shifted like the labels), ``weight`` [V, H]
    the full lm_head weight (see the module docstring for FSDP2), same dtype. Gradients flow to
    hidden, weight and bias. ``chunk_size`` rows per chunk (default: ``default_chunk_size``).
    """
    chunk = _check_linear(hidden, weight, bias, labels, chunk_size)
    cfg = PPOLossConfig(temperature=temperature, eps_clip=eps_clip, eps_clip_higher=eps_clip_higher,
                        dual_clip=dual_clip, behav_weight_cap=behav_weight_cap,
                        behav_weight_mode=behav_weight_mode, importance_level=importance_level, kl_coef=kl_coef,
                        kl_estimator=kl_estimator, entropy_coef=entropy_coef, loss_agg=loss_agg)
    check_token_inputs(hidden.shape[0], hidden.device, labels, behav_logprobs, advantages, loss_mask,
                       prox_logprobs, ref_logprobs, cu_seqlens, cfg)
    be = select("ppo_loss", hidden.device, available=AVAILABLE, override=backend)
    logp, ent, _ = torch.ops.areal_fast.fused_linear_token_stats(hidden, weight, bias, labels, float(temperature),
                                                                 chunk, be)
    loss, stats = ppo_objective(logp, ent, behav_logprobs, advantages, loss_mask, prox=prox_logprobs,
                                ref=ref_logprobs, cu_seqlens=cu_seqlens, normalizer=normalizer, cfg=cfg)
    return PPOLossOutput(loss=loss, logprobs=logp.detach(), entropy=ent.detach(), stats=stats)


def fused_linear_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                                temperature: float = 1.0, return_entropy: bool = False,
                                chunk_size: int | None = None, backend: str | None = None):
    """:func:`areal_fast.ops.token_logprobs` of ``hidden @ weight.T (+ bias)``, chunked, no grad."""
    chunk = _check_linear(hidden, weight, bias, labels, chunk_size)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    be = select("ppo_loss", hidden.device, available=AVAILABLE, override=backend)
    with torch.no_grad():
        logp, ent, _ = torch.ops.areal_fast.fused_linear_token_stats(hidden, weight, bias, labels,
                                                                     float(temperature), chunk, be)
    return (logp, ent) if return_entropy else logp
