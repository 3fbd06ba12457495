"""Rank 0 takes back a server it dropped, once it answers again (``elastic.pool_watch``).

The watchdog and a failed control call drop a server that does not answer (``docs/deadlines.md``).
A hung server may answer again (SIGCONT, a stall that ends, a slow network that recovers); a
server the run did not launch (``rollout.servers``) has no launcher to replace it, and a launched
one whose process lives stays in ``members.json``. Such a server is *wanted* but out of the pool:

- :class:`Rejoin` asks it the watchdog's liveness question (``GET /model_info`` answered within
  ``rollout.hang_timeout``: ``elastic.pool_watch.answers_again``, which says why not /health) with
  backoff, 2 s after the drop, then 4, 8, ... up to 30 s between tries;
- once it answers it is offered to the weight sync (``SyncMembership.offer``): it gets the next
  update in full, as a relaunched server does, and enters the pool only then. An offer refused
  because the server was withdrawn as unresponsive before an update (held for
  ``weights.membership.UNRESPONSIVE_HOLD_S``) is tried again at the next backoff step.

Probes run as tasks beside the follower loop, so a hung server costs the loop nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
FIRST_S = 2.0
MAX_S = 30.0


class Rejoin:
    """The dropped servers that the run still wants, each with its next probe time and backoff.

    ``probe(url) -> bool``: does it serve again (blocking: run in a thread). ``clock``: monotonic
    seconds (a test passes its own)."""

    def __init__(self, probe: Callable[[str], bool], clock: Callable[[], float] = time.monotonic,
                 first_s: float = FIRST_S, max_s: float = MAX_S):
        self.probe, self.clock, self.first_s, self.max_s = probe, clock, first_s, max_s
        self.waiting: dict[str, tuple[float, float]] = {}  # url -> (next probe time, current backoff)
        self.tasks: dict[str, asyncio.Task] = {}

    def track(self, url: str) -> None:
        """``url`` was dropped but is still wanted: probe it from ``first_s`` on."""
        if url not in self.waiting:
            self.waiting[url] = (self.clock() + self.first_s, self.first_s)
            log.info("server %s is out of the pool but still wanted: it is offered again once it answers", url)

    def forget(self, url: str) -> None:
        """Not wanted any more (left the members), or back in the pool or joining."""
        self.waiting.pop(url, None)
        task = self.tasks.pop(url, None)
        if task is not None:
            task.cancel()

    async def step(self, offer: Callable[[str], bool]) -> list[str]:
        """Start the probes that are due; offer each server whose probe answered. Returns the servers
        offered now."""
        now, offered = self.clock(), []
        for url, task in list(self.tasks.items()):
            if not task.done():
                continue
            del self.tasks[url]
            ok = not task.cancelled() and task.exception() is None and bool(task.result())
            if url not in self.waiting:
                continue
            if ok and offer(url):
                del self.waiting[url]
                offered.append(url)
                log.warning("server %s answers again: offered to the weight sync (it joins with the next "
                            "update, in full)", url)
                continue
            backoff = min(self.waiting[url][1] * 2, self.max_s)
            self.waiting[url] = (now + backoff, backoff)
        for url, (due, _) in self.waiting.items():
            if due <= now and url not in self.tasks:
                self.tasks[url] = asyncio.ensure_future(asyncio.to_thread(self.probe, url))
        return offered

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
