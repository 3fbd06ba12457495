"""Many senders: every trainer rank (or one per node) sends a disjoint part of each weight update.

The stock servers take whole tensors in their checkpoint layout (SGLang's ``load_weights``), and a
server's TP workers receive a broadcast from rank 0 of a named group (``src=0`` in every release read,
0.5.6 to 0.5.23), so one group carries one sender. Many senders therefore need one group per sender
(on each server), full tensors on the sender, and a split of the model's tensors over the senders:

* the **wire tensors**: the update's tensors as the servers load them (fused MoE experts cut into
  per-expert tensors, :mod:`areal_fast.weights.experts`), each a contiguous element range of one
  source tensor; each has one **owner** (a sender), chosen once per membership by the largest-first
  rule (:func:`assign_owners`: every sender ends within one tensor of 1/N of the bytes);
* each rank holds a **piece** of every wire tensor (the part of its dim-0 FSDP2 shard that falls in
  the tensor's range, maybe empty); per round, one ``all_to_all_single`` moves every rank's pieces to
  the owners of their tensors, so each sender assembles its buckets of full tensors (about 1/N of the
  update) without a byte crossing rank 0 that rank 0 does not send itself;
* deltas (``weights.delta``) are encoded where the shard lives (:class:`ShardShadow`): each rank keeps
  the sent bytes of its own pieces (1/N of the model per rank), compares its new pieces with them, and
  only the changed (index, value) pairs travel to the owner, which sends ``NAME#delta_idx`` /
  ``NAME#delta_val`` entries bitwise equal to what the rank-0 encoder (:class:`~areal_fast.weights.delta.
  DeltaEncoder`) makes of the full tensor: the same per-tensor choice (nothing, delta or whole, by the
  global count of changes), indices ascending in the tensor's flat order.

This module is the plan and the exchange; the servers' calls and groups live with their API
(``backends/sglang/weight_sync.py``). ``docs/weight_sync.md`` ("Many senders") has the layout, the
bytes and the times.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from areal_fast.weights.delta_codec import MAX_WORDS, WORD_DTYPES, delta_apply, delta_encode
from areal_fast.weights.delta_wire import DELTA_VAL, delta_name
from areal_fast.weights.experts import split_entries as expert_entries
from areal_fast.weights.gather import Bucket, Sources
from areal_fast.weights.plan import (
    BLOCK_COLS,
    DST_IDX,
    DST_OFF,
    LEN,
    ROWS,
    SRC_OFF,
    consecutive_buckets,
    plan_blocks,
    rows_cols,
    shard_rows,
)

__all__ = ["SENDER_MODES", "sender_ranks", "assign_owners", "assign_owners_ref", "WireTensor", "plan_wire",
           "plan_wire_ref", "Entry", "SendBucket", "whole_entries", "delta_entries", "pack_buckets", "Exchange",
           "ShardShadow", "decide"]

SENDER_MODES = ("rank", "node", "one")
WHOLE, DELTA, SKIP = "whole", "delta", "skip"


def sender_ranks(mode: str, world: int, local_world: int | None = None) -> list[int]:
    """The trainer ranks that send: every rank (``rank``), local rank 0 of each node (``node``: nodes of
    ``local_world`` ranks, default ``$LOCAL_WORLD_SIZE``), or rank 0 alone (``one``, today's path)."""
    if mode not in SENDER_MODES:
        raise ValueError(f"weights.senders: {mode!r} is not one of {SENDER_MODES}")
    if mode == "one" or world <= 1:
        return [0]
    if mode == "rank":
        return list(range(world))
    lw = int(local_world or os.environ.get("LOCAL_WORLD_SIZE") or world)
    return list(range(0, world, max(1, lw)))


def assign_owners(nbytes, senders: list[int]) -> list[int]:
    """The sender of each tensor: largest first, each to the sender with the fewest bytes so far (ties:
    the later sender, so rank 0, which also opens and closes the servers' sessions, gets the largest tensor
    only when alone); deterministic, so every rank computes the same. Each sender ends with at most
    ``total / len(senders) + max(nbytes)`` bytes. A heap keeps it O(T log S) (a MoE model at 235B has
    tens of thousands of wire tensors); :func:`assign_owners_ref` is the rule written out."""
    heap = [(0, -k) for k in range(len(senders))]
    heapq.heapify(heap)
    owner = [0] * len(nbytes)
    for t in sorted(range(len(nbytes)), key=lambda i: (-int(nbytes[i]), i)):
        load, neg_k = heapq.heappop(heap)
        owner[t] = senders[-neg_k]
        heapq.heappush(heap, (load + int(nbytes[t]), neg_k))
    return owner


def assign_owners_ref(nbytes, senders: list[int]) -> list[int]:
    """Reference of :func:`assign_owners`: the least-loaded sender (ties: the later) by a linear scan."""
    load = [0] * len(senders)
    owner = [0] * len(nbytes)
    for t in sorted(range(len(nbytes)), key=lambda i: (-int(nbytes[i]), i)):
        s = min(range(len(senders)), key=lambda k: (load[k], -k))
        owner[t] = senders[s]
        load[s] += int(nbytes[t])
    return owner


@dataclass(frozen=True)
class WireTensor:
    """One tensor as the servers load it: elements ``[elem0, elem0 + numel)`` of source tensor ``src``.
    ``segs[r]``: ``(wire offset, offset in rank r's local flat shard, elements)`` or None."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as sent
    src: int
    elem0: int
    numel: int
    owner: int
    segs: tuple

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def piece_elems(self, rank: int) -> int:
        s = self.segs[rank]
        return 0 if s is None else s[2]


def _cut(src: Sources) -> list[tuple]:
    """The wire tensors of ``src``: (source, name, shape, first element, elements)."""
    cut = []
    for t, (name, shape) in enumerate(zip(src.names, src.shapes)):
        for wname, wshape, elem0 in expert_entries(name, shape):
            cut.append((t, wname, tuple(wshape), elem0, math.prod(wshape)))
    return cut


def _blocks(src: Sources, cut: list[tuple]) -> np.ndarray:
    """The planner's blocks (``plan.BLOCK_COLS``) of the wire tensors: a wire tensor is whole rows of its
    source, or a run inside one row (a fused expert's gate or up half); a run that spans rows and starts
    or ends inside one is cut into its head, whole rows and tail, all written to the same wire tensor.
    Element offsets only: every dtype code is ``uint8``'s (the planner then never casts)."""
    out = []
    for w, (t, _name, _shape, elem0, numel) in enumerate(cut):
        if not numel:
            continue
        _rows, cols = rows_cols(src.shapes[t])
        a, b = elem0, elem0 + numel
        while a < b:
            row, col = divmod(a, cols)
            if col or b - a < cols:  # a run inside one row
                n = min(cols - col, b - a)
                out.append((t, row, col, 1, n, w, a - elem0, n, 0))
            else:  # whole rows
                n = (b - a) // cols
                out.append((t, row, 0, n, cols, w, a - elem0, cols, 0))
                n *= cols
            a += n
    return np.asarray(out, dtype=np.int64).reshape(-1, BLOCK_COLS)


def plan_wire(src: Sources, dtypes: list[torch.dtype], n_ranks: int, senders: list[int],
              backend: str | None = None) -> list[WireTensor]:
    """The wire tensors of ``src`` (checkpoint layout), their owners and every rank's piece of each.
    ``src.n_ranks`` 1 (every rank holds full tensors): the owner's piece is the whole tensor.

    Which bytes each rank holds of each wire tensor is asked of the reshard planner
    (:func:`areal_fast.weights.plan.plan_blocks`: the C++ core, or its Python twin by ``backend``), one
    block per wire tensor (a few for a run across rows); the owners come from :func:`assign_owners`.
    :func:`plan_wire_ref` is the same plan computed directly; the two are compared in the tests."""
    cut = _cut(src)
    owners = assign_owners([n * dtypes[t].itemsize for t, _n, _s, _e, n in cut], senders)
    segs: list[list] = [[None] * n_ranks for _ in cut]
    if src.n_ranks == 1:
        for w, ((_t, _n, _s, elem0, numel), owner) in enumerate(zip(cut, owners)):
            if numel:
                segs[w][owner] = (0, elem0, numel)
    else:
        rc = [rows_cols(s) for s in src.shapes]
        per_rank = plan_blocks([r for r, _ in rc], [c for _, c in rc], [0] * len(rc), src.n_ranks,
                               _blocks(src, cut), backend=backend)
        for r, iv in enumerate(per_rank[:n_ranks]):
            for w, src_off, dst_off, length, rows in iv[:, [DST_IDX, SRC_OFF, DST_OFF, LEN, ROWS]].tolist():
                n = length * rows
                prev = segs[w][r]
                if prev is None:
                    segs[w][r] = (dst_off, src_off, n)
                elif prev[0] + prev[2] == dst_off and prev[1] + prev[2] == src_off and rows == 1:
                    segs[w][r] = (prev[0], prev[1], prev[2] + n)  # a run across rows, in its parts
                else:
                    raise AssertionError(f"plan_wire: rank {r}'s piece of {cut[w][1]} is not one run")
    return [WireTensor(wname, wshape, dtypes[t], t, elem0, numel, owner, tuple(sg))
            for (t, wname, wshape, elem0, numel), owner, sg in zip(cut, owners, segs)]


def plan_wire_ref(src: Sources, dtypes: list[torch.dtype], n_ranks: int, senders: list[int]) -> list[WireTensor]:
    """Reference of :func:`plan_wire`: each rank's piece of each wire tensor from its FSDP2 rows directly."""
    cut = _cut(src)
    owners = assign_owners_ref([n * dtypes[t].itemsize for t, _n, _s, _e, n in cut], senders)
    out = []
    for (t, wname, wshape, elem0, numel), owner in zip(cut, owners):
        segs = []
        rows, cols = rows_cols(src.shapes[t])
        for r in range(n_ranks):
            if src.n_ranks == 1:
                segs.append((0, elem0, numel) if r == owner and numel else None)
                continue
            lo, hi = shard_rows(rows, src.n_ranks, r)
            a, b = max(lo * cols, elem0), min(hi * cols, elem0 + numel)
            segs.append((a - elem0, a - lo * cols, b - a) if a < b else None)
        out.append(WireTensor(wname, wshape, dtypes[t], t, elem0, numel, owner, tuple(segs)))
    return out


@dataclass
class Entry:
    """One entry of an update call, assembled on its wire tensor's owner from every rank's piece."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    wire: int  # index into the wire tensors
    part: str  # 'whole', 'idx' or 'val'
    pieces: list[int]  # bytes from each rank, in rank order

    @property
    def nbytes(self) -> int:
        return sum(self.pieces)


@dataclass
class SendBucket:
    """One sender's bucket: entries back to back, widest element first (no padding)."""

    entries: list[Entry]
    offsets: list[int]
    nbytes: int


def _whole_unit(wt: WireTensor, w: int, n_ranks: int) -> list[Entry]:
    """Wire tensor ``w`` sent whole: one entry, each rank's piece of it."""
    return [Entry(wt.name, wt.dtype, wt.shape, w, WHOLE, [wt.piece_elems(r) * wt.dtype.itemsize
                                                         for r in range(n_ranks)])]


def whole_entries(wires: list[WireTensor], n_ranks: int) -> dict[int, list[list[Entry]]]:
    """Per owner, its wire tensors as whole entries (one unit each)."""
    out: dict[int, list[list[Entry]]] = {}
    for w, wt in enumerate(wires):
        out.setdefault(wt.owner, []).append(_whole_unit(wt, w, n_ranks))
    return out


def deltable(wt: WireTensor) -> bool:
    return wt.dtype in WORD_DTYPES and 0 < wt.numel <= MAX_WORDS


def decide(wires: list[WireTensor], counts: np.ndarray, max_changed: float) -> list[str]:
    """Each wire tensor's fate in a delta update, from the changes every rank counted (``counts[r, w]``):
    the rank-0 encoder's rule applied to the whole tensor."""
    total = counts.sum(axis=0)
    out = []
    for w, wt in enumerate(wires):
        if not deltable(wt):
            out.append(WHOLE)
        elif total[w] == 0:
            out.append(SKIP)
        elif total[w] <= math.floor(max_changed * wt.numel):
            out.append(DELTA)
        else:
            out.append(WHOLE)
    return out


def delta_entries(wires: list[WireTensor], fates: list[str], counts: np.ndarray) -> dict[int, list[list[Entry]]]:
    """Per owner, the units of a delta update: whole tensors, and (index, values) pairs."""
    n_ranks = counts.shape[0]
    out: dict[int, list[list[Entry]]] = {}
    for w, (wt, fate) in enumerate(zip(wires, fates)):
        if fate == SKIP:
            continue
        if fate == WHOLE:
            out.setdefault(wt.owner, []).append(_whole_unit(wt, w, n_ranks))
            continue
        c = [int(x) for x in counts[:, w]]
        n = sum(c)
        out.setdefault(wt.owner, []).append([
            Entry(delta_name(wt.name, wt.shape), torch.int32, (n,), w, "idx", [4 * k for k in c]),
            Entry(wt.name + DELTA_VAL, wt.dtype, (n,), w, "val", [wt.dtype.itemsize * k for k in c])])
    return out


def keepalive_unit(wires: list[WireTensor], n_ranks: int) -> list[Entry]:
    """One element of the first 16-bit wire tensor as a delta (its current value: a no-op for the
    servers), for a sender that must send a call (it carries the version and the flush)."""
    for w, wt in enumerate(wires):
        if deltable(wt):
            holder = next(r for r in range(n_ranks) if wt.segs[r] is not None and wt.segs[r][0] == 0)
            one = [1 if r == holder else 0 for r in range(n_ranks)]
            return [Entry(delta_name(wt.name, wt.shape), torch.int32, (1,), w, "keep_idx", [4 * k for k in one]),
                    Entry(wt.name + DELTA_VAL, wt.dtype, (1,), w, "keep_val", [wt.dtype.itemsize * k for k in one])]
    raise ValueError("a delta update with nothing to send needs a 16-bit tensor to carry the version")


def pack_buckets(units: list[list[Entry]], bucket_bytes: int) -> list[SendBucket]:
    """Units (a tensor, or a delta's two entries) in order into buckets of at most ``bucket_bytes`` (a
    larger unit alone); inside a bucket the entries widest element first, back to back."""
    groups = [[e for u in g for e in units[u]]
              for g in consecutive_buckets([sum(e.nbytes for e in unit) for unit in units], bucket_bytes)]
    out = []
    for g in groups:
        g = sorted(g, key=lambda e: -e.dtype.itemsize)  # stable: a delta keeps idx before val
        offs = [0]
        for e in g[:-1]:
            offs.append(offs[-1] + e.nbytes)
        out.append(SendBucket(g, offs, offs[-1] + g[-1].nbytes))
    return out


@dataclass
class ExchangeStats:
    sent: int = 0  # bytes this rank put into the exchange for other ranks
    received: int = 0  # bytes this rank received from other ranks


class Exchange:
    """Rounds of ``all_to_all_single`` over the trainer group: in round k every rank sends its pieces of
    each sender's k-th bucket to that sender, which assembles the bucket. Round k+1 is in flight while
    the consumer sends bucket k."""

    def __init__(self, group, rank: int, n_ranks: int):
        self.group, self.rank, self.n = group, rank, n_ranks
        self.stats = ExchangeStats()

    def run(self, layout: dict[int, list[SendBucket]], piece: Callable[[Entry], torch.Tensor],
            consume: Callable[[int, int, Bucket], None], device) -> None:
        """``piece(entry)``: this rank's bytes of ``entry`` (uint8, ``entry.pieces[rank]`` long).
        ``consume(k, n_k, bucket)`` gets each of this rank's buckets (k of n_k) in order."""
        rounds = max((len(b) for b in layout.values()), default=0)
        mine = layout.get(self.rank, [])
        pending = self._start(layout, 0, piece, device) if rounds else None
        for k in range(rounds):
            work, out, splits = pending
            if work is not None:
                work.wait()
            pending = self._start(layout, k + 1, piece, device) if k + 1 < rounds else None
            if k < len(mine):
                consume(k, len(mine), self._assemble(mine[k], k, out, splits, device))

    def _start(self, layout, k: int, piece, device):
        parts, in_splits = [], []
        for dest in range(self.n):
            bs = layout.get(dest, [])
            size = 0
            if k < len(bs):
                for e in bs[k].entries:
                    if e.pieces[self.rank]:
                        parts.append(piece(e))
                        size += e.pieces[self.rank]
            in_splits.append(size)
        mine = layout.get(self.rank, [])
        out_splits = [sum(e.pieces[r] for e in mine[k].entries) for r in range(self.n)] if k < len(mine) else \
            [0] * self.n
        inp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        self.stats.sent += sum(in_splits) - in_splits[self.rank]
        self.stats.received += sum(out_splits) - out_splits[self.rank]
        if self.n == 1:
            out.copy_(inp)
            return None, out, out_splits
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        return work, out, out_splits

    def _assemble(self, sb: SendBucket, k: int, out: torch.Tensor, splits: list[int], device) -> Bucket:
        data = torch.empty(sb.nbytes, dtype=torch.uint8, device=device)
        pos = 0
        at = list(sb.offsets)  # where each entry's next rank's piece goes (ranks in order)
        for r in range(self.n):
            for i, e in enumerate(sb.entries):
                n = e.pieces[r]
                if n:
                    data[at[i] : at[i] + n].copy_(out[pos : pos + n])
                    pos += n
                at[i] += n
        return Bucket(k, [e.name for e in sb.entries], [e.dtype for e in sb.entries], [e.shape for e in sb.entries],
                      list(sb.offsets), data)


def local_piece(src: Sources, wt: WireTensor, rank: int) -> torch.Tensor | None:
    """This rank's piece of ``wt`` in the sent dtype (a view when no cast is needed), or None."""
    s = wt.segs[rank]
    if s is None:
        return None
    flat = src.local[wt.src].reshape(-1)[s[1] : s[1] + s[2]]
    return flat if flat.dtype == wt.dtype else flat.to(wt.dtype)


@dataclass
class ShardShadow:
    """This rank's shadow of what the servers hold, for its pieces only (1/N of the model): the delta
    encoder of the many-sender path. The rank-0 encoder's rules: the first update after the groups are
    made, every ``full_every``-th and the one after a failure are whole; the shadow is dropped on failure."""

    full_every: int = 10
    max_changed: float = 0.25
    backend: str | None = None
    shadow: dict[int, torch.Tensor] = field(default_factory=dict)  # wire index -> this rank's piece
    since_full: int | None = None
    mode: str = WHOLE
    _enc: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    def begin(self) -> bool:
        """Start an update; True if it may send deltas (every rank decides the same)."""
        delta = self.since_full is not None and self.since_full + 1 < self.full_every
        self.mode = DELTA if delta else WHOLE
        self._enc = {}
        return delta

    def done(self, ok: bool) -> None:
        if not ok:
            self.invalidate()
        elif self.mode == WHOLE:
            self.since_full = 0
        else:
            self.since_full = (self.since_full or 0) + 1
        self._enc = {}

    def invalidate(self) -> None:
        self.shadow.clear()
        self.since_full = None
        self._enc = {}

    def count(self, wires: list[WireTensor], pieces: dict[int, torch.Tensor]) -> np.ndarray:
        """Changed elements of each of this rank's pieces (0 where it holds none or the tensor is not
        16-bit); the encodings are kept for :meth:`encoded`."""
        out = np.zeros(len(wires), np.int64)
        for w, new in pieces.items():
            old = self.shadow.get(w)
            if old is None or not deltable(wires[w]):
                continue
            idx, val = delta_encode(old if old.device == new.device else old.to(new.device), new,
                                    backend=self.backend)
            self._enc[w] = (idx, val)
            out[w] = idx.numel()
        return out

    def keep(self, w: int, new: torch.Tensor) -> None:
        """The shadow of piece ``w`` := ``new`` (a whole tensor sent)."""
        old = self.shadow.get(w)
        if old is None or old.dtype != new.dtype or old.shape != new.shape:
            self.shadow[w] = new.detach().to("cpu", copy=True)
        else:
            old.copy_(new)

    def commit(self, wires: list[WireTensor], fates: list[str] | None, pieces: dict[int, torch.Tensor],
               rank: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Bring the shadow to what this update sends (``fates`` None: a whole update) and return this
        rank's changes of each delta tensor, in the wire tensor's flat indices (ascending)."""
        out = {}
        for w, new in pieces.items():
            if not deltable(wires[w]):
                continue
            fate = WHOLE if fates is None else fates[w]
            if fate == WHOLE:
                self.keep(w, new)
            elif fate == DELTA:
                idx, val = self._enc.get(w) or (torch.empty(0, dtype=torch.int32, device=new.device),
                                                 new.new_empty(0))
                host = self.shadow[w]
                if idx.numel():
                    delta_apply(host, idx.to(host.device), val.to(host.device))
                out[w] = (idx + wires[w].segs[rank][0], val)
        self._enc = {}
        return out
