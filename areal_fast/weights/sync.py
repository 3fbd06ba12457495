"""The transport interface of the weight sync and what every transport shares: the calls to the servers,
the gathered send, the safetensors writer.

* :class:`WeightSync` - the interface (``update`` and ``close``, collective over the trainer ranks;
  only trainer rank 0 talks HTTP), the gather of this rank's shards and the all-ranks outcome;
* :class:`SyncCalls` - the transports' calls to the servers (``rollout.calls.BlockingCalls``), every
  failure a :class:`WeightSyncError` naming server and path;
* :func:`send_gathered` - the frame of a gathered send (every rank gathers, rank 0 sends);
* :func:`write_safetensors` - a bucket as an HF safetensors file.

The transports themselves speak one server's API and live with it: SGLang's broadcast, disk and
colocated updates in ``areal_fast/backends/sglang/weight_sync.py`` and ``colocated.py``, vLLM's in
``areal_fast/backends/vllm/transfer.py`` and ``disk.py``; a LoRA run's adapter updates in
``weights/lora_sync.py``. The controller's port (``weights/port.py``) builds the transport the layer
above chose. The protocols are described in ``docs/weight_sync.md``.
"""

from __future__ import annotations

import abc
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from areal_fast.rollout.calls import BlockingCalls, RequestError, RetryPolicy, ServerError, no_answer_errors
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.gather import Bucket, Sources, collect_sources, send_dtypes
from areal_fast.weights.group import (
    ServerFacts,
    init_custom_process_group,
)

__all__ = ["WeightSyncConfig", "SyncCalls", "WeightSync", "WeightSyncError", "ServerFacts", "init_custom_process_group",
           "send_gathered", "write_safetensors"]

log = logging.getLogger(__name__)
POLL_S = 0.0005  # broadcast/HTTP completion polling period (a bucket takes >= milliseconds)
# After every server answered a bucket (success or not), our side of its broadcast completes within
# milliseconds if every rank took part; 10 s is slack for a loaded 2-core host. Past that, a rank
# never joined and the group's collectives are out of step for good.
BROADCAST_GRACE_S = 10.0


def _urls(servers) -> list[str]:
    out = [str(s).rstrip("/") for s in servers]
    if not out:
        raise ValueError("weight sync needs at least one server")
    return out


class SyncCalls:
    """The weight sync's calls to the servers: ``rollout.calls.BlockingCalls`` (its event loop in a
    thread, so an update request is sent, *not awaited*, while rank 0 broadcasts), each call sent
    once within ``timeout_s`` with the run's key; every failure becomes a :class:`WeightSyncError`
    naming server and path, and SGLang's ``{"success": false, "message": ...}`` too."""

    def __init__(self, timeout_s: float = 600.0, api_key: str | None = None):
        self.timeout_s = timeout_s
        self.policy = RetryPolicy(timeout_s=timeout_s)
        self._calls = BlockingCalls(api_key=api_key)

    async def _one(self, calls, url: str, path: str, body: dict | None, method: str, what: str) -> dict:
        for_what = f" (for {what})" if what else ""
        try:
            answer = await calls.call(url, method, path, body, policy=self.policy)
        except (RequestError, ServerError) as e:  # SGLang answers a refused update with 400 + success=false
            detail = (e.body if isinstance(e.body, str) else json.dumps(e.body))[:500]
            hint = " (is the API key right? set AREAL_FAST_API_KEY or api_key=)" if e.status == 401 else ""
            raise WeightSyncError(f"{url}{path}: HTTP {e.status}: {detail}{hint}{for_what}", status=e.status) from None
        except no_answer_errors() as e:
            raise WeightSyncError(f"{url}{path}: request failed or timed out after {self.timeout_s}s: "
                                  f"{type(e).__name__}: {e}{for_what}") from None
        if answer is None:
            return {}
        if isinstance(answer, str):  # not JSON
            return {"message": answer[:500]}
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"{url}{path} failed{' for ' + what if what else ''}: {answer.get('message', '')}")
        return answer

    def submit(self, url: str, path: str, body: dict | None = None, method: str = "POST", what: str = "") -> Future:
        """The call started now; its Future (a dict, or WeightSyncError)."""
        return self._calls.run(lambda calls: self._one(calls, url, path, body, method, what))

    def call(self, url: str, path: str, body: dict | None = None, method: str = "POST", what: str = "") -> dict:
        return self.submit(url, path, body, method, what).result()

    def each(self, urls: list[str], path: str, body: dict | None = None, method: str = "POST"
             ) -> list[tuple[str, dict | None, WeightSyncError | None]]:
        """Call every server and wait for all: ``(url, answer, None)`` or ``(url, None, error)``."""
        futs = [(u, self.submit(u, path, body, method)) for u in urls]
        out = []
        for u, f in futs:
            try:
                out.append((u, f.result(), None))
            except WeightSyncError as e:
                out.append((u, None, e))
        return out

    def all(self, urls: list[str], path: str, body: dict | None = None, method: str = "POST") -> list[dict]:
        """Call every server, wait for all, raise the first error (after every call finished)."""
        res = self.each(urls, path, body, method)
        for _u, _a, err in res:
            if err is not None:
                raise err
        return [a for _u, a, _e in res]

    def close(self) -> None:
        self._calls.close()


