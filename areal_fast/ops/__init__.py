"""Fused RL loss ops: the decoupled-PPO objective (``shared/spec/decoupled_ppo.md``).

Public API::

    decoupled_ppo_loss(logits, labels, behav_logprobs, advantages, loss_mask, *, ...) -> PPOLossOutput
    fused_linear_decoupled_ppo_loss(hidden, weight, labels, behav_logprobs, advantages, loss_mask, *,
                                    bias=None, chunk_size=None, ...) -> PPOLossOutput
    token_logprobs(logits, labels, *, temperature=1.0, return_entropy=False)
    fused_linear_token_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0,
                                return_entropy=False, chunk_size=None)

and their pure-PyTorch references ``*_ref``. Extra keywords beyond the issue's signatures:
``backend=`` ('triton' | 'interpret' | 'reference' | None = ``areal_fast.backend.select``) on all
four, ``grad_inplace=`` on ``decoupled_ppo_loss`` (write dloss/dlogits into the logits buffer) and
``single_pass=`` on ``fused_linear_decoupled_ppo_loss`` (gradients during the forward; default on
for token-level importance). The objective itself (``ppo_objective``) is plain PyTorch on [T]
vectors, shared by every backend. Importing this package does not import Triton.
"""

from .fused_linear import default_chunk_size, fused_linear_decoupled_ppo_loss, fused_linear_token_logprobs
from .ppo_loss import decoupled_ppo_loss, token_logprobs
from .ppo_loss_ref import (
    decoupled_ppo_loss_ref,
    fused_linear_decoupled_ppo_loss_ref,
    fused_linear_token_logprobs_ref,
    token_logprobs_ref,
    token_stats_ref,
)
from .ppo_objective import LOG_RATIO_CLAMP, STAT_NAMES, PPOLossConfig, ppo_objective
from .types import PPOLossOutput

__all__ = [
    "LOG_RATIO_CLAMP",
    "PPOLossConfig",
    "PPOLossOutput",
    "STAT_NAMES",
    "decoupled_ppo_loss",
    "decoupled_ppo_loss_ref",
    "default_chunk_size",
    "fused_linear_decoupled_ppo_loss",
    "fused_linear_decoupled_ppo_loss_ref",
    "fused_linear_token_logprobs",
    "fused_linear_token_logprobs_ref",
    "ppo_objective",
    "token_logprobs",
    "token_logprobs_ref",
    "token_stats_ref",
]
