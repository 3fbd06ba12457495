"""The controller's rollout port over the rollout client (:class:`ClientRollout`).

``areal_fast.controller`` asks a rollout port for one sample at a time (``generate``) and for
``pause`` / ``resume`` around a weight update; :class:`ClientRollout` answers with
``areal_fast.rollout.client.RolloutClient`` and forgets a server whose process died.
``areal_fast.rollout.sharded.ShardedRollout`` is the same port over client worker processes.
"""

from __future__ import annotations

import logging

from areal_fast.rollout.calls import DEAD_SERVER_RETRY, RetryPolicy, retry_dropping_dead
from areal_fast.sample import Sample

log = logging.getLogger(__name__)


class ClientRollout:
    """RolloutPort over ``RolloutClient``; knows how to forget a dead server.

    Control calls (pause, continue, weight updates) go to every server; when one fails, the
    servers whose process is gone (``is_dead(url)``) are dropped and the call is retried on the
    others. A failure with every server alive is re-raised."""

    def __init__(self, client, is_dead=None):
        self.client = client
        self.is_dead = is_dead or (lambda url: False)

    async def control(self, fn, what: str, policy: RetryPolicy = DEAD_SERVER_RETRY):
        """Run ``await fn()`` (a call on all servers), dropping dead servers between attempts
        (``rollout.calls.retry_dropping_dead``: the one dead-server policy)."""
        try:
            return await retry_dropping_dead(fn, lambda: self.urls, self.is_dead, self.remove_server, what, policy)
        except Exception as e:  # noqa: BLE001 - every server alive, or the last attempt
            raise RuntimeError(f"{what} failed: {e!r}") from e

    async def generate(self, input_ids, sampling, rid) -> Sample:
        """The client's sample itself (the one record: nothing is converted on the way)."""
        return await self.client.generate(input_ids, sampling, rid=rid)  # any int sequence, not copied

    async def pause(self) -> None:
        await self.control(self.client.pause_all, "pause_generation")

    async def resume(self) -> None:
        await self.control(self.client.continue_all, "continue_generation")

    @property
    def api_key(self) -> str | None:
        """The run's key, which the servers require (the agent endpoint requires it too)."""
        return getattr(self.client, "api_key", None)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.client.servers]

    @property
    def allow_empty(self) -> bool:
        """May the pool become empty? Rank 0 sets it when a dropped server can come back (relaunched,
        or offered again: ``elastic.empty_pool``); requests then wait for a server. False: dropping
        the last server is an error, as it was before."""
        return self.client.allow_empty

    @allow_empty.setter
    def allow_empty(self, value: bool) -> None:
        self.client.allow_empty = bool(value)

    def remove_server(self, url: str) -> bool:
        """Drop ``url`` from the pool (requests in flight there are retried elsewhere by the client,
        or wait for a server when it was the last: ``allow_empty``)."""
        url = url.rstrip("/")
        if url in self.urls and len(self.client.servers) == 1 and not self.allow_empty:
            raise RuntimeError(f"the last inference server {url} died; cannot continue")
        return self.client.remove_server(url)

    async def add_server(self, url: str) -> None:
        """Route requests to ``url`` from now on (a server that joined mid-run holding the current
        weights: ``weights.membership``)."""
        await self.client.add_server(url)
