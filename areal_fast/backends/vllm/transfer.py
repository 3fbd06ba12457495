"""The trainer's side of vLLM's weight transfer (``weights.method: distributed`` with
``rollout.api: vllm``; vLLM 0.16.0 on; ``docs/vllm.md`` has the rendezvous in prose).

What vLLM's NCCL transfer engine expects of the trainer (read from the 0.16.0, 0.21.0 and 0.33.0
wheels: ``vllm/distributed/weight_transfer/nccl_engine.py`` and, from 0.33.0, ``nccl_common.py``):

* the trainer is **rank 0** of a group of ``world_size = 1 + every server's ranks``; a server's
  ranks are its workers, ``tp * pp * dp`` of them, worker ``(dp, r)`` of a server joining as
  ``rank_offset + dp * tp * pp + r``;
* rank 0 **hosts the TCPStore** at ``master_address:master_port`` (vLLM's ``StatelessProcessGroup``:
  a store with no key prefix); every worker connects to it as a client when its server gets
  ``POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
  world_size}}``; the data plane is vLLM's own NCCL communicator (``PyNcclCommunicator``), whose
  rank 0 makes the NCCL unique id and posts it through that store; both sides must enter the
  rendezvous at the same time (the init call is answered once the group exists);
* per update: ``/start_weight_update`` (0.21.0 on), one ``/update_weights {"update_info": {names,
  dtype_names, shapes}}`` answered once every tensor arrived, while rank 0 broadcasts the tensors
  one by one in exactly that order (the unpacked wire: ``packed`` left unset, which both the 0.16
  update info and the 0.33 init info default to false), then ``/finish_weight_update`` (0.21.0 on,
  with ``weight_version`` from 0.27.0). Before 0.21.0 every ``/update_weights`` is a whole layerwise
  reload, so one update is one call, as here on every release.

The data plane follows where the trainer's tensors are: CUDA tensors go over vLLM's NCCL
communicator (vLLM must be importable on trainer rank 0: the communicator is vLLM's own, so the
wire is vLLM's by construction); CPU tensors go over gloo, which only the embedded engine's vLLM
twin speaks (``embedded/vllm_routes.py``: same endpoints, same bodies, same ranks, the
store prefixed with the twin's group name). Anything else is refused before the servers are asked.

Delta updates (``weights.delta``) go to servers launched with ``--weight-transfer-config
'{"backend": "sparse_nccl"}'`` (0.32.0 on; ``backends/vllm/sparse.py`` has the wire): the backend is
fixed when a server starts and read from its ``/server_info`` (``vllm_config.weight_transfer_config``).
Such a server takes nothing but patches, so every update is sent as patches: the delta encoder's
(``weights/delta.py``) changes, and its whole tensors (every ``delta_full_every``-th update, the first,
the one after a failure) as patches of every element. One ``/update_weights`` per bucket, answered
before the next is posted (the counts of a bucket are known only once it is encoded). The servers of one
sync share the broadcasts, so they must all run the same backend; ``weights.delta: off`` to a sparse
server, ``on`` to a dense one, are refused before the rendezvous, naming the server.

Gathering FSDP2 shards into buckets is the broadcast transport's (``weights.gather``): every
trainer rank runs :meth:`VLLMTransferWeightSync.update`; only rank 0 talks to the servers.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_fast.backends.vllm.compat import SPARSE_TRANSFER_SINCE, TRANSFER_BACKENDS, TWIN_TRANSFER_GROUP, VLLMBehaviour
from areal_fast.backends.vllm.requests import (
    finish_transfer_body,
    init_transfer_body,
    update_transfer_body,
    weight_version_body,
)
from areal_fast.backends.vllm.sparse import _Arange, bucket_patches, patch_bytes, patches_body
from areal_fast.netutil import url_host
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.delta import DeltaEncoder
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.experts import split_entries, to_checkpoint_layout
from areal_fast.weights.fp8 import bucket_encoder, transfer_wire, wire_view
from areal_fast.weights.gather import Bucket, BucketGatherer, Sources
from areal_fast.weights.group import HostedStore, host_weight_group, rendezvous
from areal_fast.weights.sync import POLL_S, WeightSync, send_gathered

__all__ = ["VLLMTransferWeightSync", "VLLMServer", "choose_wire", "read_vllm_server", "transfer_order"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMServer:
    """What the sender needs of one vLLM server: its release, its ranks in the group, whether it is
    the embedded twin, and its device."""

    url: str
    behaviour: VLLMBehaviour
    n_ranks: int
    twin: bool
    device: str
    transfer_backend: str = "nccl"  # --weight-transfer-config's backend: 'nccl' (whole) or 'sparse_nccl' (patches)


def _ranks_of(url: str, info: dict) -> int:
    """tp * pp * dp of a server's ``/server_info?config_format=json`` (vLLM's ``vllm_config``)."""
    cfg = info.get("vllm_config") if isinstance(info, dict) else None
    par = cfg.get("parallel_config") if isinstance(cfg, dict) else None
    if not isinstance(par, dict):
        raise WeightSyncError(f"{url}/server_info?config_format=json has no vllm_config.parallel_config; is the "
                              f"server running with VLLM_SERVER_DEV_MODE=1?")
    tp, pp, dp = (int(par.get(k) or 1) for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                   "data_parallel_size"))
    local = int(par.get("data_parallel_size_local") or dp)
    if local != dp:
        raise WeightSyncError(f"{url}: data_parallel_size {dp} with {local} local ranks (one server per DP rank); "
                              f"its workers' transfer ranks count the global DP index: serve all DP ranks from "
                              f"one server, or use weights.method 'disk'")
    return tp * pp * dp


def read_vllm_server(http, url: str) -> VLLMServer:
    """Ask a vLLM server (or the twin) its release and parallel layout (rank 0, before the rendezvous)."""
    ver = http.call(url, "/version", method="GET")
    try:
        b = VLLMBehaviour.of(str((ver or {}).get("version")))
    except ValueError as e:
        raise WeightSyncError(f"{url}: {e}") from None
    if not b.has_weight_transfer:
        raise WeightSyncError(f"{url}: vLLM {b.version} has no weight-transfer endpoints (from 0.16.0); "
                              f"use weights.method 'disk'")
    info = http.call(url, "/server_info?config_format=json", method="GET")
    cfg = info.get("vllm_config") or {}
    device = str((cfg.get("device_config") or {}).get("device") or "cuda")
    backend = str((cfg.get("weight_transfer_config") or {}).get("backend") or "nccl")
    return VLLMServer(url, b, _ranks_of(url, info), info.get("areal_fast_engine") == "embedded", device, backend)


def choose_wire(servers: list[VLLMServer], delta: str) -> str:
    """'nccl' (every tensor whole, one broadcast each) or 'sparse_nccl' (patches) for these servers and
    ``weights.delta``; WeightSyncError naming the server where they cannot be served together."""
    backends = {s.transfer_backend for s in servers}
    odd = [f"{s.url} ({s.transfer_backend})" for s in servers if s.transfer_backend not in TRANSFER_BACKENDS]
    if odd:
        raise WeightSyncError(f"servers {odd} run a weight-transfer backend our sender does not speak; launch them "
                              f"with --weight-transfer-config '{{\"backend\": \"nccl\"}}' (or sparse_nccl)")
    if len(backends) > 1:
        raise WeightSyncError(f"servers run different weight-transfer backends "
                              f"({sorted(f'{s.url}: {s.transfer_backend}' for s in servers)}); one broadcast feeds "
                              f"them all: launch them alike")
    if backends == {"sparse_nccl"}:
        old = [f"{s.url} ({s.behaviour.version})" for s in servers if not s.behaviour.has_sparse_transfer]
        if old:
            raise WeightSyncError(f"servers {old} run sparse_nccl from before {SPARSE_TRANSFER_SINCE}, which patches "
                                  f"runtime parameters by runtime name (tp 1): not our wire; launch them with nccl")
        if delta == "off":
            raise WeightSyncError(f"weights.delta 'off', but {[s.url for s in servers]} run sparse_nccl, which takes "
                                  f"patches only: set weights.delta 'auto' or launch them with backend nccl")
        return "sparse_nccl"
    if delta == "on":
        raise WeightSyncError(f"weights.delta 'on' to vLLM servers {[s.url for s in servers]} launched with backend "
                              f"nccl (whole tensors only): launch them with --weight-transfer-config "
                              f"'{{\"backend\": \"sparse_nccl\"}}' (vLLM {SPARSE_TRANSFER_SINCE} on), or set 'auto'")
    return "nccl"


def transfer_order(gatherer: BucketGatherer, src: Sources, dtypes: list[torch.dtype]) -> list[int]:
    """The tensors (indices into ``src``) in the order the buckets send them: the order of
    ``update_info`` must be the broadcast order, since the worker receives by position."""
    plan = gatherer.plan(src, dtypes)
    return [int(t) for b in range(plan.n_buckets) for t in plan.tensors_of(b).tolist()]


def choose_transfer_backend(tensor_device: torch.device, servers: list[VLLMServer]) -> str:
    """'nccl' for CUDA tensors, 'gloo' for CPU tensors to CPU twins; anything else is refused."""
    if tensor_device.type == "cuda":
        cpu_twins = [s.url for s in servers if s.device == "cpu"]
        if cpu_twins:
            raise WeightSyncError(f"servers {cpu_twins} run on CPU (the embedded twin speaks gloo), the trainer's "
                                  f"weights are on CUDA (NCCL): put both on the same kind of device")
        return "nccl"
    real = [s.url for s in servers if not (s.twin and s.device == "cpu")]
    if real:
        raise WeightSyncError(f"vLLM's weight transfer is NCCL: the trainer's weights must be on CUDA to send to "
                              f"{real} (CPU tensors go over gloo to the embedded twin only)")
    return "gloo"


class _GlooChannel:
    def __init__(self, store: HostedStore, world_size: int, timeout_s: float):
        self.pg = host_weight_group("gloo", store, world_size, TWIN_TRANSFER_GROUP, timeout_s)

    def broadcast(self, t: torch.Tensor):
        return dist.broadcast(wire_view(t), src=0, group=self.pg, async_op=True)

    def close(self) -> None:
        dist.destroy_process_group(self.pg)


class _StreamWork:
    """A broadcast on the side stream: complete when its event has fired; ``wait()`` puts the event
    in front of whatever the compute stream does next (a bucket buffer is refilled only after the
    broadcast that reads it), without blocking the host."""

    def __init__(self, cuda, event, device):
        self.cuda, self.event, self.device = cuda, event, device

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.cuda.current_stream(self.device).wait_event(self.event)


class SideStream:
    """Runs the broadcasts on a CUDA stream of their own, as ``torch.distributed``'s NCCL group does
    for the SGLang path: the next bucket's packing, gather and unpack (on the compute stream and
    NCCL's) then run while this bucket is broadcast, instead of queueing behind it on one stream.

    Ordering: the side stream first waits for the compute stream (the bucket was written there),
    the broadcast is enqueued on the side stream, the tensor's memory is marked in use by the side
    stream (the caching allocator hands it out again only after the broadcast read it) and an
    event is recorded after it; :class:`_StreamWork` waits on that event. ``cuda`` is
    ``torch.cuda`` (a stand-in in the CPU tests of this ordering)."""

    def __init__(self, device, cuda=torch.cuda):
        self.cuda, self.device = cuda, device
        self.stream = cuda.Stream(device=device)

    def broadcast(self, send, t: torch.Tensor) -> _StreamWork:
        """``send(t, stream)`` enqueues the collective on ``stream``."""
        self.stream.wait_stream(self.cuda.current_stream(self.device))
        send(t, self.stream)
        t.record_stream(self.stream)
        event = self.cuda.Event()
        event.record(self.stream)
        return _StreamWork(self.cuda, event, self.device)


class _NcclChannel:
    """vLLM's own NCCL communicator over a prefix-less store that rank 0 hosts (vLLM's rendezvous),
    broadcasting on a side stream (:class:`SideStream`)."""

    def __init__(self, store: HostedStore, world_size: int, timeout_s: float):
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as e:
            raise WeightSyncError("weights.method 'distributed' to vLLM servers from CUDA tensors uses vLLM's own NCCL "
                                  f"communicator: install vllm (the servers' release) on the trainer ({e})") from e
        pg = StatelessProcessGroup(rank=0, world_size=world_size, store=store.store)
        device = torch.cuda.current_device()
        self.comm = PyNcclCommunicator(pg, device=device)
        self.side = SideStream(device)

    def broadcast(self, t: torch.Tensor):
        # a non-contiguous tensor's copy is made on the compute stream, before the side stream waits for it
        return self.side.broadcast(lambda x, stream: self.comm.broadcast(x, src=0, stream=stream),
                                   t if t.is_contiguous() else t.contiguous())

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if destroy is not None:
            destroy()
        self.comm = None


class _PendingBucket:
    """One bucket's broadcasts; a server whose /update_weights already failed will not receive the
    rest, so waiting for it would hang: that failure is raised (and the group marked unusable)."""

    def __init__(self, owner: VLLMTransferWeightSync, works: list, calls: list[tuple[str, Future]], what: str,
                 answered: bool = False, keep=None):
        self.owner, self.works, self.calls, self.what = owner, works, calls, what
        self.answered = answered  # also wait for the calls' answers (a sparse bucket's own /update_weights)
        self.keep = keep  # tensors the broadcasts read, alive until they are done

    def wait(self) -> None:
        timeout_s = self.owner.config.timeout_s
        deadline = time.monotonic() + timeout_s
        while not all(w.is_completed() for w in self.works):
            for url, f in self.calls:
                if f.done() and f.exception() is not None:
                    self.owner.mark_broken(f"{url} refused the update during {self.what}")
                    raise f.exception()
            if time.monotonic() > deadline:
                self.owner.mark_broken(f"{self.what}: the broadcast did not complete within {timeout_s}s")
                raise WeightSyncError(f"{self.what}: the broadcast did not complete within {timeout_s}s")
            time.sleep(POLL_S)
        for w in self.works:
            w.wait()
        if self.answered:
            for _u, f in self.calls:
                f.result(timeout=timeout_s)
        self.keep = None


class _Nothing:
    def wait(self) -> None:
        pass


class VLLMTransferWeightSync(WeightSync):
    """vLLM's weight transfer from trainer rank 0 (see the module docstring). The group is made at
    the first update and reused; after a failure mid-broadcast it is unusable: ``close()`` and make
    a new one (the sync port does when an update fails)."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None,
                 device: torch.device | None = None):
        super().__init__(servers, config, group)
        self.device = device
        self.servers: dict[str, VLLMServer] = {}
        self.backend: str | None = None
        self.world_size: int | None = None
        self.n_inits = 0
        self._channel = None
        self._store: HostedStore | None = None
        self._gatherer = BucketGatherer(self.config.bucket_bytes, group, device, encode=bucket_encoder(self.config))
        self._broken: str | None = None
        self.wire = "nccl"  # or 'sparse_nccl' (choose_wire), set at connect
        # delta updates (weights/delta.py) to sparse_nccl servers: the shadow of what they hold, rank 0 only
        self.delta = (DeltaEncoder(self.config.delta_full_every, self.config.delta_max_changed)
                      if self.config.delta != "off" else None)
        self._arange = _Arange()
        self.wire_bytes = 0  # what the last update put on the wire (rank 0)

    def mark_broken(self, reason: str) -> None:
        self._broken = reason[:300]

    def _tensor_device(self, src: Sources | None) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return src.local[0].device if src is not None and src.local else torch.device("cpu")

    def connect(self, src: Sources | None = None) -> None:
        """The rendezvous (rank 0; idempotent): every server's workers join while rank 0 opens its end."""
        if self._channel is not None or self.rank != 0:
            return
        cfg = self.config
        self.servers = {u: read_vllm_server(self.http, u) for u in self.urls}
        self.wire = choose_wire(list(self.servers.values()), cfg.delta)
        if self.wire == "sparse_nccl" and self._gatherer.encode is not None:
            raise WeightSyncError(f"servers {self.urls} run sparse_nccl (delta patches of the sent values), and the "
                                  f"sync sends quantised buckets: launch them with backend nccl for quantised updates")
        self.backend = choose_transfer_backend(self._tensor_device(src), list(self.servers.values()))
        self.world_size = 1 + sum(s.n_ranks for s in self.servers.values())
        store = HostedStore(cfg.resolved_master_addr, cfg.master_port, self.world_size, cfg.timeout_s)
        futs, offset = [], 1
        for u in self.urls:
            body = init_transfer_body(url_host(store.host), store.port, offset, self.world_size)
            futs.append((u, self.http.submit(u, "/init_weight_transfer_engine", body)))
            offset += self.servers[u].n_ranks
        opener = _GlooChannel if self.backend == "gloo" else _NcclChannel
        self._channel = rendezvous(lambda: opener(store, self.world_size, cfg.timeout_s), futs, store,
                                   cfg.timeout_s, "vLLM weight-transfer group")
        self._store = store
        self.n_inits += 1
        if self.delta is not None:
            self.delta.invalidate()  # a new group: what the servers hold is not known to be the shadow

    def _send(self, prepared: tuple[Sources, list[torch.dtype]], version: str) -> None:
        src, dtypes = prepared
        send_gathered(self, src, dtypes, "vLLM weight-transfer group",
                      lambda begin: self._push(src, dtypes, version, begin))

    def _push(self, src: Sources, dtypes: list[torch.dtype], version: str, begin) -> None:
        """Rank 0's update (inside :func:`~areal_fast.weights.sync.send_gathered`)."""
        self.connect(src)
        self.wire_bytes = 0
        if self.wire == "sparse_nccl":
            return self._push_patches(src, dtypes, version, begin)
        order = transfer_order(self._gatherer, src, dtypes)
        if self._gatherer.encode is not None:  # FP8: the quantised layout, in the order the encoded buckets send it
            body = update_transfer_body(*transfer_wire(self._gatherer.plan(src, dtypes), src, dtypes))
        else:
            # MoE: the fused expert tensors go as the checkpoint's per-expert tensors (weights/experts.py),
            # in the same order as _broadcast sends them
            wire = [(name, shape, t) for t in order for name, shape, _ in split_entries(src.names[t], src.shapes[t])]
            body = update_transfer_body([n for n, _, _ in wire],
                                        [str(dtypes[t]).removeprefix("torch.") for *_, t in wire],
                                        [list(shape) for _, shape, _ in wire])
        with self._update_session(version):
            begin()
            calls = [(u, self.http.submit(u, "/update_weights", body, what=f"{len(order)} tensors"))
                     for u in self.urls]
            self._gatherer.run(src, dtypes, lambda b: self._broadcast(b, calls))
            for _u, f in calls:
                f.result(timeout=self.config.timeout_s)

    def _push_patches(self, src: Sources, dtypes: list[torch.dtype], version: str, begin) -> None:
        """A sparse_nccl update: each bucket encoded against the shadow, sent as patches (module docstring)."""
        delta = self.delta
        delta.begin()
        ok = False
        try:
            with self._update_session(version):
                begin()
                self._gatherer.run(src, dtypes, lambda b: self._send_patches(b, delta))
            ok = True
        finally:
            delta.done(ok)  # a failed update leaves the servers' weights unknown: the next one whole
            self._arange = _Arange()  # the whole tensors' indices (4 bytes an element) live for one update

    def _send_patches(self, bucket: Bucket, delta: DeltaEncoder):
        bucket = delta.encode(to_checkpoint_layout(bucket))  # per-expert names, then only what changed
        if bucket is None:
            return _Nothing()
        patches = bucket_patches(bucket, self._arange)
        if not patches:
            return _Nothing()
        body = patches_body(patches)
        what = f"bucket {bucket.index} ({len(patches)} patches, {patches[0].name} .. {patches[-1].name})"
        calls = [(u, self.http.submit(u, "/update_weights", body, what=what)) for u in self.urls]
        works = []
        for p in patches:  # the order vLLM's worker receives in: per patch its indices, then its values
            works.append(self._channel.broadcast(p.indices))
            works.append(self._channel.broadcast(p.values))
        self.wire_bytes += patch_bytes(patches)
        return _PendingBucket(self, works, calls, what, answered=True, keep=patches)

    def _broadcast(self, bucket: Bucket, calls: list[tuple[str, Future]]) -> _PendingBucket:
        bucket = to_checkpoint_layout(bucket)
        self.wire_bytes += int(bucket.data.numel())
        works = [self._channel.broadcast(bucket.tensor(i)) for i in range(len(bucket.names))]
        what = f"bucket {bucket.index} ({bucket.names[0]} .. {bucket.names[-1]})"
        return _PendingBucket(self, works, calls, what)

    def _update_session(self, version: str):
        return _Session(self, version)

    def close(self) -> None:
        """Our end of the group, then the servers' (``/shutdown_weight_transfer_engine`` where the
        release has it): a group re-made after a failure must not leave the old one on the servers."""
        if self._channel is not None:
            try:
                self._channel.close()
            except Exception as e:  # noqa: BLE001 - a member may be gone
                log.info("closing the vLLM weight-transfer group: %s", e)
            self._channel = None
            for u, s in self.servers.items():
                if s.behaviour.has_transfer_shutdown:
                    try:
                        self.http.call(u, "/shutdown_weight_transfer_engine", None)
                    except WeightSyncError as e:  # best effort: a server may be gone
                        log.info("shutting the weight-transfer engine of %s: %s", u, e)
        if self._store is not None:
            self._store.close()
            self._store = None
        super().close()


class _Session:
    """``/start_weight_update`` .. ``/finish_weight_update`` on the servers that have them (0.21.0 on;
    the new label with the finish from 0.27.0), else the label by ``/update_weight_version`` after
    the update. A failed update still finishes the sessions it started, so the next one can start."""

    def __init__(self, owner: VLLMTransferWeightSync, version: str):
        self.owner, self.version = owner, version
        self.with_session = [u for u in owner.urls if owner.servers[u].behaviour.weight_update_sessions]

    def __enter__(self):
        self.owner.http.all(self.with_session, "/start_weight_update", None)
        return self

    def __exit__(self, exc_type, exc, tb):
        o = self.owner
        if exc_type is not None:
            for u, _a, err in o.http.each(self.with_session, "/finish_weight_update", None):
                if err is not None:
                    log.warning("finishing the weight update on %s after a failure: %s", u, err)
            return False
        for u in self.with_session:
            o.http.call(u, "/finish_weight_update", finish_transfer_body(self.version, o.servers[u].behaviour))
        label = [u for u in o.urls if o.servers[u].behaviour.labels_weight_version
                 and not o.servers[u].behaviour.weight_update_sessions]
        o.http.all(label, "/update_weight_version", weight_version_body(self.version))
        return False

