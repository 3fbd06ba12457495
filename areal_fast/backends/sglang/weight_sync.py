"""SGLang's weight-update calls: the transports from (FSDP2) trainer ranks to SGLang servers (and the
embedded engine), behind the interface of ``areal_fast.weights.sync``.

Usage on every trainer rank (collective calls; trainer rank 0 reads the servers' facts and runs their
sessions; with many senders, ``backends/sglang/senders.py``, each sending rank posts its own buckets)::

    sync = DistributedWeightSync(["http://127.0.0.1:30000"], WeightSyncConfig(dtype="bfloat16"))
    sync.connect()                        # once: group rendezvous with all servers
    ...                                   # controller: /pause_generation
    sync.update(model, version=step)      # begin -> buckets -> end; raises WeightSyncError on failure
    ...                                   # controller: /continue_generation
    sync.close()

Transports (the protocol is described in ``docs/weight_sync.md``):

* :class:`DistributedWeightSync` - ``/init_weights_update_group`` on every server while trainer
  rank 0 hosts the group's store (:mod:`areal_fast.weights.group`); per update, inside a
  weight-update session on servers >= 0.5.21, one ``/update_weights_from_distributed`` per
  bucket (``load_format="flattened_bucket"``, or null: one broadcast per tensor) answered while
  rank 0 broadcasts it. The group is created once and reused.
* :class:`DiskWeightSync` - safetensors in HF layout + ``/update_weights_from_disk`` with a real
  ``load_format``; no session (the server runs its post-load processing itself). The
  directory is removed afterwards (the servers must see the same file system).
* :class:`areal_fast.backends.sglang.colocated.ColocatedWeightSync` - GPU only.

Sessions: every server that answered ``/begin_weight_update`` gets ``/end_weight_update``
whatever happens afterwards; a begin refused by one server ends the ones already begun. A
failed update therefore never leaves a session open, and the next update can begin.

Server facts (version, tp, dp, pp) are read from ``/server_info`` before every use, so a server
that was down or restarted is asked again. ``version`` is bumped only when every server
succeeded; any failure raises :class:`WeightSyncError` on every trainer rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from areal_fast.backends.sglang.compat import needs_weight_update_sessions, reported_gate
from areal_fast.backends.sglang.senders import ManySenders, takes_many_senders
from areal_fast.netutil import url_host
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.delta import DeltaEncoder, wants_delta
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.experts import to_checkpoint_layout
from areal_fast.weights.fp8 import bucket_encoder, wire_view
from areal_fast.weights.gather import Bucket, BucketGatherer, Sources
from areal_fast.weights.group import HostedStore, ServerFacts, choose_backend, host_weight_group, rendezvous
from areal_fast.weights.senders import (
    ShardShadow,
)
from areal_fast.weights.sync import BROADCAST_GRACE_S, POLL_S, WeightSync, send_gathered, write_safetensors

__all__ = ["SGLangWeightSync", "DistributedWeightSync", "DiskWeightSync", "uses_sessions", "bucket_request",
           "check_unpadded", "takes_many_senders"]

log = logging.getLogger(__name__)


def uses_sessions(version: str | None) -> bool:
    """Does a server of this SGLang version need begin/end around distributed and tensor updates? A
    server that does not say its version gets none; a source build is taken as a new server."""
    return reported_gate(needs_weight_update_sessions, version)


class SGLangWeightSync(WeightSync):
    """What every SGLang transport shares: the servers' facts from ``/server_info`` and the
    weight-update sessions of the servers that need them (0.5.21 on: ``compat.needs_weight_update_sessions``)."""

    def read_facts(self) -> dict[str, ServerFacts]:
        """(Re)read every server's facts now (rank 0). A server that does not answer is named."""
        res = self.http.each(self.urls, "/server_info", method="GET")
        missing = [u for u, _a, e in res if e is not None and e.status == 404]
        if missing:  # servers without /server_info (older builds, some twins) still have the old route
            old = {u: (a, e) for u, a, e in self.http.each(missing, "/get_server_info", method="GET")}
            res = [(u, *old[u]) if u in old else (u, a, e) for u, a, e in res]
        for u, info, err in res:
            if err is not None:
                raise WeightSyncError(f"cannot read the facts of server {u} before the weight update: {err}") from err
            self.facts[u] = ServerFacts.from_info(u, info or {})
        return self.facts

    @contextlib.contextmanager
    def session(self, urls: list[str] | None = None):
        """A weight-update session on every server (of ``urls``) whose version needs one.

        Every server that began gets ``/end_weight_update`` on the way out, also when the body or
        another server's begin failed; an end that fails after a successful body is raised."""
        urls = self.urls if urls is None else urls
        need = [u for u in urls if uses_sessions(self.facts[u].version)]
        begun: list[str] = []
        try:
            failed = []
            for u, _answer, err in self.http.each(need, "/begin_weight_update", {"selector": "all"}):
                (begun.append(u) if err is None else failed.append(err))
            if failed:
                raise failed[0]
            yield begun
        except BaseException:
            for u, _a, err in self.http.each(begun, "/end_weight_update", {}):
                if err is not None:
                    log.warning("closing the weight-update session on %s after a failure: %s", u, err)
            raise
        else:
            self.http.all(begun, "/end_weight_update", {})


