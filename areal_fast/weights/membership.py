"""Who a weight update goes to, and when the broadcast group must be formed again.

The servers of a weight update are the rollout pool's, plus the servers *joining*: a server
relaunched after a death or added mid-run (``docs/elastic.md``) is offered here, gets the next
weight update in full with everyone else, and only then enters the pool: the client never routes
a request to a server that does not hold the current weights.

A broadcast group cannot change its members: a dead member leaves it unusable (a broadcast needs
every rank), and a new server cannot enter it. So every change of the servers of an update forms a
new group, under a new name: SGLang keeps each server's groups by name (``init_weights_update_group``
stores ``{group_name: pg}`` in every release from 0.5.6 to 0.5.23, and torch refuses a second group
of one name in a process until the first is destroyed), so a new name never collides with the
remains of the old group on a survivor, whose ``/destroy_weights_update_group`` is best effort
(the old group's transport is closed on every trainer rank when the new one is built:
``launch.runtime.apply_update``). Generation 0 keeps the configured name; generation g > 0 is
``<group_name>-g<g>``.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)
# A joiner that did not answer its liveness check before an update (hung: SIGSTOPped, deadlocked) is
# not taken back for this long: the launcher keeps offering a member whose process lives, and each
# offer would cost the next update one liveness deadline (rollout.hang_timeout).
UNRESPONSIVE_HOLD_S = 60.0

__all__ = ["ElasticPool", "SyncMembership", "group_name_of"]


class ElasticPool(Protocol):
    """The rollout side of a weight update's membership (``ClientRollout``, ``ShardedRollout``)."""

    @property
    def urls(self) -> list[str]: ...
    def is_dead(self, url: str) -> bool: ...
    def remove_server(self, url: str) -> bool: ...
    async def add_server(self, url: str) -> None: ...


def group_name_of(base: str, generation: int) -> str:
    """The broadcast group's name in ``generation`` (0: the configured name)."""
    return base if generation == 0 else f"{base}-g{generation}"


class SyncMembership:
    """The servers of the next weight update: the pool's, then the joining ones (in the order
    they were offered), and the generation of the broadcast group over them.

    ``group_for(urls)`` returns the group name for an update to ``urls``: the same while the
    servers stay the same, a new generation as soon as they differ from the last group's."""

    def __init__(self, pool: ElasticPool, base_group: str = "weight_update_group"):
        self.pool = pool
        self.base_group = base_group
        self.generation = 0
        self.joining: list[str] = []
        self.held: dict[str, float] = {}  # url -> monotonic time before which an offer is refused
        self._group_urls: tuple[str, ...] | None = None  # the servers of the current generation's group
        self.empty_s = 0.0  # seconds the pool was empty, not yet reported (elastic.empty_pool adds them)

    def take_empty_s(self) -> float:
        """The seconds the pool was empty since the last call (an update's ``empty_pool_s``)."""
        out, self.empty_s = self.empty_s, 0.0
        return out

    # ------------------------------------------------------------ who
    def offer(self, url: str) -> bool:
        """A server that wants in (healthy, maybe at old weights): it joins with the next update.
        False when it is in the pool or already waiting."""
        url = url.rstrip("/")
        if url in self.pool.urls or url in self.joining or self.held.get(url, 0.0) > time.monotonic():
            return False
        self.joining.append(url)
        log.info("server %s waits to join: it gets the next weight update in full, then requests", url)
        return True

    def withdraw(self, url: str, hold_s: float = 0.0) -> bool:
        """Forget a joining server (it died or was removed before it joined); ``hold_s`` > 0 refuses
        its offers for that long (an unresponsive one)."""
        url = url.rstrip("/")
        if hold_s > 0:
            self.held[url] = time.monotonic() + hold_s
        if url not in self.joining:
            return False
        self.joining.remove(url)
        return True

    def targets(self) -> list[str]:
        """The servers the next update goes to: the pool's, then the joining ones."""
        pool = list(self.pool.urls)
        return pool + [u for u in self.joining if u not in pool]

    def drop(self, url: str) -> None:
        """A server of an update that died: out of the joining list, or out of the pool."""
        if not self.withdraw(url):
            self.pool.remove_server(url)

    async def admit(self, urls) -> list[str]:
        """After an update to ``urls`` succeeded: the joining servers among them enter the pool."""
        done = [u for u in self.joining if u in set(urls)]
        for u in done:
            await self.pool.add_server(u)
            self.joining.remove(u)
            log.info("server %s joined the pool (generation %d of the weight group)", u, self.generation)
        return done

    # ------------------------------------------------------------ the group
    def group_for(self, urls) -> str:
        """The group name of an update to ``urls``: a new generation when they changed."""
        urls = tuple(urls)
        if self._group_urls is not None and urls != self._group_urls:
            self.generation += 1
            gone = sorted(set(self._group_urls) - set(urls))
            new = sorted(set(urls) - set(self._group_urls))
            log.warning("weight group re-formed as generation %d over %d server(s) (left: %s; joined: %s)",
                        self.generation, len(urls), gone or "none", new or "none")
        self._group_urls = urls
        return group_name_of(self.base_group, self.generation)
