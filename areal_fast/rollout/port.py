"""The controller's rollout port over the rollout client (:class:`ClientRollout`).

``areal_fast.controller`` asks a rollout port for one sample at a time (``generate``) and for
``pause`` / ``resume`` around a weight update; :class:`ClientRollout` answers with
``areal_fast.rollout.client.RolloutClient`` and forgets a server whose process died.
``areal_fast.rollout.sharded.ShardedRollout`` is the same port over client worker processes.
"""

from __future__ import annotations

import asyncio
import logging
import time

from areal_fast.sample import Sample

log = logging.getLogger(__name__)
_DEATH_VISIBLE_S = 3.0  # how long a failed control call waits for a server's death to show


class ClientRollout:
    """RolloutPort over ``RolloutClient``; knows how to forget a dead server.

    Control calls (pause, continue, weight updates) go to every server; when one fails, the
    servers whose process is gone (``is_dead(url)``) are dropped and the call is retried on the
    others. A failure with every server alive is re-raised."""

    def __init__(self, client, is_dead=None):
        self.client = client
        self.is_dead = is_dead or (lambda url: False)

    async def control(self, fn, what: str, attempts: int = 3):
        """Run ``await fn()`` (a call on all servers), dropping dead servers between attempts."""
        for attempt in range(attempts):
            try:
                return await fn()
            except Exception as e:  # noqa: BLE001 - a dead server is dropped, anything else re-raised
                # a connection reset can arrive a moment before the process is seen to exit
                deadline = time.monotonic() + _DEATH_VISIBLE_S
                dead = [u for u in self.urls if self.is_dead(u)]
                while not dead and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    dead = [u for u in self.urls if self.is_dead(u)]
                if not dead or attempt == attempts - 1:
                    raise RuntimeError(f"{what} failed: {e!r}") from e
                for u in dead:
                    log.warning("%s: server %s died; continuing with the others", what, u)
                    self.remove_server(u)

    async def generate(self, input_ids, sampling, rid) -> Sample:
        """The client's sample itself (the one record: nothing is converted on the way)."""
        return await self.client.generate(input_ids, sampling, rid=rid)  # any int sequence, not copied

    async def pause(self) -> None:
        await self.control(self.client.pause_all, "pause_generation")

    async def resume(self) -> None:
        await self.control(self.client.continue_all, "continue_generation")

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.client.servers]

    def remove_server(self, url: str) -> bool:
        """Drop ``url`` from the pool (requests in flight there are retried elsewhere by the client)."""
        url = url.rstrip("/")
        if url in self.urls and len(self.client.servers) == 1:
            raise RuntimeError(f"the last inference server {url} died; cannot continue")
        return self.client.remove_server(url)
