"""Pure-PyTorch references of the decoupled-PPO ops (fp32 math, plain autograd).

They materialise fp32 [T, V] tensors (softmax, log-softmax), so they are only for tests, CPU
runs and as the baseline of ``bench/bench_ppo_loss.py``. Inputs in fp64 stay fp64 (for
gradcheck). Labels outside [0, V) (e.g. -100 on prompt tokens) get log-prob 0 and no gradient;
such tokens must be masked out of the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .loss_config import PPOLossConfig, resolve_loss_config
from .objective import check_token_inputs, ppo_objective
from .types import PPOLossOutput


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss computes in: fp64 for fp64 inputs (gradchecks), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_stats_ref(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """(log P[y], entropy, log-sum-exp of logits / temperature) per row, differentiable, in
    :func:`math_dtype`. Also the forward of the custom ops' 'reference' backend (row chunks)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got {tuple(logits.shape)}")
    V = logits.shape[1]
    x = logits.to(math_dtype(logits.dtype)) / temperature
    lse = torch.logsumexp(x, dim=-1)
    logP = x - lse[:, None]
    P = logP.exp()
    # P log P is 0 where P == 0 (logits of -inf), not NaN; log P is zeroed there *before* the
    # product so that the backward does not form -inf * 0 either.
    ent = -(P * torch.where(P > 0, logP, torch.zeros_like(logP))).sum(-1)
    valid = (labels >= 0) & (labels < V)
    lab = torch.where(valid, labels, torch.zeros_like(labels)).long()
    logp = logP.gather(1, lab[:, None])[:, 0]
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    return logp, ent, lse


def token_stats_ref(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(log P[y], entropy) per row, differentiable, in fp32 (fp64 for fp64 logits)."""
    logp, ent, _ = row_stats_ref(logits, labels, temperature)
    return logp, ent


def token_logprobs_ref(logits: Tensor, labels: Tensor, *, temperature: float = 1.0, return_entropy: bool = False):
    """Reference of :func:`areal_fast.ops.token_logprobs` (no grad)."""
    temperature = PPOLossConfig(temperature=temperature).temperature  # the loss's own check
    with torch.no_grad():
        logp, ent = token_stats_ref(logits, labels, temperature)
    logp, ent = logp.float(), ent.float()
    return (logp, ent) if return_entropy else logp


def decoupled_ppo_loss_ref(
    logits: Tensor,
    labels: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    prox_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    config: PPOLossConfig | None = None,
    normalizer=None,
    **overrides,
) -> PPOLossOutput:
    """Reference of :func:`areal_fast.ops.decoupled_ppo_loss` (same ``config`` and keyword overrides)."""
    cfg = resolve_loss_config(config, overrides)
    check_token_inputs(logits.shape[0], logits.device, labels, behav_logprobs, advantages, loss_mask,
                       prox_logprobs, ref_logprobs, cu_seqlens, cfg)
    logp, ent = token_stats_ref(logits, labels, cfg.temperature)
    loss, stats = ppo_objective(logp, ent, behav_logprobs, advantages, loss_mask, prox=prox_logprobs,
                                ref=ref_logprobs, cu_seqlens=cu_seqlens, normalizer=normalizer, cfg=cfg)
    return PPOLossOutput(loss=loss, logprobs=logp.detach().float(), entropy=ent.detach().float(), stats=stats)


def _linear_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(hidden, weight, bias)


def fused_linear_decoupled_ppo_loss_ref(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    **kwargs,
) -> PPOLossOutput:
    """Reference of the fused-linear loss: materialise ``hidden @ weight.T`` and call the reference."""
    del chunk_size  # the reference does not chunk
    return decoupled_ppo_loss_ref(_linear_logits(hidden, weight, bias), labels, behav_logprobs, advantages,
                                  loss_mask, **kwargs)


def fused_linear_token_logprobs_ref(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                                    temperature: float = 1.0, return_entropy: bool = False,
                                    chunk_size: int | None = None):
    """Reference of :func:`areal_fast.ops.fused_linear_token_logprobs`."""
    del chunk_size
    with torch.no_grad():
        logits = _linear_logits(hidden, weight, bias)
    return token_logprobs_ref(logits, labels, temperature=temperature, return_entropy=return_entropy)
