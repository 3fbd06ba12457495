"""Weight sync from (FSDP2) trainer ranks to inference servers, behind one interface.

Usage on every trainer rank (collective calls; only trainer rank 0 talks HTTP)::

    sync = DistributedWeightSync(["http://127.0.0.1:30000"], WeightSyncConfig(dtype=torch.bfloat16))
    sync.connect()                        # once: group rendezvous with all servers
    ...                                   # controller: /pause_generation + /flush_cache
    sync.update(model, version=step)      # begin -> buckets -> end; raises WeightSyncError on failure
    ...                                   # controller: /continue_generation
    sync.close()

Transports:
* :class:`DistributedWeightSync` - SGLang's protocol exactly (``shared/spec/sglang_http.md``):
  ``/init_weights_update_group`` on every server concurrently with the trainer's own group init
  (tcp rendezvous hosted by trainer rank 0, ``PrefixStore(group_name)``), then per update
  ``/begin_weight_update`` (servers >= 0.5.21), one ``/update_weights_from_distributed`` per
  bucket (``load_format="flattened_bucket"`` and ``weight_version``; or null: one broadcast per
  tensor) answered while rank 0 broadcasts the bucket, ``/end_weight_update``. NCCL on GPU,
  gloo on CPU. The group is created once and reused by every update.
* :class:`DiskWeightSync` - safetensors in HF layout + ``/update_weights_from_disk``; the
  directory is removed afterwards (the servers must see the same file system).
* :class:`ColocatedWeightSync` (``areal_fast.weights.colocated``) - GPU only.

Buckets come from :class:`areal_fast.weights.gather.BucketGatherer` (one gather per bucket,
pipelined with the send of the previous bucket). ``version`` is bumped only when every server
succeeded; any failure raises :class:`WeightSyncError` on every trainer rank.
"""

from __future__ import annotations

import abc
import datetime
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version

from areal_fast.netutil import find_free_port as free_port
from areal_fast.weights._http import HttpPool, WeightSyncError
from areal_fast.weights.gather import Bucket, BucketGatherer, collect_sources, send_dtypes

__all__ = ["ServerTarget", "WeightSyncConfig", "WeightSync", "DistributedWeightSync", "DiskWeightSync",
           "WeightSyncError", "init_custom_process_group"]

V_BEGIN_END = Version("0.5.21")  # /begin_weight_update and /end_weight_update exist from here
POLL_S = 0.0005  # broadcast/HTTP completion polling period (a bucket takes >= milliseconds)


@dataclass(kw_only=True)
class ServerTarget:
    """One inference server. ``tp_size``/``version`` None: read from ``GET /get_server_info``."""

    url: str
    tp_size: int | None = None
    version: str | None = None


@dataclass(kw_only=True)
class WeightSyncConfig:
    bucket_bytes: int = 256 << 20
    """Largest flattened bucket (bytes); a larger tensor travels alone."""
    dtype: torch.dtype | None = torch.bfloat16
    """Floating tensors are sent in this dtype (fp32 masters are cast while packing); None: as is."""
    load_format: str | None = "flattened_bucket"
    """"flattened_bucket" (one broadcast per bucket) or None (one broadcast per tensor)."""
    group_name: str = "weight_update_group"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    """TCP store port on trainer rank 0; 0 picks a free one."""
    backend: str | None = None
    """"nccl" or "gloo"; None: nccl when the tensors are on CUDA, else gloo."""
    timeout_s: float = 600.0
    """Limit for each HTTP call and for the group rendezvous / broadcasts."""
    api_key: str | None = None
    flush_cache: bool = True
    save_root: str | None = None
    """DiskWeightSync: parent directory of the temporary checkpoint (None: the system temp dir)."""

    def __post_init__(self):
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} must be > 0")
        if self.load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format={self.load_format!r}; use 'flattened_bucket' or None")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}; use 'nccl', 'gloo' or None")




