"""The controller's sync port of a LoRA run (``train.lora``): adapter-only updates
(``weights/lora_sync.py``) to every live server and the joining ones, with the pool membership and
the dead-server policy of the other ports (``weights/port.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.lora_sync import spec_extra
from areal_fast.weights.port import SyncSpec, _MembershipSync

__all__ = ["LoRASync"]


class LoRASync(_MembershipSync):
    """SyncPort of a LoRA run: adapter-only updates (:class:`LoRAAdapterSync`) to every live server
    and the joining ones (a joining server gets the current adapter, then enters the pool)."""

    method, timer = "disk", "adapter_sync_s"

    def __init__(self, trainer, rollout, work_dir, config: WeightSyncConfig | None = None, *, lora,
                 transport: type, base_model: str | None = None, membership=None):
        """``transport``: the servers' ``LoRAAdapterSync`` subclass (``backends.registry.lora_transport``)."""
        self.work_dir = Path(work_dir)
        config = dataclasses.replace(config or WeightSyncConfig(), save_root=str(self.work_dir))
        super().__init__(trainer, rollout, config, membership, transport)
        self.lora = lora
        self._extra = spec_extra(lora, base_model)

    def _spec(self, urls: list[str]) -> SyncSpec:
        return SyncSpec("lora", tuple(str(u).rstrip("/") for u in urls),
                        SyncSpec.of("disk", urls, self.config).config, self._extra, self.transport)

    async def sync(self, version: int) -> dict:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        return await super().sync(version)
