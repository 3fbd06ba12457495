"""Result type of the decoupled-PPO loss ops."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class PPOLossOutput(NamedTuple):
    """What :func:`areal_fast.ops.decoupled_ppo_loss` returns.

    ``loss``: 0-dim, differentiable. ``logprobs``/``entropy``: [T] fp32, detached (for logging
    and reuse, e.g. as the proximal log-probs of the next step). ``stats``: dict of 0-dim fp32
    detached tensors named in ``docs/objective.md`` (see ``objective.STAT_NAMES``), means over
    the masked tokens of this call; no device sync is made to build them.
    """

    loss: Tensor
    logprobs: Tensor
    entropy: Tensor
    stats: dict[str, Tensor]
