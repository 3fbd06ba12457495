"""The controller's sync port (``SyncPort.sync(version)``) over a weight-sync transport.

* :class:`DistributedSync` - a broadcast transport; when the servers of an update change (a member
  died, a server joins or leaves) the broadcast group is formed again over the new ones
  (``weights.membership``), so the run stays on the broadcast.
* :class:`DiskSync` - a disk transport on the servers still in the pool.

The transport speaks the servers' API, so it is the layer above's choice, passed in as a class
(``transport``: a :class:`~areal_fast.weights.sync.WeightSync` subclass, built as
``transport(urls, config)`` on every trainer rank): ``areal_fast.backends.registry.weight_transport``
maps the run's API and ``weights.method`` to SGLang's or vLLM's. This package names no backend.

Both send to the pool's servers and to the servers waiting to join (``offer(url)``: relaunched or
added mid-run, ``docs/elastic.md``); a joining server enters the pool only once it holds the new
version. A server whose process is gone is dropped and the update retried on the others
(``rollout.calls.retry_dropping_dead``). Each update's metrics name the servers in the pool after
it (``servers``: ``sync/servers`` in metrics.jsonl), those that joined, those still waiting and the
group's generation, and ``empty_pool_s``: seconds the pool was empty since the last update's
metrics (``elastic.empty_pool``). An update with no server at all (an empty pool, nobody joining)
sends nothing; the server that joins next gets the current version in full.

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

from areal_fast.rollout.calls import DEAD_SERVER_RETRY, retry_dropping_dead
from areal_fast.weights.config import WeightSyncConfig, default_method
from areal_fast.weights.membership import UNRESPONSIVE_HOLD_S, SyncMembership

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
    """The rollout side: which servers are in the pool, which died, dropping one and adding one."""

    @property
    def urls(self) -> list[str]: ...
    def is_dead(self, url: str) -> bool: ...
    def remove_server(self, url: str) -> bool: ...
    async def add_server(self, url: str) -> None: ...


@dataclass(frozen=True)
class SyncSpec:
    """One transport, as a hashable, picklable value that every trainer rank can build."""

    method: str
    urls: tuple[str, ...]
    config: tuple[tuple[str, object], ...]  # WeightSyncConfig fields as (name, value) pairs
    extra: tuple[tuple[str, object], ...] = ()  # an adapter-only update's LoRA settings (weights/lora_sync.py)
    transport: type | None = None  # the WeightSync class built on every rank (picklable by reference)

    @classmethod
    def of(cls, method: str, urls, config: WeightSyncConfig, transport: type | None = None) -> SyncSpec:
        items = tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
        return cls(method, tuple(str(u).rstrip("/") for u in urls), items, transport=transport)

    def weight_config(self) -> WeightSyncConfig:
        return WeightSyncConfig(**dict(self.config))

    def build(self):
        """The transport of this spec, built on every trainer rank: the adapter-only updates of a
        LoRA run (``weights/lora_sync.py``), else ``transport(urls, config)``."""
        if self.method == "lora":
            from areal_fast.weights.lora_sync import transport_of_spec

            return transport_of_spec(self)
        if self.transport is None:
            raise ValueError(f"SyncSpec({self.method!r}): no transport given (the layer above passes the servers' "
                             "one: areal_fast.backends.registry.weight_transport)")
        return self.transport(list(self.urls), self.weight_config())


class _MembershipSync:
    """What both ports share: the servers of an update (:class:`SyncMembership`: the pool plus the
    joining servers), the one dead-server policy around an update, and the joining servers
    admitted to the pool once they hold the new version."""

    method = ""

    def __init__(self, trainer: WeightTrainer, rollout: ServerPool, config: WeightSyncConfig | None = None,
                 membership: SyncMembership | None = None, transport: type | None = None):
        self.trainer, self.rollout = trainer, rollout
        self.transport = transport
        self.config = dataclasses.replace(config or WeightSyncConfig(), method=self.method)
        self.membership = membership or SyncMembership(rollout, self.config.group_name)

    def offer(self, url: str) -> bool:
        """A healthy server that wants in: it gets the next update in full, then enters the pool."""
        return self.membership.offer(url)

    def _spec(self, urls: list[str]) -> SyncSpec:
        return SyncSpec.of(self.method, urls, self.config, self.transport)

    async def _withdraw_unresponsive_joiners(self) -> None:
        """A joining server that fails its liveness check (dead, or hung: SIGSTOPped) is withdrawn
        before the update and not taken back for ``UNRESPONSIVE_HOLD_S``: it costs the update one
        liveness deadline (``rollout.hang_timeout``), not the update's own (``weights.timeout_s``),
        and not at every update while the launcher keeps offering it."""
        joining = list(self.membership.joining)
        if not joining:
            return
        verdicts = await asyncio.gather(*(asyncio.to_thread(self.rollout.is_dead, u) for u in joining))
        for url, gone in zip(joining, verdicts):
            if gone:
                log.warning("server %s does not answer (dead or hung): not joined; offers refused for %.0f s",
                            url, UNRESPONSIVE_HOLD_S)
                self.membership.withdraw(url, hold_s=UNRESPONSIVE_HOLD_S)

    async def sync(self, version: int) -> dict:
        m = self.membership
        sent: list[str] = []
        await self._withdraw_unresponsive_joiners()

        async def once() -> dict:
            sent[:] = m.targets()
            if not sent:  # an empty pool, nobody joining: a server that joins gets this version in full
                log.warning("weight sync to version %d: no server in the pool or joining; sent to none", version)
                return {}
            t0 = time.perf_counter()
            await asyncio.to_thread(self.trainer.update_weights, self._spec(sent), version)
            return {self.timer: time.perf_counter() - t0}

        out = await retry_dropping_dead(once, m.targets, self.rollout.is_dead, m.drop,
                                        f"weight sync to version {version}", DEAD_SERVER_RETRY)
        joined = await m.admit(sent)
        return {**out, "servers": len(self.rollout.urls), "joined": len(joined), "joining": len(m.joining),
                "group_generation": m.generation, "empty_pool_s": m.take_empty_s()}


class DiskSync(_MembershipSync):
    """SyncPort: HF safetensors under ``work_dir``, loaded by every live server (and the joining ones)
    through the disk ``transport``."""

    method, timer = "disk", "disk_sync_s"

    def __init__(self, trainer: WeightTrainer, rollout: ServerPool, work_dir, config: WeightSyncConfig | None = None,
                 membership: SyncMembership | None = None, transport: type | None = None):
        self.work_dir = Path(work_dir)
        config = dataclasses.replace(config or WeightSyncConfig(), save_root=str(self.work_dir))
        super().__init__(trainer, rollout, config, membership, transport)

    async def sync(self, version: int) -> dict:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        return await super().sync(version)


class DistributedSync(_MembershipSync):
    """SyncPort over the broadcast transport. When the servers of an update change (one died, one
    joins, one was removed) the group is formed again over the new ones under the next generation's
    name (``weights.membership``): an update that failed because a member died is retried at once
    on a group without it, and the run stays on the broadcast."""

    method, timer = "distributed", "broadcast_s"

    def _spec(self, urls: list[str]) -> SyncSpec:
        name = self.membership.group_for(urls)
        return SyncSpec.of(self.method, urls, dataclasses.replace(self.config, group_name=name), self.transport)


def make_sync_port(config: WeightSyncConfig, trainer: WeightTrainer, rollout: ServerPool, work_dir, *,
                   transport: type):
    """The sync port the run's ``weights:`` section asks for (``weights.method``), over ``transport``
    (the servers' transport of that method: ``areal_fast.backends.registry.weight_transport``). A LoRA
    run's port is ``weights.lora_port.LoRASync``."""
    if (config.method or default_method(lora=False)) == "distributed":
        return DistributedSync(trainer, rollout, config, transport=transport)
    return DiskSync(trainer, rollout, work_dir, config, transport=transport)