def bucket_request(bucket: Bucket, version: str, config: WeightSyncConfig) -> dict:
    """The body of ``/update_weights_from_distributed`` announcing ``bucket``. The prefix cache is
    flushed once, with the last bucket: generation is paused until the update is complete."""
    return {"names": bucket.names, "dtypes": [str(d).removeprefix("torch.") for d in bucket.dtypes],
            "shapes": [list(s) for s in bucket.shapes], "group_name": config.group_name,
            "flush_cache": config.flushes and bucket.last, "abort_all_requests": False,
            "weight_version": version, "load_format": config.load_format}


class _PendingSend:
    """Broadcast work handles + the servers' HTTP answers for one bucket."""

    def __init__(self, owner: DistributedWeightSync, futs: list[tuple[str, Future]], works: list, what: str):
        self.owner, self.futs, self.works, self.what = owner, futs, works, what

    def _failed(self) -> BaseException | None:
        for _url, f in self.futs:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    def wait(self) -> None:
        timeout_s = self.owner.config.timeout_s
        deadline = time.monotonic() + timeout_s
        while not (all(w.is_completed() for w in self.works) and all(f.done() for _, f in self.futs)):
            err = self._failed()
            if err is not None and all(f.done() for _, f in self.futs):
                # every server answered, one refused: the others took the bucket, so the broadcast
                # completes at once unless the refusing server never joined it (then the group is dead)
                grace = time.monotonic() + min(BROADCAST_GRACE_S, timeout_s)
                while not all(w.is_completed() for w in self.works) and time.monotonic() < grace:
                    time.sleep(POLL_S)
                if not all(w.is_completed() for w in self.works):
                    self.owner.mark_broken(f"{self.what}: the broadcast did not complete after {err}")
                raise err
            if time.monotonic() > deadline:
                late = [u for u, f in self.futs if not f.done()]
                self.owner.mark_broken(f"{self.what}: no answer within {timeout_s}s")
                raise WeightSyncError(f"{self.what}: no answer within {timeout_s}s from {late or 'the group'}")
            time.sleep(POLL_S)
        for w in self.works:
            w.wait()
        for _, f in self.futs:
            f.result()


class _NothingSent:
    def wait(self) -> None:
        pass


_NOTHING_SENT = _NothingSent()


