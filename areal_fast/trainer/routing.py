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
import json
import types
from pathlib import Path

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


def routing_width(model_dir: str | Path) -> int:
    """Expert ids a position of the routing record holds for the model in ``model_dir``: sparse blocks
    x experts per token, from its ``config.json`` (Qwen2-MoE / Qwen3-MoE keys: ``num_experts`` or
    ``num_local_experts``, ``num_experts_per_tok``, ``decoder_sparse_step``, ``mlp_only_layers``). ValueError naming the
    directory for a dense model or a config without those keys."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"routing: cannot read {path}: {e}") from None
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers 5 writes the latter
    top_k = cfg.get("num_experts_per_tok") or 0
    if not experts or not top_k:
        raise ValueError(f"routing: {path} describes no mixture-of-experts model (model_type "
                         f"{cfg.get('model_type')!r}, no num_experts / num_experts_per_tok): nothing is routed")
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    sparse = sum(1 for i in range(int(cfg["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)
    return sparse * int(top_k)


def replay_indices(model: nn.Module, rows: torch.Tensor) -> list[torch.Tensor]:
    """The per-router indices of :func:`replay_routing` from packed routing rows ``[tokens, layers x
    top_k]`` (the record's layout: block by block, top-k ids each); ValueError when the width is not
    this model's routers x top-k."""
    rs = routers(model)
    top_k = int(rs[0].top_k) if rs else 0
    if not rs or rows.shape[-1] != len(rs) * top_k:
        raise ValueError(f"routing replay: the record has {rows.shape[-1]} expert ids a position, this model "
                         f"routes {len(rs)} blocks x top {top_k}")
    per = rows.view(rows.shape[0], len(rs), top_k).long()
    return [per[:, k] for k in range(len(rs))]

