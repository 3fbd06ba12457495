"""Fused RL loss ops: the decoupled-PPO objective of ``docs/objective.md``.

Public API::

    decoupled_ppo_loss(logits, labels, behav_logprobs, advantages, loss_mask, *,
                       config=PPOLossConfig(...), **overrides) -> PPOLossOutput
    fused_linear_decoupled_ppo_loss(hidden, weight, labels, behav_logprobs, advantages, loss_mask, *,
                                    bias=None, chunk_size=None, config=None, **overrides) -> PPOLossOutput
    token_logprobs(logits, labels, *, temperature=1.0, return_entropy=False)
    fused_linear_token_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0,
                                return_entropy=False, chunk_size=None)

and their pure-PyTorch references ``*_ref`` (same arguments). The objective's options travel as
one :class:`PPOLossConfig` value (``config=``); keyword overrides replace single options, so
``decoupled_ppo_loss(..., eps_clip=0.3)`` works without building a config. Other keywords:
``prox_logprobs``, ``ref_logprobs``, ``cu_seqlens``, ``normalizer``; ``backend=`` ('triton' |
'interpret' | 'reference' | None = ``areal_fast.dispatch.select``) on all four, ``grad_inplace=`` on
``decoupled_ppo_loss`` (write dloss/dlogits into the logits buffer) and ``single_pass=`` on
``fused_linear_decoupled_ppo_loss`` (gradients during the forward; default on for token-level
importance). The objective itself (``objective.ppo_objective``) is plain PyTorch on [T] vectors, shared by
every backend. Importing this package does not import Triton; ``areal_fast.ops.loss_config``
does not import torch.
"""

from __future__ import annotations

from areal_fast._lazy import lazy_exports

# name -> submodule; loaded on first use, so that ``areal_fast.ops.loss_config`` (and the trainer's
# config, which holds a PPOLossConfig) can be imported without importing torch
_EXPORTS = {
    "PPOLossConfig": "loss_config",
    "resolve_loss_config": "loss_config",
    "LOG_RATIO_CLAMP": "objective",
    "STAT_NAMES": "objective",
    "ppo_objective": "objective",
    "mismatch_stats": "objective",
    "PPOLossOutput": "types",
    "decoupled_ppo_loss": "ppo_loss",
    "token_logprobs": "ppo_loss",
    "default_chunk_size": "fused_linear",
    "fused_linear_decoupled_ppo_loss": "fused_linear",
    "fused_linear_token_logprobs": "fused_linear",
    "fused_linear_grad_path": "fused_linear",
    "decoupled_ppo_loss_ref": "ppo_loss_ref",
    "fused_linear_decoupled_ppo_loss_ref": "ppo_loss_ref",
    "fused_linear_token_logprobs_ref": "ppo_loss_ref",
    "token_logprobs_ref": "ppo_loss_ref",
    "token_stats_ref": "ppo_loss_ref",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
