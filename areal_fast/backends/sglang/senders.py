"""Many senders on SGLang's wire: every trainer rank (``weights.senders``) sends its share of an update over
its own weight group with each server. The mixin of :class:`~areal_fast.backends.sglang.weight_sync.
DistributedWeightSync` that picks the senders, makes each sender's groups and runs an update; the plan, the
exchange and the per-rank delta shadow are :mod:`areal_fast.weights.senders`. What the stock servers allow
and why this layout: ``docs/weight_sync.md`` ("Many senders").
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from areal_fast.backends.sglang.compat import keeps_weight_groups_by_name, reported_gate
from areal_fast.weights.delta import wants_delta
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.gather import Bucket, Sources
from areal_fast.weights.group import choose_backend
from areal_fast.weights.senders import (
    DELTA,
    Exchange,
    decide,
    delta_entries,
    deltable,
    keepalive_unit,
    local_piece,
    pack_buckets,
    plan_wire,
    sender_ranks,
    whole_entries,
)

__all__ = ["ManySenders", "takes_many_senders"]

log = logging.getLogger(__name__)


def takes_many_senders(version: str | None) -> bool:
    """Does a server of this SGLang version hold one weight group per trainer sender (by name)? A
    server that does not say its version gets one sender; a source build is taken as a new server."""
    return reported_gate(keeps_weight_groups_by_name, version)


class ManySenders:
    """The many-sender update of a distributed transport. Uses the transport's ``config``, ``urls``,
    ``facts``, ``http``, ``group``, ``session()``, ``read_facts()``, ``mark_broken()``, ``_tensor_device()``,
    ``_host_group()``, ``_send_pair()`` and its state ``senders``, ``_pairs``, ``_groups_made``, ``_wires``,
    ``_wire_key``, ``_shadow``, ``stats``."""

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _bcast0(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    def _choose_senders(self) -> list[int]:
        """The sending ranks of this transport (collective, once): ``weights.senders`` where every server
        holds groups by name (``takes_many_senders``), else rank 0 alone. Rank 0 reads the facts and
        hands them to the other ranks, which need the servers' tp sizes for their groups."""
        world = self._world()
        if world == 1 or self.config.senders == "one" or getattr(self.config, "quantize", None):
            return [0]  # a quantised update is encoded on the gathered buckets (weights/fp8.py)
        msg = None
        if self.rank == 0:
            try:
                facts = self.read_facts()
                self._stale_facts = False
                for f in facts.values():
                    f.check_layout()
                many = all(takes_many_senders(f.version) for f in facts.values())
                msg = {"senders": sender_ranks(self.config.senders, world) if many else [0],
                       "facts": [facts[u] for u in self.urls]}
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                msg = {"error": f"{type(e).__name__}: {e}"}
        msg = self._bcast0(msg)
        if "error" in msg:
            raise WeightSyncError(msg["error"])
        if self.rank != 0:
            self.facts = {f.url: f for f in msg["facts"]}
        if len(msg["senders"]) == 1:
            log.info("weight sync: a server keeps one weight group only; trainer rank 0 sends everything")
        return msg["senders"]

    def _group_name(self, url: str) -> str:
        """This sender's group with server ``url`` (a name of its own in this process and on the server)."""
        return f"{self.config.group_name}-s{self.rank}-{self.urls.index(url)}"

    def _server_order(self) -> list[str]:
        """This sender's servers, rotated by its place among the senders, so that at any moment the
        senders tend to talk to different servers (each server takes one update call at a time)."""
        k = self.senders.index(self.rank) % len(self.urls)
        return self.urls[k:] + self.urls[:k]

    def _make_groups(self, src: Sources) -> None:
        """This sender's group with each server (rank 0: this rank; ranks 1..tp: the server's TP
        workers), one at a time in :meth:`_server_order`."""
        cfg = self.config
        backend = choose_backend(cfg.collective, self._tensor_device(src), [self.facts[u] for u in self.urls])
        for i, u in enumerate(self._server_order()):
            name = self._group_name(u)
            port = 0 if cfg.master_port == 0 else cfg.master_port + self.rank * len(self.urls) + i
            self._pairs[u] = self._host_group([u], name, backend, port, f"weight update group {name} on {u}")
        self.backend = backend
        self.group_tp = {u: self.facts[u].tp_size for u in self.urls}
        self.n_inits += 1

    def _outcome(self, err: BaseException | None) -> list:
        """Every rank's (error, broken) of this step; collective."""
        mine = (None if err is None else f"{type(err).__name__}: {err}", self._broken)
        out = [None] * self._world()
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def _send_many(self, src: Sources, dtypes: list[torch.dtype], version: str) -> None:
        """Every sender sends its share (module docstring of ``weights/senders.py``); collective."""
        cfg, rank, n = self.config, self.rank, self._world()
        # 1. rank 0: the servers' facts, the delta choice, the sessions
        go, session, err0 = None, None, None
        if rank == 0:
            try:
                if self._broken:
                    raise WeightSyncError(f"the weight update groups are unusable after an earlier failure "
                                          f"({self._broken}); close() and create a new DistributedWeightSync")
                facts = self.read_facts() if self._stale_facts else self.facts
                self._stale_facts = True
                if self.group_tp:
                    changed = [u for u in self.urls if facts[u].tp_size != self.group_tp[u]]
                    if changed:
                        self.mark_broken(f"tp size changed on {changed}")
                        raise WeightSyncError(f"servers {changed} changed their tp size since the weight groups were "
                                              "made (restarted?); close() and create a new DistributedWeightSync")
                on_cuda = bool(src.local) and src.local[0].device.type == "cuda"
                delta = self._shadow is not None and all(
                    wants_delta(cfg.delta, facts[u].engine, on_cuda) for u in self.urls)
                session = self.session()
                session.__enter__()
                go = {"delta": delta}
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                err0, go = e, {"error": f"{type(e).__name__}: {e}"}
        go = self._bcast0(go)
        if "error" in go:
            raise err0 if err0 is not None else WeightSyncError(go["error"])
        err: BaseException | None = None
        ok = False
        try:
            # 2. the groups (first update of this transport)
            if not self._groups_made:  # every rank, senders or not: the outcome below is collective
                try:
                    if rank in self.senders:
                        self._make_groups(src)
                except Exception as e:  # noqa: BLE001
                    err = e
                    self.mark_broken(f"making the weight groups failed: {e}")
                fails = [o for o in self._outcome(err) if o[0] is not None]
                if fails:
                    self._broken = self._broken or fails[0][1] or fails[0][0]
                    raise err or WeightSyncError(f"making the weight groups failed on another rank: {fails[0][0]}")
                self._groups_made = True
            # 3. the plan (once per sources and senders) and this update's entries
            key = src.key(dtypes) + (tuple(self.senders),)
            if key != self._wire_key:
                self._wires, self._wire_key = plan_wire(src, dtypes, n, self.senders), key
                if self._shadow is not None:
                    self._shadow.invalidate()
            wires = self._wires
            shadow = self._shadow if go["delta"] else None
            if shadow is None and self._shadow is not None:
                self._shadow.invalidate()
            delta_now = shadow is not None and shadow.begin()
            pieces = {w: local_piece(src, wt, rank) for w, wt in enumerate(wires) if wt.segs[rank] is not None}
            changes: dict = {}
            if delta_now:
                # on the trainer's device: the group is NCCL's alone on a CUDA trainer (no CPU tensors)
                counts = torch.from_numpy(shadow.count(wires, {w: p for w, p in pieces.items() if deltable(wires[w])}))
                counts = counts.to(self._tensor_device(src))
                every = [torch.zeros_like(counts) for _ in range(n)]
                dist.all_gather(every, counts, group=self.group)
                counts = torch.stack(every).cpu().numpy()
                fates = decide(wires, counts, cfg.delta_max_changed)
                units = delta_entries(wires, fates, counts)
                changes = shadow.commit(wires, fates, pieces, rank)
            else:
                units = whole_entries(wires, n)
                if shadow is not None:
                    shadow.commit(wires, None, pieces, rank)
            if not any(units.values()):
                units = {self.senders[0]: [keepalive_unit(wires, n)]}
            layout = {s: pack_buckets(units[s], cfg.bucket_bytes) for s in self.senders if units.get(s)}
            flusher = min(layout)  # its last bucket carries the cache flush
            self.stats = {"senders": len(self.senders), "bytes_to_servers": 0, "bucket_calls": 0,
                          "gather_received": 0, "mode": DELTA if delta_now else "whole",
                          "shadow_bytes": shadow.nbytes if shadow is not None else 0}

            def piece(e):
                if e.part == "whole" or e.part == "keep_val":
                    p = pieces[e.wire]
                    return (p[:1] if e.part == "keep_val" else p).contiguous().view(torch.uint8)
                if e.part == "keep_idx":
                    return torch.zeros(1, dtype=torch.int32, device=pieces[e.wire].device).view(torch.uint8)
                idx, val = changes[e.wire]
                return (idx if e.part == "idx" else val).contiguous().view(torch.uint8)

            sent_err: list = []

            def consume(k: int, nk: int, bucket: Bucket) -> None:
                bucket.last = rank == flusher and k == nk - 1
                self.stats["bytes_to_servers"] += int(bucket.data.numel())
                if sent_err:
                    return  # keep exchanging (collective) but send nothing more
                try:
                    for u in self._server_order():
                        self._send_pair(u, bucket, version).wait()
                        self.stats["bucket_calls"] += 1
                except Exception as e:  # noqa: BLE001 - shared with every rank below
                    sent_err.append(e)

            ex = Exchange(self.group, rank, n)
            dev = self._tensor_device(src)
            ex.run(layout, piece, consume, dev)
            self.stats["exchange_sent"], self.stats["exchange_received"] = ex.stats.sent, ex.stats.received
            err = sent_err[0] if sent_err else None
        except Exception as e:  # noqa: BLE001
            err = err or e
        # 4. the outcome of every rank; rank 0 closes the sessions
        outs = self._outcome(err)
        fails = [o for o in outs if o[0] is not None]
        broken = next((o[1] for o in outs if o[1]), None)
        if broken and not self._broken:
            self._broken = broken
        first = err if err is not None else (WeightSyncError(f"weight update to version {version} failed on "
                                                             f"another trainer rank: {fails[0][0]}") if fails else None)
        try:
            if session is not None:
                if first is None:
                    session.__exit__(None, None, None)
                else:
                    session.__exit__(type(first), first, first.__traceback__)
            ok = first is None
        except Exception as e:  # noqa: BLE001 - an end that failed after a good update
            first = first or e
        finally:
            if self._shadow is not None and go.get("delta"):
                self._shadow.done(ok)
        if first is not None:
            raise first