class DistributedWeightSync(ManySenders, SGLangWeightSync):
    """SGLang's distributed update protocol (see the module docstring)."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None,
                 device: torch.device | None = None):
        super().__init__(servers, config, group)
        self.device = device
        self.pg = None
        self.backend: str | None = None
        self.world_size: int | None = None
        self.group_tp: dict[str, int] = {}  # tp size of each server when the group was made
        self.n_inits = 0
        self._store: HostedStore | None = None
        self._gatherer = BucketGatherer(self.config.bucket_bytes, group, device, encode=bucket_encoder(self.config))
        self._broken: str | None = None
        self._stale_facts = True
        # delta updates (weights/delta.py): the shadow of what the servers hold, rank 0 only
        self.delta = (DeltaEncoder(self.config.delta_full_every, self.config.delta_max_changed)
                      if self.config.delta != "off" else None)
        # many senders (weights.senders): the sending ranks, this rank's group with each server, the
        # wire tensors (made once per transport, i.e. per membership) and this rank's delta shadow
        self.senders: list[int] | None = None
        self._pairs: dict[str, tuple] = {}
        self._groups_made = False
        self._wires = None
        self._wire_key = None
        self._shadow = (ShardShadow(self.config.delta_full_every, self.config.delta_max_changed)
                        if self.config.delta != "off" else None)
        self.stats: dict = {}  # what the last update moved on this rank (bytes to servers, exchange, gather)

    def mark_broken(self, reason: str) -> None:
        self._broken = reason[:300]

    def _tensor_device(self, src: Sources | None) -> torch.device:
        if src is not None and src.local:
            return src.local[0].device if self.device is None else torch.device(self.device)
        return torch.device(self.device) if self.device is not None else torch.device("cpu")

    def _host_group(self, urls: list[str], name: str, backend: str, port: int, what: str) -> tuple:
        """A weight group ``name`` that this rank hosts (its rank 0) with the TP workers of ``urls`` (ranks
        1.. in their order, each server's ``tp_size`` of :attr:`facts`): the store on ``port`` (0: any),
        every server's ``/init_weights_update_group`` and the rendezvous (``what`` names it in errors).
        Returns (the process group, its store)."""
        cfg = self.config
        world = 1 + sum(self.facts[u].tp_size for u in urls)
        store = HostedStore(cfg.resolved_master_addr, port, world, cfg.timeout_s)
        futs, offset = [], 1
        for u in urls:
            # bracketed when IPv6 ([::1]): the servers build tcp://{master_address}:{master_port}
            body = {"master_address": url_host(store.host), "master_port": store.port, "rank_offset": offset,
                    "world_size": world, "group_name": name, "backend": backend}
            futs.append((u, self.http.submit(u, "/init_weights_update_group", body)))
            offset += self.facts[u].tp_size
        pg = rendezvous(lambda: host_weight_group(backend, store, world, name, cfg.timeout_s),
                        futs, store, cfg.timeout_s, what, own_end="the group")
        return pg, store

    def connect(self, src: Sources | None = None) -> None:
        """Create the group (rank 0; idempotent). The backend follows where ``src``'s tensors are."""
        if self.pg is not None or self.rank != 0:
            return
        cfg = self.config
        facts = self.read_facts()
        for f in facts.values():
            f.check_layout()
        self.backend = choose_backend(cfg.collective, self._tensor_device(src), list(facts.values()))
        self.world_size = 1 + sum(f.tp_size for f in facts.values())
        self.pg, self._store = self._host_group(self.urls, cfg.group_name, self.backend, cfg.master_port,
                                                "weight update group")
        self.group_tp = {u: facts[u].tp_size for u in self.urls}
        self.n_inits += 1
        if self.delta is not None:
            self.delta.invalidate()  # a new group: the servers' weights are not known to be the shadow
        self._stale_facts = False  # just read; the update that follows uses them

    def _send(self, prepared: tuple[Sources, list[torch.dtype]], version: str) -> None:
        src, dtypes = prepared
        if self.senders is None:
            self.senders = self._choose_senders()
        if len(self.senders) > 1:
            self._send_many(src, dtypes, version)
            return
        self.stats = {"senders": 1, "bytes_to_servers": 0, "bucket_calls": 0, "gather_received": 0,
                      "exchange_sent": 0, "exchange_received": 0}
        if self.rank == 0 and src.n_ranks > 1:
            plan = self._gatherer.plan(src, dtypes)
            self.stats["gather_received"] = int(plan.seg_bytes.sum()) * (src.n_ranks - 1)
        elif src.n_ranks > 1:
            self.stats["gather_sent"] = int(self._gatherer.plan(src, dtypes).seg_bytes.sum())
        send_gathered(self, src, dtypes, "weight update group", lambda begin: self._push(src, dtypes, version, begin))
        if self.rank == 0 and self.delta is not None:
            self.stats["mode"] = self.delta.stats.mode
            self.stats["shadow_bytes"] = sum(t.numel() * t.element_size() for t in self.delta.shadow.values())

    def _send_pair(self, url: str, bucket: Bucket, version: str) -> _PendingSend:
        """One bucket to one server over this sender's group with it."""
        cfg = self.config
        body = bucket_request(bucket, version, cfg)
        body["group_name"] = self._group_name(url)
        what = (f"bucket {bucket.index} of sender {self.rank} ({len(bucket.names)} tensors, {bucket.names[0]} .. "
                f"{bucket.names[-1]})")
        fut = self.http.submit(url, "/update_weights_from_distributed", body, what=what)
        pg = self._pairs[url][0]
        if cfg.load_format == "flattened_bucket":
            works = [dist.broadcast(bucket.data, src=0, group=pg, async_op=True)]
        else:
            works = [dist.broadcast(bucket.tensor(i), src=0, group=pg, async_op=True) for i in range(len(bucket.names))]
        return _PendingSend(self, [(url, fut)], works, what)

    def _push(self, src: Sources, dtypes: list[torch.dtype], version: str, begin: Callable[[], None]) -> None:
        """Rank 0's update (inside :func:`send_gathered`)."""
        if self.pg is None:
            self.connect(src)  # reads the facts
        facts = self.read_facts() if self._stale_facts else self.facts
        self._stale_facts = True  # read again before the next update
        changed = [u for u in self.urls if facts[u].tp_size != self.group_tp[u]]
        if changed:
            self.mark_broken(f"tp size changed on {changed}")
            raise WeightSyncError(f"servers {changed} changed their tp size since the weight group was made "
                                  "(restarted?); close() and create a new DistributedWeightSync")
        if self.config.load_format == "flattened_bucket":
            for layout in _bucket_layouts(self._gatherer.plan(src, dtypes), src, dtypes):
                check_unpadded(*layout)
        on_cuda = bool(src.local) and src.local[0].device.type == "cuda"
        delta = self.delta if self.delta is not None and all(
            wants_delta(self.config.delta, facts[u].engine, on_cuda) for u in self.urls) else None
        if delta is not None:
            delta.begin()
        elif self.delta is not None:
            self.delta.invalidate()
        ok = False
        try:
            with self.session():
                begin()
                self._gatherer.run(src, dtypes, lambda b: self._send_bucket(b, version, delta))
            ok = True
        finally:
            if delta is not None:
                delta.done(ok)  # a failed update leaves the servers' weights unknown: next one whole

    def _send_bucket(self, bucket: Bucket, version: str, delta: DeltaEncoder | None = None):
        cfg = self.config
        bucket = to_checkpoint_layout(bucket)  # fused MoE experts -> per-expert checkpoint tensors (no copy)
        if delta is not None:
            bucket = delta.encode(bucket)  # only what changed since the last update; None: nothing
            if bucket is None:
                return _NOTHING_SENT
        body = bucket_request(bucket, version, cfg)
        what = f"bucket {bucket.index} ({len(bucket.names)} tensors, {bucket.names[0]} .. {bucket.names[-1]})"
        futs = [(u, self.http.submit(u, "/update_weights_from_distributed", body, what=what)) for u in self.urls]
        self.stats["bytes_to_servers"] = self.stats.get("bytes_to_servers", 0) + int(bucket.data.numel())
        self.stats["bucket_calls"] = self.stats.get("bucket_calls", 0) + len(self.urls)
        if cfg.load_format == "flattened_bucket":
            works = [dist.broadcast(bucket.data, src=0, group=self.pg, async_op=True)]
        else:
            works = [dist.broadcast(wire_view(bucket.tensor(i)), src=0, group=self.pg, async_op=True)
                     for i in range(len(bucket.names))]
        return _PendingSend(self, futs, works, what)

    def close(self) -> None:
        for u, (pg, store) in list(self._pairs.items()):
            try:
                self.http.call(u, "/destroy_weights_update_group", {"group_name": self._group_name(u)})
            except WeightSyncError as e:
                log.info("destroying weight update group %s on %s: %s", self._group_name(u), u, e)
            dist.destroy_process_group(pg)
            store.close()
        self._pairs, self._groups_made = {}, False
        if self.pg is not None:
            try:
                self.http.all(self.urls, "/destroy_weights_update_group", {"group_name": self.config.group_name})
            except WeightSyncError as e:
                log.info("destroying the weight update group: %s", e)  # the servers may be gone already
            dist.destroy_process_group(self.pg)
            self.pg = None
        if self._store is not None:
            self._store.close()
            self._store = None
        super().close()


class DiskWeightSync(SGLangWeightSync):
    """HF-layout safetensors written by trainer rank 0 + ``/update_weights_from_disk``.

    ``config_dir``: a checkpoint directory whose non-weight files (config.json, tokenizer...)
    are copied next to the weights, for servers that reload the model config. ``keep``: leave
    the directory in place (``last_path``) instead of removing it after the update."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None, config_dir: str | None = None,
                 keep: bool = False):
        super().__init__(servers, config, group)
        self.config_dir = config_dir
        self.keep = keep
        self.last_path: str | None = None
        self._gatherer = BucketGatherer(self.config.bucket_bytes, group, encode=bucket_encoder(self.config))

    def _send(self, prepared: tuple[Sources, list[torch.dtype]], version: str) -> None:
        src, dtypes = prepared
        if self.rank != 0:
            self._gatherer.run(src, dtypes, None)
            return
        try:
            path = tempfile.mkdtemp(prefix=f"areal_weights_v{version}_", dir=self.config.save_root)
        except OSError as e:
            if src.n_ranks > 1:
                self._gatherer.run(src, dtypes, None)  # the other ranks are gathering: take part
            raise WeightSyncError(f"cannot create the weight directory under {self.config.save_root or 'the temp dir'}"
                                  f": {e}") from e
        self.last_path = path
        weight_map: dict[str, str] = {}

        class _Done:
            def wait(self):
                pass

        def write(bucket: Bucket):
            fname = f"model-{bucket.index + 1:05d}.safetensors"
            bucket = to_checkpoint_layout(bucket)  # a checkpoint any server loads: per-expert MoE tensors
            write_safetensors(os.path.join(path, fname), bucket)
            weight_map.update(dict.fromkeys(bucket.names, fname))
            return _Done()

        try:
            self._gatherer.run(src, dtypes, write)
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"weight_version": version}, "weight_map": weight_map}, f)
            if self.config_dir:
                for fn in os.listdir(self.config_dir):
                    full = os.path.join(self.config_dir, fn)
                    if os.path.isfile(full) and not fn.endswith((".safetensors", ".bin", ".pt", ".index.json")):
                        shutil.copy(full, path)
            body = {"model_path": path, "load_format": self.config.disk_load_format, "abort_all_requests": False,
                    "weight_version": version, "flush_cache": self.config.flushes}
            self.http.all(self.urls, "/update_weights_from_disk", body)
        finally:
            if not self.keep:
                shutil.rmtree(path, ignore_errors=True)


def _bucket_layouts(plan, src: Sources, dtypes: list[torch.dtype]):
    """(bucket index, names, byte offsets, byte sizes) of every bucket of ``plan``."""
    for b in range(plan.n_buckets):
        ts = plan.tensors_of(b).tolist()
        sizes = [int(torch.Size(src.shapes[t]).numel()) * dtypes[t].itemsize for t in ts]
        yield b, [src.names[t] for t in ts], [int(plan.offset[t]) for t in ts], sizes


def check_unpadded(bucket_index: int, names: list[str], offsets: list[int], nbytes: list[int]) -> None:
    """SGLang unpacks a flattened bucket by laying the tensors back to back with no alignment
    padding. Our buckets align each tensor to its dtype size, which adds padding only when a
    bucket mixes dtypes in an unlucky order; refuse that (before any server is asked to
    receive) rather than corrupt the weights."""
    end = 0
    for name, off, n in zip(names, offsets, nbytes):
        if off != end:
            raise WeightSyncError(
                f"bucket {bucket_index}: tensor {name!r} would need {off - end} bytes of alignment padding, which "
                "SGLang's flattened_bucket loader does not understand; send one dtype "
                "(WeightSyncConfig(dtype='bfloat16')) or load_format=None")
        end = off + n
