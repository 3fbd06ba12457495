"""The controller's sync port (``SyncPort.sync(version)``) over the transports of this package.

* :class:`DistributedSync` - :class:`~areal_fast.weights.sync.DistributedWeightSync`; when a
  server of the broadcast group dies the group is unusable, and the port falls back to
  :class:`DiskSync` for the rest of the run (the servers left keep getting every version).
* :class:`DiskSync` - :class:`~areal_fast.weights.sync.DiskWeightSync` on the servers still in
  the pool; a server whose process is gone is dropped and the update retried on the others.

The version is the controller's (``sync(version)``); it only travels down from here: every
trainer rank takes part in an update (the gathers of FSDP2 shards are collective), so the port
does not call a transport itself: it hands a :class:`SyncSpec` and the version to the trainer's
public ``update_weights(spec, version)``, which announces them to the other ranks and runs the
transport that :meth:`SyncSpec.build` makes on every rank (``areal_fast.launch.runtime``); the
transport labels the servers' weights with the version. Each rank keeps its own transport per
spec, so the weight group is created once and reused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from areal_fast.rollout.calls import DEAD_SERVER_RETRY, dead_servers, retry_dropping_dead
from areal_fast.weights.config import WeightSyncConfig

__all__ = ["SyncSpec", "DistributedSync", "DiskSync", "make_sync_port", "WeightTrainer",
           "ServerPool"]

log = logging.getLogger(__name__)
# A failed update is retried without the servers whose process is gone (rollout.calls.DEAD_SERVER_RETRY:
# up to 3 attempts; a failure waits up to 3 s for a death to show, a reset arrives before the exit).


class WeightTrainer(Protocol):
    def update_weights(self, spec: SyncSpec, version: int) -> None:
        """Update the servers in ``spec`` to the weights of ``version``: every trainer rank runs the
        transport ``spec.build()`` makes (kept per spec) on its shards."""


class ServerPool(Protocol):
    """The rollout side: which servers are in the pool, which died, and dropping one."""

    @property
    def urls(self) -> list[str]: ...
    def is_dead(self, url: str) -> bool: ...
    def remove_server(self, url: str) -> bool: ...


@dataclass(frozen=True)
class SyncSpec:
    """One transport, as a hashable, picklable value that every trainer rank can build."""

    method: str
    urls: tuple[str, ...]
    config: tuple[tuple[str, object], ...]  # WeightSyncConfig fields as (name, value) pairs

    @classmethod
    def of(cls, method: str, urls, config: WeightSyncConfig) -> SyncSpec:
        items = tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
        return cls(method, tuple(str(u).rstrip("/") for u in urls), items)

    def weight_config(self) -> WeightSyncConfig:
        return WeightSyncConfig(**dict(self.config))

    def build(self):
        from areal_fast.weights.sync import DiskWeightSync, DistributedWeightSync

        cls = {"distributed": DistributedWeightSync, "disk": DiskWeightSync}[self.method]
        return cls(list(self.urls), self.weight_config())


class DiskSync:
    """SyncPort: HF safetensors under ``work_dir`` + ``/update_weights_from_disk`` on every live server."""

    def __init__(self, trainer: WeightTrainer, rollout: ServerPool, work_dir, config: WeightSyncConfig | None = None):
        self.trainer, self.rollout = trainer, rollout
        self.work_dir = Path(work_dir)
        self.config = dataclasses.replace(config or WeightSyncConfig(), method="disk", save_root=str(self.work_dir))

    async def sync(self, version: int) -> dict:
        self.work_dir.mkdir(parents=True, exist_ok=True)

        async def once() -> dict:
            spec = SyncSpec.of("disk", self.rollout.urls, self.config)
            t0 = time.perf_counter()
            await asyncio.to_thread(self.trainer.update_weights, spec, version)
            return {"disk_sync_s": time.perf_counter() - t0}

        return await retry_dropping_dead(once, lambda: self.rollout.urls, self.rollout.is_dead,
                                         self.rollout.remove_server, f"weight sync to version {version}",
                                         DEAD_SERVER_RETRY)


class DistributedSync:
    """SyncPort over the broadcast transport, with the fallback to :class:`DiskSync` described above."""

    def __init__(self, trainer: WeightTrainer, rollout: ServerPool, urls, work_dir,
                 config: WeightSyncConfig | None = None):
        config = config or WeightSyncConfig()
        self.trainer, self.rollout = trainer, rollout
        self.spec = SyncSpec.of("distributed", urls, dataclasses.replace(config, method="distributed"))
        self.fallback = DiskSync(trainer, rollout, work_dir, config)
        self.broken = False

    def _removed(self) -> list[str]:
        live = set(self.rollout.urls)
        return [u for u in self.spec.urls if u not in live]

    def _gone(self, url: str) -> bool:
        """A member of the group that left the pool or died. ``is_dead`` may probe the server
        (a paused server can take seconds to answer), so it is asked only after a failure."""
        return url not in self.rollout.urls or self.rollout.is_dead(url)

    async def sync(self, version: int) -> dict:
        if self.broken:
            return await self.fallback.sync(version)
        t0 = time.perf_counter()
        try:
            if self._removed():  # a member of the broadcast group is gone: do not even start a broadcast
                raise RuntimeError(f"servers left the pool: {self._removed()}")
            await asyncio.to_thread(self.trainer.update_weights, self.spec, version)
        except Exception as e:  # noqa: BLE001 - re-raised unless a server died
            if not await dead_servers(self.spec.urls, self._gone, DEAD_SERVER_RETRY):
                raise
            log.warning("distributed weight sync impossible after a server died (%r); using disk sync from now on", e)
            self.broken = True
            return await self.fallback.sync(version)
        return {"broadcast_s": time.perf_counter() - t0}


def make_sync_port(config: WeightSyncConfig, trainer: WeightTrainer, rollout: ServerPool, urls, work_dir):
    """The sync port the run's ``weights:`` section asks for."""
    if config.method == "distributed":
        return DistributedSync(trainer, rollout, urls, work_dir, config)
    return DiskSync(trainer, rollout, work_dir, config)
