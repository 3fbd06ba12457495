"""What the trainer's parallelism costs: collectives counted as they run, parameter memory per rank,
and the computed figures for a large model (``docs/parallelism.md``; ``bench/bench_parallel_cost.py``).

:class:`CollectiveCounter` wraps ``torch.distributed``'s collectives (the functions FSDP2, the actor,
the expert and context all-to-alls call through the module) and records, per call, the bytes this
rank sends under the usual algorithms: ring all-gather ``(n-1) x input``, ring reduce-scatter
``(n-1)/n x input``, ring all-reduce ``2 (n-1)/n x bytes``, all-to-all the rows addressed to the other
ranks (exact, from the splits), broadcast from the root ``bytes``, gather to the root ``bytes`` from
every other rank.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

_WRAPPED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
            "all_reduce", "all_to_all_single", "broadcast", "gather")


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def sent_bytes(op: str, n: int, rank_in_group: int, out, inp, kwargs) -> int:
    """Bytes this rank sends for one collective of ``n`` ranks (module docstring's algorithms)."""
    if n <= 1:
        return 0
    if op in ("all_gather_single", "all_gather_into_tensor"):
        return (n - 1) * _nbytes(inp)
    if op in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return (n - 1) * _nbytes(inp) // n
    if op == "all_reduce":
        return 2 * (n - 1) * _nbytes(out) // n
    if op == "all_to_all_single":
        splits = kwargs.get("input_split_sizes")
        row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else inp.element_size()
        if not splits:
            return _nbytes(inp) * (n - 1) // n
        return sum(s for i, s in enumerate(splits) if i != rank_in_group) * row
    if op in ("broadcast", "gather"):
        return _nbytes(out)
    return 0


class CollectiveCounter(contextlib.AbstractContextManager):
    """Within the block, every collective of ``_WRAPPED`` this process calls is counted by kind:
    ``calls[kind]``, ``sent[kind]`` (bytes this rank sends). ``kind`` is the op, and with ``label``
    ``"<op>:<label(group)>"`` (e.g. which mesh group carried it)."""

    def __init__(self, label=None):
        self.calls: dict[str, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)
        self._label = label
        self._saved: dict = {}

    def _wrap(self, op, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            me = dist.get_rank(group)
            if op in ("all_reduce", "broadcast"):
                out = inp = args[0] if args else kwargs.get("tensor")
            elif op == "gather":
                out = inp = args[0] if args else kwargs.get("tensor")
            else:
                out = args[0] if args else kwargs.get("output")
                inp = args[1] if len(args) > 1 else kwargs.get("input")
            kw = dict(kwargs)
            if op == "all_to_all_single" and len(args) > 3:
                kw.setdefault("input_split_sizes", args[3])
            if op == "broadcast":
                src = args[1] if len(args) > 1 else kwargs.get("src", 0)
                sent = _nbytes(out) if dist.get_rank() == src else 0
            elif op == "gather":
                dst = args[2] if len(args) > 2 else kwargs.get("dst", 0)
                sent = 0 if dist.get_rank() == dst else _nbytes(out)
            else:
                sent = sent_bytes(op, n, me, out, inp, kw)
            kind = op if self._label is None else f"{op}:{self._label(group)}"
            self.calls[kind] += 1
            self.sent[kind] += sent
            return fn(*args, **kwargs)

        return counted

    def __enter__(self):
        for op in _WRAPPED:
            fn = getattr(dist, op, None)
            if fn is not None:
                self._saved[op] = fn
                setattr(dist, op, self._wrap(op, fn))
        return self

    def __exit__(self, *exc):
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved.clear()
        return None

    def total(self, prefix: str = "") -> int:
        return sum(v for k, v in self.sent.items() if k.startswith(prefix))


def param_bytes_per_rank(model: torch.nn.Module) -> dict[str, int]:
    """This rank's parameter bytes: ``experts`` (fused expert tensors, FSDP2 shards or this rank's
    experts) and ``dense`` (the rest)."""
    out = {"dense": 0, "experts": 0}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out["experts" if ".experts." in name else "dense"] += _nbytes(local)
    return out


# ---------------------------------------------------------------- computed, for a large model
QWEN3_30B_A3B = dict(
    # config.json of Qwen/Qwen3-30B-A3B
    hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_inter=768,
    vocab=151936, tie=False,
)


def moe_param_counts(m: dict) -> dict[str, int]:
    """Parameters of a Qwen3-MoE config ``m``: ``experts`` (all layers), ``dense`` (attention, norms,
    routers, embeddings, head)."""
    h, L = m["hidden"], m["layers"]
    attn = h * m["heads"] * m["head_dim"] * 2 + h * m["kv_heads"] * m["head_dim"] * 2 + 2 * m["head_dim"]
    router = m["experts"] * h
    experts = m["experts"] * 3 * h * m["moe_inter"]
    dense = L * (attn + router + 2 * h) + m["vocab"] * h * (1 if m["tie"] else 2) + h
    return {"dense": dense, "experts": L * experts}


def computed_step(m: dict, *, world: int, ep: int, tokens_per_rank: int, link_bytes_s: float,
                  micro_batches: int = 1, param_bytes: int = 2, grad_bytes: int = 4, act_bytes: int = 2,
                  recompute: bool = True) -> dict:
    """Per rank and step (``tokens_per_rank`` tokens in ``micro_batches`` micro-batches, each with a
    proximal recompute forward, the loss forward and the backward; one optimizer step): parameter bytes
    held and bytes sent by each collective, computed.
    Assumptions (named in docs/parallelism.md): FSDP2 gathers each block's parameters in ``param_bytes``
    once per forward and again in the backward (reshard after forward), reduce-scatters fp32 gradients
    once; expert parallelism keeps ``E/ep`` experts whole per rank, replicated over world/ep ranks (an
    fp32 all-reduce of their gradients), and sends each token's hidden state ``top_k`` times there and
    back per MoE layer and pass (uniform routing: ``(ep-1)/ep`` of the copies leave the rank);
    ``link_bytes_s``: the per-rank bandwidth of the slowest link the collective crosses."""
    p = moe_param_counts(m)
    L, h, k = m["layers"], m["hidden"], m["top_k"]
    forwards = 2 if recompute else 1
    gathers = micro_batches * (forwards + 1)  # each forward of each micro-batch, and the backward's re-gather
    n = world
    out = {"world": world, "ep": ep, "tokens_per_rank": tokens_per_rank, "micro_batches": micro_batches}
    if ep == 1:
        held = (p["dense"] + p["experts"]) * 4 / n
        ag = gathers * (n - 1) / n * (p["dense"] + p["experts"]) * param_bytes
        rs = (n - 1) / n * (p["dense"] + p["experts"]) * grad_bytes
        a2a = 0.0
        ar = 0.0
    else:
        held = p["dense"] * 4 / n + p["experts"] * 4 / ep
        ag = gathers * (n - 1) / n * p["dense"] * param_bytes
        rs = (n - 1) / n * p["dense"] * grad_bytes
        rep = n // ep
        ar = 2 * (rep - 1) / rep * p["experts"] / ep * grad_bytes if rep > 1 else 0.0
        # dispatch + combine, in every forward and (as gradients) in the backward
        a2a = (forwards + 1) * 2 * L * tokens_per_rank * k * (ep - 1) / ep * h * act_bytes
    out.update(param_bytes_held=held, all_gather=ag, reduce_scatter=rs, expert_grad_all_reduce=ar, all_to_all=a2a)
    total = ag + rs + ar + a2a
    out.update(sent_total=total, comm_seconds=total / link_bytes_s)
    return out