def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 600.0):
    """A process group outside the default one, created exactly as SGLang's
    ``init_custom_process_group`` does (tcp rendezvous, ``PrefixStore(group_name, store)``,
    ``_new_process_group_helper``) so both sides agree on every store key."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo" and init_method.startswith("tcp://127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback rendezvous: gloo must bind lo too
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _as_targets(servers) -> list[ServerTarget]:
    out = []
    for s in servers:
        out.append(s if isinstance(s, ServerTarget) else ServerTarget(url=str(s)))
    if not out:
        raise ValueError("weight sync needs at least one server")
    return out


def _supports_begin_end(version: str | None) -> bool:
    try:
        return version is not None and Version(version) >= V_BEGIN_END
    except InvalidVersion:
        return True  # dev builds ("0.5.23.dev1+g..." parse; anything else: assume new)


class WeightSync(abc.ABC):
    """Interface of every transport. All methods are collective over the trainer group."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None):
        self.servers = _as_targets(servers)
        self.config = config or WeightSyncConfig()
        self.group = group
        self.version: str | None = None
        self._http: HttpPool | None = None
        self._info_read = False

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @property
    def http(self) -> HttpPool:
        if self._http is None:
            self._http = HttpPool(max(4, 2 * len(self.servers)), self.config.timeout_s, self.config.api_key)
        return self._http

    def _read_server_info(self) -> None:
        if self._info_read:
            return
        missing = [s for s in self.servers if s.tp_size is None or s.version is None]
        infos = self.http.all([s.url for s in missing], "/get_server_info", method="GET") if missing else []
        for s, info in zip(missing, infos):
            s.tp_size = int(info.get("tp_size", 1)) if s.tp_size is None else s.tp_size
            s.version = str(info.get("version", "")) if s.version is None else s.version
        self._info_read = True

    def connect(self) -> None:  # noqa: B027 - optional hook
        """Prepare the transport (idempotent)."""

    @abc.abstractmethod
    def _send(self, model_or_state, version: str) -> None:
        """Rank 0 raises on failure; other ranks only contribute their shards."""

    def update(self, model_or_state, version) -> None:
        """Send the weights of ``model_or_state`` (nn.Module, FSDP2 or plain, or a state dict) and set
        every server's weight_version to ``str(version)``. Raises WeightSyncError on every rank if
        any server failed; ``self.version`` changes only on success."""
        version = str(version)
        self.connect()
        err = None
        try:
            self._send(model_or_state, version)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then raised
            err = e
        msg = [None if err is None else f"{type(err).__name__}: {err}"]
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(msg, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        if err is not None:
            if isinstance(err, WeightSyncError):
                raise err
            raise WeightSyncError(f"weight update to version {version} failed: {msg[0]}") from err
        if msg[0] is not None:
            raise WeightSyncError(f"weight update to version {version} failed on trainer rank 0: {msg[0]}")
        self.version = version

    def _begin(self) -> list[ServerTarget]:
        begun = [s for s in self.servers if _supports_begin_end(s.version)]
        if begun:
            self.http.all([s.url for s in begun], "/begin_weight_update", {"selector": "all"})
        return begun

    def _end(self, begun: list[ServerTarget]) -> None:
        if begun:
            self.http.all([s.url for s in begun], "/end_weight_update", {})

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()


class _PendingSend:
    """Broadcast work handles + the servers' HTTP answers for one bucket."""

    def __init__(self, futs: list[tuple[str, Future]], works: list, timeout_s: float, what: str):
        self.futs, self.works, self.timeout_s, self.what = futs, works, timeout_s, what

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for _url, f in self.futs:  # a server that failed early: do not wait for its broadcast
                if f.done() and f.exception() is not None:
                    raise f.exception()
            if all(w.is_completed() for w in self.works) and all(f.done() for _, f in self.futs):
                break
            if time.monotonic() > deadline:
                late = [u for u, f in self.futs if not f.done()]
                raise WeightSyncError(f"{self.what}: no answer within {self.timeout_s}s from {late or 'the group'}")
            time.sleep(POLL_S)
        for w in self.works:
            w.wait()
        for _, f in self.futs:
            f.result()


class DistributedWeightSync(WeightSync):
    """SGLang's distributed update protocol (see the module docstring)."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None,
                 device: torch.device | None = None):
        super().__init__(servers, config, group)
        self.device = device
        self.pg = None
        self.world_size = None
        self.n_inits = 0
        self._gatherer = BucketGatherer(self.config.bucket_bytes, group, device)
        self._broken: str | None = None

    def _backend(self) -> str:
        if self.config.backend:
            return self.config.backend
        if self.device is not None:
            return "nccl" if torch.device(self.device).type == "cuda" else "gloo"
        return "nccl" if torch.cuda.is_available() else "gloo"

    def connect(self) -> None:
        if self.pg is not None or self.rank != 0:
            return
        cfg = self.config
        self._read_server_info()
        self.world_size = 1 + sum(s.tp_size for s in self.servers)
        port = cfg.master_port or free_port(cfg.master_addr)
        backend = self._backend()
        futs, offset = [], 1
        for s in self.servers:
            body = {"master_address": cfg.master_addr, "master_port": port, "rank_offset": offset,
                    "world_size": self.world_size, "group_name": cfg.group_name, "backend": backend}
            futs.append((s.url, self.http.submit(s.url, "/init_weights_update_group", body)))
            offset += s.tp_size
        box: dict = {}

        def own_init():
            try:
                box["pg"] = init_custom_process_group(backend, f"tcp://{cfg.master_addr}:{port}", self.world_size, 0,
                                                      cfg.group_name, cfg.timeout_s)
            except Exception as e:  # noqa: BLE001
                box["err"] = e

        th = threading.Thread(target=own_init, name="weight-group-init", daemon=True)
        th.start()
        deadline = time.monotonic() + cfg.timeout_s
        while th.is_alive() or not all(f.done() for _, f in futs):
            for _url, f in futs:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weight update group rendezvous timed out after {cfg.timeout_s}s")
            time.sleep(0.005)
        if "err" in box:
            raise WeightSyncError(f"trainer side of the weight update group failed: {box['err']}") from box["err"]
        for _, f in futs:
            f.result()
        self.pg = box["pg"]
        self.n_inits += 1

    def _send(self, model_or_state, version: str) -> None:
        src = collect_sources(model_or_state, self.group)
        dtypes = send_dtypes(src, self.config.dtype)
        if self.rank != 0:
            self._gatherer.run(src, dtypes, None)
            return
        if self._broken:
            raise WeightSyncError(f"the weight update group is unusable after an earlier failure ({self._broken}); "
                                  "close() and create a new DistributedWeightSync")
        begun = self._begin()
        try:
            self._gatherer.run(src, dtypes, lambda b: self._send_bucket(b, version))
        except Exception as e:
            self._broken = str(e)[:200]
            raise
        self._end(begun)

    def _send_bucket(self, bucket: Bucket, version: str) -> _PendingSend:
        cfg = self.config
        body = {"names": bucket.names, "dtypes": [str(d).removeprefix("torch.") for d in bucket.dtypes],
                "shapes": [list(s) for s in bucket.shapes], "group_name": cfg.group_name,
                "flush_cache": cfg.flush_cache, "abort_all_requests": False, "weight_version": version,
                "load_format": cfg.load_format}
        what = f"bucket {bucket.index} ({len(bucket.names)} tensors, {bucket.names[0]} .. {bucket.names[-1]})"
        futs = [(s.url, self.http.submit(s.url, "/update_weights_from_distributed", body, what=what))
                for s in self.servers]
        if cfg.load_format == "flattened_bucket":
            _check_unpadded(bucket)
            works = [dist.broadcast(bucket.data, src=0, group=self.pg, async_op=True)]
        else:
            works = [dist.broadcast(bucket.tensor(i), src=0, group=self.pg, async_op=True)
                     for i in range(len(bucket.names))]
        return _PendingSend(futs, works, cfg.timeout_s, what)

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.http.all([s.url for s in self.servers], "/destroy_weights_update_group",
                              {"group_name": self.config.group_name})
            except WeightSyncError:
                pass  # best effort: the servers may be gone already
            dist.destroy_process_group(self.pg)
            self.pg = None
        super().close()


# ------------------------------------------------------------------------------------------- disk
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.uint8: "U8", torch.int8: "I8",
              torch.bool: "BOOL"}


def write_safetensors(path: str, bucket: Bucket) -> None:
    """Write one bucket as a safetensors file straight from the bucket bytes (no per-tensor copies)."""
    header, off, sizes = {}, 0, []
    for i, n in enumerate(bucket.names):
        nbytes = bucket.tensor(i).numel() * bucket.dtypes[i].itemsize
        sizes.append(nbytes)
        header[n] = {"dtype": _ST_DTYPES[bucket.dtypes[i]], "shape": list(bucket.shapes[i]),
                     "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    data = bucket.data.cpu().numpy()
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for a, nbytes in zip(bucket.offsets, sizes):  # tensors are contiguous in the file, not in the bucket
            f.write(memoryview(data[a : a + nbytes]))


class DiskWeightSync(WeightSync):
    """HF-layout safetensors written by trainer rank 0 + ``/update_weights_from_disk``.

    ``config_dir``: a checkpoint directory whose non-weight files (config.json, tokenizer...)
    are copied next to the weights, for servers that reload the model config."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None, config_dir: str | None = None,
                 keep: bool = False):
        super().__init__(servers, config, group)
        self.config_dir = config_dir
        self.keep = keep
        self.last_path: str | None = None
        self._gatherer = BucketGatherer(self.config.bucket_bytes, group)

    def _send(self, model_or_state, version: str) -> None:
        src = collect_sources(model_or_state, self.group)
        dtypes = send_dtypes(src, self.config.dtype)
        if self.rank != 0:
            self._gatherer.run(src, dtypes, None)
            return
        self._read_server_info()
        path = tempfile.mkdtemp(prefix=f"areal_weights_v{version}_", dir=self.config.save_root)
        self.last_path = path
        weight_map: dict[str, str] = {}

        class _Done:
            def wait(self):
                pass

        def write(bucket: Bucket):
            fname = f"model-{bucket.index + 1:05d}.safetensors"
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
            begun = self._begin()
            body = {"model_path": path, "load_format": None, "abort_all_requests": False,
                    "weight_version": version}
            self.http.all([s.url for s in self.servers], "/update_weights_from_disk", body)
            self._end(begun)
        finally:
            if not self.keep:
                shutil.rmtree(path, ignore_errors=True)


def _check_unpadded(bucket: Bucket) -> None:
    """SGLang unpacks a flattened bucket by laying the tensors back to back with no alignment
    padding. Our buckets align each tensor to its dtype size, which adds padding only when a
    bucket mixes dtypes in an unlucky order; refuse that rather than corrupt the weights."""
    end = 0
    for i, off in enumerate(bucket.offsets):
        if off != end:
            raise WeightSyncError(
                f"bucket {bucket.index}: tensor {bucket.names[i]!r} would need {off - end} bytes of alignment "
                "padding, which SGLang's flattened_bucket loader does not understand; send one dtype "
                "(WeightSyncConfig(dtype=torch.bfloat16)) or load_format=None")
        end = off + bucket.tensor(i).numel() * bucket.dtypes[i].itemsize