class WeightSync(abc.ABC):
    """Interface of every transport. ``update`` and ``close`` are collective over the trainer group."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None):
        self.urls = _urls(servers)
        self.config = config or WeightSyncConfig()
        self.group = group
        self.version: str | None = None
        self.facts: dict[str, ServerFacts] = {}
        self._http: SyncCalls | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @property
    def http(self) -> SyncCalls:
        if self._http is None:
            self._http = SyncCalls(self.config.timeout_s, self.config.resolved_api_key)
        return self._http

    def connect(self) -> None:  # noqa: B027 - optional hook
        """Prepare the transport (idempotent)."""

    def _collect(self, model_or_state) -> tuple[Sources, list[torch.dtype]]:
        """What this rank contributes: its (shards of the) tensors and the dtypes they are sent in."""
        src = collect_sources(model_or_state, self.group)
        device_type = src.local[0].device.type if src.local else "cpu"
        return src, send_dtypes(src, self.config.send_dtype(device_type))

    @abc.abstractmethod
    def _send(self, prepared, version: str) -> None:
        """Rank 0 sends ``prepared`` (from :meth:`_collect`) and raises on failure; other ranks only
        contribute their shards."""

    def update(self, model_or_state, version) -> None:
        """Send the weights of ``model_or_state`` (nn.Module, FSDP2 or plain, or a state dict) and set
        every server's weight_version to ``str(version)``. Raises WeightSyncError on every rank if
        any server failed; ``self.version`` changes only on success."""
        version = str(version)
        err = None
        try:
            self._send(self._collect(model_or_state), version)
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

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def send_gathered(sync, src: Sources, dtypes: list[torch.dtype], group: str,
                  push: Callable[[Callable[[], None]], None]) -> None:
    """The frame of a gathered send (every trainer rank gathers the buckets, rank 0 sends them), shared
    by the distributed transports. Ranks other than 0 only take part in the gather. Rank 0 refuses
    when ``sync``'s ``group`` was marked broken, then runs ``push(begin)``, which calls ``begin()``
    once the servers' update started and rank 0 gathers as it sends. When ``push`` fails before that,
    rank 0 still takes part in the gather (sending nothing), so the other ranks are not left waiting."""
    if sync.rank != 0:
        sync._gatherer.run(src, dtypes, None)
        return
    started = False

    def begin() -> None:
        nonlocal started
        started = True

    try:
        if sync._broken:
            raise WeightSyncError(f"the {group} is unusable after an earlier failure ({sync._broken}); "
                                  f"close() and create a new {type(sync).__name__}")
        push(begin)
    except Exception:
        if not started and src.n_ranks > 1:
            sync._gatherer.run(src, dtypes, None)  # the other ranks are gathering: take part, send nothing
        raise


# ------------------------------------------------------------------------------------------- disk
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.uint8: "U8", torch.int8: "I8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


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
        f.flush()
        os.fsync(f.fileno())  # the servers read it next, maybe from another machine's view of the file system
