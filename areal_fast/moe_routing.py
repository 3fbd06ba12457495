"""Routing of MoE models: record the experts each token was routed to, and replay a recorded routing.

The building blocks of routing replay (docs/moe.md): the server records the top-k experts of every
token in every sparse block while it generates; the trainer's forward then uses those experts
instead of its own top-k, so a router logit that differs by a rounding error cannot send a token
through other experts than the ones that produced its behaviour log-prob. The routing weights stay
the trainer's own (softmax of its router logits at the replayed experts, renormalised as the model
does), so the router still learns through them; only the selection is fixed.

It sits below the rollout layer and the trainer (the embedded engine records with it, the actor
replays with it).

Works on transformers' top-k routers (``Qwen3MoeTopKRouter`` and the routers that share its
interface: ``forward(hidden) -> (logits, weights, indices)``, attributes ``top_k``,
``num_experts``, ``norm_topk_prob``, ``weight``).
"""

from __future__ import annotations

import contextlib
import json
import re
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a module's decoder layer, from its qualified name


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
    self._own_indices = own  # what it would have chosen (routing_agreement compares the two)
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
            r.__dict__.pop("_own_indices", None)


@contextlib.contextmanager
def routing_agreement(model: nn.Module, indices: list[torch.Tensor], out: dict | None = None):
    """Within the block, count the (position, router) pairs of the forward(s) whose recorded experts
    (``indices[k]``, rows of -1 not counted) are not the set the router itself picks, adding to
    ``out`` (``{"differ": n, "recorded": m}``, a new one when None), which it yields. Inside
    :func:`replay_routing` too (then the router's own pick is the one it was told to ignore)."""
    rs = routers(model)
    out = {"differ": 0, "recorded": 0} if out is None else out

    def count(k, module, output):
        own = getattr(module, "_own_indices", None)
        own = output[2] if own is None else own
        given = indices[k].to(own.device)
        if given.shape != own.shape:
            return
        valid = (given >= 0).all(-1)
        differ = (given.sort(-1).values != own.sort(-1).values).any(-1) & valid
        out["differ"] += int(differ.sum())
        out["recorded"] += int(valid.sum())

    hooks = [r.register_forward_hook(lambda m, _i, o, k=k: count(k, m, o)) for k, r in enumerate(rs)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def router_layers(model: nn.Module) -> tuple[int, list[int]]:
    """The model's decoder layer count and the decoder layer of each of its routers (in
    :func:`routers` order): the servers' routing record is indexed by decoder layer, a dense layer's
    row unused. ValueError when the routers cannot be placed."""
    rs = routers(model)
    names = {id(m): n for n, m in model.named_modules()}
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    num_layers = int(getattr(cfg, "num_hidden_layers", len(rs)) or len(rs))
    layer_of = []
    for k, r in enumerate(rs):
        m = _LAYER.search(names.get(id(r), ""))
        layer_of.append(int(m.group(1)) if m else k)
    if len(set(layer_of)) != len(rs) or (rs and max(layer_of) >= num_layers):
        raise ValueError(f"routing: cannot place the {len(rs)} routers in the {num_layers} decoder layers "
                         f"(layers {layer_of})")
    return num_layers, layer_of


def routing_width(model_dir: str | Path) -> int:
    """Expert ids a position of the routing record holds for the model in ``model_dir``: decoder
    layers x experts per token (the servers' layout: a row per decoder layer, dense layers' unused),
    from its ``config.json`` (``num_hidden_layers``, ``num_experts_per_tok``, and ``num_experts`` or
    ``num_local_experts`` to tell a mixture-of-experts model). ValueError naming the file for a
    dense model or a config without those keys."""
    return routing_shape(model_dir)[0]


def routing_shape(model_dir: str | Path) -> tuple[int, int]:
    """``(width, num_experts)`` of the model in ``model_dir``: :func:`routing_width`, and the experts
    of each sparse block (an expert id of the record is below it; the rollout client refuses an
    answer naming another)."""
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
    try:
        return int(cfg["num_hidden_layers"]) * int(top_k), int(experts)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"routing: {path}: no whole num_hidden_layers / num_experts_per_tok / num_experts "
                         f"({type(e).__name__}: {e})") from None


def replay_indices(model: nn.Module, rows: torch.Tensor, device: torch.device | str | None = None
                   ) -> list[torch.Tensor]:
    """The per-router indices of :func:`replay_routing` from packed routing rows ``[tokens, layers x
    top_k]`` (the record's layout: decoder layer by decoder layer, top-k ids each), on ``device``
    (moved once, after the checks, which read ``rows`` where they are: pass them on the CPU);
    ValueError when the width is not this model's decoder layers x top-k, or when an id is outside
    the model's experts (answers are checked where they arrive; this catches rows from anywhere else,
    an old checkpoint's, before an index past the experts reaches a gather: on CUDA a device assert)."""
    rs = routers(model)
    top_k = int(rs[0].top_k) if rs else 0
    num_layers, layer_of = router_layers(model)
    if not rs or rows.shape[-1] != num_layers * top_k:
        raise ValueError(f"routing replay: the record has {rows.shape[-1]} expert ids a position, this model "
                         f"routes {num_layers} decoder layers x top {top_k}")
    experts = min(int(r.num_experts) for r in rs)
    if rows.numel() and (int(rows.max()) >= experts or int(rows.min()) < -1):
        raise ValueError(f"routing replay: the record names expert ids {int(rows.min())}..{int(rows.max())}, "
                         f"outside [0, {experts}) of this model (-1: not recorded)")
    per = (rows if device is None else rows.to(device)).view(rows.shape[0], num_layers, top_k).long()
    return [per[:, layer] for layer in layer_of]

