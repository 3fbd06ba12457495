"""Public decoupled-PPO loss from logits, and log-probs from logits.

The [T, V] work (log-softmax statistics and dloss/dlogits) is the custom op
``areal_fast::ppo_token_stats`` (Triton kernels on GPU; see ``custom_ops.py``); the objective
itself is the [T]-sized PyTorch code of ``objective.py``, identical for every backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from areal_fast.dispatch import select

from . import custom_ops  # noqa: F401  (registers torch.ops.areal_fast.*)
from .loss_config import PPOLossConfig, resolve_loss_config
from .objective import check_token_inputs, ppo_objective
from .types import PPOLossOutput

AVAILABLE = ("triton", "interpret", "reference")


def _check_logits(logits: Tensor, labels: Tensor) -> Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V] (tokens packed along T), got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"labels must have shape [{logits.shape[0]}], got {tuple(labels.shape)}")
    if labels.device != logits.device or labels.dtype.is_floating_point:
        raise ValueError(f"labels must be an integer tensor on {logits.device}, got {labels.dtype} on {labels.device}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits


def decoupled_ppo_loss(
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
    normalizer: float | Tensor | None = None,
    grad_inplace: bool = False,
    backend: str | None = None,
    **overrides,
) -> PPOLossOutput:
    """Decoupled-PPO loss (``docs/objective.md``) from packed logits [T, V].

    Row t of ``logits`` scores ``labels[t]`` (already shifted). Per-token inputs are [T]
    (``behav_logprobs``, ``advantages``, ``loss_mask``, optional ``prox_logprobs`` - None means
    standard PPO, p = b - and ``ref_logprobs`` for the KL term). ``cu_seqlens`` ([S+1], int) is
    needed for ``importance_level="sequence"`` and ``loss_agg="seq-mean-token-mean"``.
    ``config``: the objective's options (:class:`PPOLossConfig`, default: all defaults); keyword
    ``overrides`` (e.g. ``eps_clip=0.3``) replace single options of it.
    ``normalizer``: the global number of loss tokens (token-mean) or sequences
    (seq-mean-token-mean) over all micro-batches and ranks; None uses this call's count.

    No fp32 [T, V] tensor is made on the Triton path; the backward writes dloss/dlogits in the
    logits' dtype. ``grad_inplace=True`` writes it into the logits buffer itself (no extra
    memory): only use it when nothing else needs the logits' values after the backward, and on
    a non-leaf buffer (e.g. the output of the lm_head matmul; a leaf's ``.grad`` would alias it).
    Labels outside [0, V) (e.g. -100) must be masked out. ``backend``: 'triton', 'interpret',
    'reference' or None (``areal_fast.dispatch.select``). The math is fp32 for fp32/bf16/fp16 logits
    and fp64 for fp64 logits, whose loss is then fp64 (the Triton kernels are fp32-only: fp64
    logits take the reference formulas on every backend); ``logprobs``/``entropy`` are fp32.
    """
    logits = _check_logits(logits, labels)
    cfg = resolve_loss_config(config, overrides)
    check_token_inputs(logits.shape[0], logits.device, labels, behav_logprobs, advantages, loss_mask,
                       prox_logprobs, ref_logprobs, cu_seqlens, cfg)
    be = select("ppo_loss", logits.device, available=AVAILABLE, backend=backend)
    logp, ent, _ = torch.ops.areal_fast.ppo_token_stats(logits, labels, float(cfg.temperature), bool(grad_inplace), be)
    loss, stats = ppo_objective(logp, ent, behav_logprobs, advantages, loss_mask, prox=prox_logprobs,
                                ref=ref_logprobs, cu_seqlens=cu_seqlens, normalizer=normalizer, cfg=cfg)
    return PPOLossOutput(loss=loss, logprobs=logp.detach().float(), entropy=ent.detach().float(), stats=stats)


def token_logprobs(logits: Tensor, labels: Tensor, *, temperature: float = 1.0, return_entropy: bool = False,
                   backend: str | None = None):
    """log softmax(logits / temperature)[t, labels[t]] as fp32 [T], without gradient.

    With ``return_entropy`` returns ``(logprobs, entropy)``. Used to recompute the proximal and
    reference log-probs; same numerics as the loss. Labels outside [0, V) give 0.
    """
    logits = _check_logits(logits, labels)
    temperature = PPOLossConfig(temperature=temperature).temperature  # the loss's own check
    be = select("ppo_loss", logits.device, available=AVAILABLE, backend=backend)
    with torch.no_grad():
        logp, ent, _ = torch.ops.areal_fast.ppo_token_stats(logits, labels, float(temperature), False, be)
    logp, ent = logp.float(), ent.float()  # fp32 [T] (fp64 logits are computed in fp64, then rounded)
    return (logp, ent) if return_entropy else logp
