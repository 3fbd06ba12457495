"""Context parallelism (Ulysses) over packed varlen micro-batches.

The ``cp`` ranks of a context-parallel group pack the same micro-batch and each keeps ``1 / cp``
of its tokens (:func:`areal_fast.packing.context_split`: equal contiguous shares of the row padded
to a multiple of ``cp``). Everything outside attention is per token, so it runs on the share: the
embeddings, the norms, the MLP or the experts, the LM head and the fused loss, the recomputed
log-probs and the per-token statistics. Each token is on exactly one rank, so sums over the
group's ranks (the loss, its normaliser, the statistics, the gradients FSDP2 reduces) count it once.
The labels need no exchange: the batch holds them shifted per sequence (position ``t`` predicts
token ``t + 1``), so the label of a share's last token is already the first token of the next share.

Attention needs whole sequences. Around it (:func:`ulysses_attention`) one all-to-all turns the
sequence shares of the projected query, key and value ``[T / cp, heads, d]`` into head shares
``[T, heads / cp, d]`` (every token of ``heads / cp`` heads), the varlen kernel runs over the
boundaries of the whole padded row, and the inverse all-to-all brings the output back to sequence
shares. The all-to-all is an autograd function whose backward is the inverse all-to-all, so the
gradients reach the rank that holds each token.

Grouped-query attention: the key/value heads are split like the query heads when ``cp`` divides
their count; otherwise (Qwen3-30B-A3B has 4 key/value heads, a CP degree of 8 does not divide
them) each key/value head is repeated ``lcm(Hkv, cp) / Hkv`` times on the share before the
all-to-all, which keeps query head ``h`` reading its key/value head ``h // (Hq / Hkv)``; the
repeat's backward sums the copies' gradients. The query heads must divide by ``cp``.

The group is handed to the attention layers by :func:`ulysses` (a context manager around the
forward and, with activation checkpointing, the backward, where the blocks run again).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from areal_fast.packing import ContextSplit, context_split
from areal_fast.trainer.batch import Packed

_active: dict = {"group": None}


@contextlib.contextmanager
def ulysses(group):
    """Attention layers run Ulysses over ``group`` inside the block (None or a group of one: plain)."""
    if group is not None and group.size() == 1:
        group = None
    old = _active["group"]
    _active["group"] = group
    try:
        yield
    finally:
        _active["group"] = old


def active_group():
    """The context-parallel group of the enclosing :func:`ulysses` block, None outside one."""
    return _active["group"]


# ----------------------------------------------------------------------------- the all-to-all
# Layouts. A rank's sequence share is x [Tl, H, d]; the send buffer of the forward all-to-all is
# [cp, Tl, H / cp, d] (chunk j: the heads of rank j); the received buffer [cp, Tl, H / cp, d]
# holds chunk i = rank i's tokens of my heads, which is [T, H / cp, d] in row order.
def seq_to_head_send(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[Tl, H, d] -> the send buffer [cp, Tl, H / cp, d] (contiguous)."""
    t, h, d = x.shape
    if h % cp:
        raise ValueError(f"Ulysses: {h} heads do not divide by the context-parallel degree {cp}")
    return x.reshape(t, cp, h // cp, d).transpose(0, 1).contiguous()


def seq_to_head_recv(buf: torch.Tensor) -> torch.Tensor:
    """The received buffer [cp, Tl, h, d] -> [cp * Tl, h, d] (every token of my heads)."""
    cp, t, h, d = buf.shape
    return buf.reshape(cp * t, h, d)


def head_to_seq_send(y: torch.Tensor, cp: int) -> torch.Tensor:
    """[T, h, d] -> the send buffer [cp, T / cp, h, d] (chunk i: rank i's tokens)."""
    t, h, d = y.shape
    return y.reshape(cp, t // cp, h, d).contiguous()


def head_to_seq_recv(buf: torch.Tensor) -> torch.Tensor:
    """The received buffer [cp, Tl, h, d] (chunk j: rank j's heads of my tokens) -> [Tl, cp * h, d]."""
    cp, t, h, d = buf.shape
    return buf.transpose(0, 1).reshape(t, cp * h, d)


def exchange(buf: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` over ``group``: chunk ``j`` of dim 0 goes to the group's rank ``j``;
    chunk ``i`` of the result came from rank ``i``."""
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf.contiguous(), group=group)
    return out


_exchange = {"fn": exchange}
"""The exchange the all-to-all uses: a test swaps in a simulated one (threads as ranks) or a counting one."""


class _AllToAll(torch.autograd.Function):
    """Sequence shares <-> head shares; the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, not ctx.to_heads), None, None


def _all_to_all(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    cp = group.size()
    swap = _exchange["fn"]
    if to_heads:
        return seq_to_head_recv(swap(seq_to_head_send(x, cp), group))
    return head_to_seq_recv(swap(head_to_seq_send(x, cp), group))


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """[T / cp, H, d] sequence share -> [T, H / cp, d] head share (differentiable)."""
    return _AllToAll.apply(x, group, True)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """[T, H / cp, d] head share -> [T / cp, H, d] sequence share (differentiable)."""
    return _AllToAll.apply(y, group, False)


def kv_repeat(n_heads: int, n_kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated before the all-to-all so that ``cp`` divides
    them (1 when it already does); refuses query heads ``cp`` does not divide."""
    if n_heads % cp:
        raise ValueError(f"context parallelism: the degree {cp} does not divide the {n_heads} attention heads "
                         f"(Ulysses gives each rank heads / cp whole heads)")
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise ValueError(f"context parallelism: {n_heads} query heads are not a multiple of {n_kv_heads} "
                         f"key/value heads")
    return math.lcm(n_kv_heads, cp) // n_kv_heads


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Callable, group) -> torch.Tensor:
    """Attention of a sequence share: q [Tl, Hq, d], k/v [Tl, Hkv, d] -> [Tl, Hq, d].

    ``kernel(q, k, v)`` attends over the whole (padded) row with ``Hq / cp`` query heads; query,
    key and value travel in one all-to-all (their head chunks side by side), the output in another."""
    cp = group.size()
    hq, hkv = q.shape[1], k.shape[1]
    r = kv_repeat(hq, hkv, cp)
    if r > 1:
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    hk = k.shape[1]
    t, d = q.shape[0], q.shape[2]
    # [Tl, cp, heads / cp, d] each, side by side: chunk j of the exchange carries rank j's q, k and v heads
    qkv = torch.cat([x.reshape(t, cp, x.shape[1] // cp, d) for x in (q, k, v)], dim=2)
    full = seq_to_head(qkv.reshape(t, -1, d), group)  # [T, (hq + 2 hk) / cp, d]
    qh, kh, vh = full.split([hq // cp, hk // cp, hk // cp], dim=1)
    out = kernel(qh, kh, vh)  # [T, hq / cp, d]
    return head_to_seq(out, group)


# ----------------------------------------------------------------------------- the micro-batch's shares
def split_packed(p: Packed, cp: int) -> ContextSplit:
    """The cut of ``p``'s row over ``cp`` ranks."""
    return context_split((p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist(), cp)


def shard_packed(p: Packed, cut: ContextSplit, rank: int) -> Packed:
    """Rank ``rank``'s share of the packed micro-batch ``p`` (every per-token field cut alike, the
    padding out of the loss): ``cu_seqlens``/``max_seqlen`` are the pieces of sequences it holds (the
    loss's and the statistics'), ``attn_cu_seqlens``/``attn_max_seqlen`` the whole padded row's."""
    lo, hi = cut.bounds(rank)
    pad = cut.pad

    def take(x, fill):
        if x is None:
            return None
        if pad:
            x = torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)])
        return x[lo:hi]

    dev = p.input_ids.device
    pos = p.position_ids
    if pad:  # the padding sequence's own positions
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)])
    local = torch.as_tensor(cut.local_cu_seqlens(rank), dtype=torch.int32)
    return Packed(
        index=list(p.index),
        input_ids=take(p.input_ids, 0),
        position_ids=pos[lo:hi],
        cu_seqlens=local.to(dev),
        max_seqlen=int(local.diff().max()),
        labels=take(p.labels, 0),
        loss_mask=take(p.loss_mask, False),
        behav_logprobs=take(p.behav_logprobs, 0.0),
        versions=take(p.versions, -1),
        advantages=take(p.advantages, 0.0),
        prox_logprobs=take(p.prox_logprobs, 0.0),
        ref_logprobs=take(p.ref_logprobs, 0.0),
        routing=take(p.routing, -1),
        attn_cu_seqlens=torch.as_tensor(cut.cu_seqlens, dtype=torch.int32).to(dev),
        attn_max_seqlen=cut.max_seqlen,
        n_pad=max(0, min(hi, cut.padded) - max(lo, cut.tokens)),
    )


def gather_tokens(x: torch.Tensor, cut: ContextSplit, group) -> torch.Tensor:
    """Every rank's share of a per-token tensor ``x`` [share, ...] -> the whole row [T, ...] (no padding)."""
    if group is None or cut.cp == 1:
        return x[: cut.tokens]
    parts = [torch.empty_like(x) for _ in range(cut.cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)[: cut.tokens]


# ----------------------------------------------------------------------------- computed cost
def computed_cp_step(m: dict, *, cp: int, tokens_per_rank: int, link_bytes_s: float, act_bytes: int = 2,
                     recompute: bool = True) -> dict:
    """Per rank and step, computed for a transformer config ``m`` (``layers``, ``heads``, ``kv_heads``,
    ``head_dim``, ``hidden``; cost.py's ``QWEN3_30B_A3B``) under context parallelism ``cp``: each rank
    holds ``tokens_per_rank`` tokens of a micro-batch of ``cp * tokens_per_rank`` (the longest
    sequence it can hold). Counted per pass (the proximal recompute's forward with ``recompute``, the
    loss's forward, the backward) and layer: the query/key/value exchange (key/value heads repeated to
    ``lcm(kv_heads, cp)``) and the output's, in ``act_bytes``; ``(cp - 1) / cp`` of each leaves the rank.
    The attention FLOPs a rank computes (causal, one sequence filling the micro-batch: forward
    ``4 d S^2 / 2`` a head, the backward twice that) grow with that sequence, ``cp`` times the
    data-parallel rank's at the same tokens a rank. The FSDP2 traffic does not depend on ``cp``
    (the same parameters, the same world)."""
    L, hq, hkv, d = m["layers"], m["heads"], m["kv_heads"], m["head_dim"]
    hk = hkv * kv_repeat(hq, hkv, cp)
    passes = (2 if recompute else 1) + 1
    share = (cp - 1) / cp
    qkv = tokens_per_rank * (hq + 2 * hk) * d * act_bytes * share
    out = tokens_per_rank * hq * d * act_bytes * share
    a2a = passes * L * (qkv + out)
    seq = cp * tokens_per_rank
    attn_fwd = 2 * L * hq * d * seq * seq / cp  # 4 d S^2 / 2 per head, H / cp heads a rank
    attn_flops = attn_fwd * (passes - 1 + 2)  # every forward, and the backward at twice the forward
    return {"cp": cp, "tokens_per_rank": tokens_per_rank, "longest_sequence": seq, "kv_heads_exchanged": hk,
            "all_to_all": a2a, "all_to_all_calls": 2 * passes * L if cp > 1 else 0,
            "all_to_all_seconds": a2a / link_bytes_s,
            "attention_flops": attn_flops}
