"""Routing of MoE models: record the experts each token was routed to, and replay a recorded routing.

The building blocks of routing replay (docs/moe.md): the server records the top-k experts of every
token in every sparse block while it generates; the trainer's forward then uses those experts
instead of its own top-k, so a router logit that differs by a rounding error cannot send a token
through other experts than the ones that produced its behaviour log-prob. The routing weights stay
the trainer's own (softmax of its router logits at the replayed experts, renormalised as the model
does), so the router still learns through them; only the selection is fixed.

Works on transformers' top-k routers (``Qwen3MoeTopKRouter`` and the routers that share its
interface: ``forward(hidden) -> (logits, weights, indices)``, attributes ``top_k``,
``num_experts``, ``norm_topk_prob``, ``weight``).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model`` in forward order (one per sparse block)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


@contextlib.contextmanager
def record_routing(model: nn.Module):
    """Within the block, every forward appends each router's chosen experts (``[tokens, top_k]``
    int64, in the order the router saw the tokens) to ``out[layer]``; yields ``out``."""
    rs = routers(model)
    out: list[list[torch.Tensor]] = [[] for _ in rs]
    hooks = [r.register_forward_hook(lambda _m, _i, o, k=k: out[k].append(o[2].detach().clone()))
             for k, r in enumerate(rs)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def _replayed_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    own = torch.topk(probs, self.top_k, dim=-1).indices
    given = self._replay_indices
    if given.shape != own.shape:
        raise ValueError(f"routing replay: {tuple(given.shape)} recorded experts for {tuple(own.shape)} "
                         "routed ones in this forward")
    # rows recorded as -1 (not recorded: e.g. the last sampled token) are routed by the router itself
    idx = torch.where((given >= 0).all(-1, keepdim=True), given.to(own.device), own)
    weights = probs.gather(-1, idx)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), idx


@contextlib.contextmanager
def replay_routing(model: nn.Module, indices: list[torch.Tensor]):
    """Within the block, router ``k`` routes the tokens of the next forward(s) to ``indices[k]``
    (``[tokens, top_k]``, the tokens in the order the router sees them; a row of -1 is routed by
    the router itself)."""
    rs = routers(model)
    if len(indices) != len(rs):
        raise ValueError(f"routing replay: {len(indices)} recorded layers for {len(rs)} routers")
    try:
        for r, idx in zip(rs, indices):
            r._replay_indices = idx
            r.forward = types.MethodType(_replayed_forward, r)
        yield
    finally:
        for r in rs:
            r.__dict__.pop("forward", None)
            r.__dict__.pop("_replay_indices", None)
