"""Rank 0 waits for servers when its pool is empty (``docs/elastic.md``).

A whole pool can go at once (a preempted node pool, a crash that hits every server). When a server
can come back, the run waits for one instead of failing:

- a launched server is relaunched in its slot (``rollout.relaunch_servers``: ``elastic.supervisor``);
- a server of ``rollout.servers`` (not launched) is offered again once it answers (``elastic.rejoin``).

Then rank 0 drops the last server like any other (``launch.rank._watch_servers``, or a control call
that failed on it) and the pool is empty. Generation requests wait in the rollout client until a
server is back (``RolloutClient._wait_for_servers``; a segment in flight on the dead server fails
over into that wait, the tokens of earlier segments kept), so no sample is lost or made twice, and
the controller, which has no batch, does not step. A server that joins gets the weights of the
current version at once (:func:`refill_empty_pool`), not at the next step's update: that step needs
samples only it can make. The refill runs under the controller's ``trainer_lock``, so it never runs
during a step's train and sync or a checkpoint, and it labels the servers with the controller's
version (the per-token versions and the staleness gate stay right).

:class:`EmptyPool` is the watchdog's side: a warning when the pool empties and when it is refilled
(with how long it was empty, also reported as ``sync/empty_pool_s`` with the next update), and the
deadline ``rollout.empty_pool_timeout``, past which the run fails naming it. With launched servers
and ``rollout.relaunch_servers: false`` nothing can come back: the run fails at once, as it did
before. ``rollout.client_processes > 1`` (the sharded client) keeps that behaviour too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("areal_fast")
REFILL_EVERY_S = 0.5


class EmptyPool:
    """The watchdog's view of an empty pool. ``timeout_s``: ``rollout.empty_pool_timeout``, or None
    when no server can come back (the last one is never dropped; :meth:`may_empty`).
    ``can_come_back()``: asked when the pool is found empty (a launched run with relaunching off
    fails at once). ``membership``: its ``empty_s`` collects the seconds for the update's metrics."""

    def __init__(self, timeout_s: float | None, log_dir, can_come_back: Callable[[], bool] = lambda: True,
                 membership=None, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.log_dir, self.can_come_back = timeout_s, log_dir, can_come_back
        self.membership, self.clock = membership, clock
        self.since: float | None = None  # when the pool was found empty

    def may_empty(self) -> bool:
        """May the watchdog drop the last server of the pool?"""
        return self.timeout_s is not None and self.can_come_back()

    def check(self, urls) -> None:
        """One look at the pool's servers ``urls``: warn when it became empty or was refilled; raise
        past the deadline, or at once when nothing can come back."""
        now = self.clock()
        if urls:
            if self.since is not None:
                empty_s, self.since = now - self.since, None
                log.warning("the inference server pool was refilled after %.1f s empty (%d server(s)); "
                            "generation resumes", empty_s, len(urls))
                if self.membership is not None:
                    self.membership.empty_s += empty_s
            return
        if not self.may_empty():
            raise RuntimeError("the inference server pool is empty and no server can come back (launched servers "
                               f"with rollout.relaunch_servers=false); see logs in {self.log_dir}")
        if self.since is None:
            self.since = now
            log.warning("the inference server pool is empty: generation waits for a server (relaunched or "
                        "answering again) for up to rollout.empty_pool_timeout=%gs", self.timeout_s)
        elif now - self.since > self.timeout_s:
            raise RuntimeError(f"no inference server came back within rollout.empty_pool_timeout={self.timeout_s:g}s "
                               f"of the pool becoming empty; see logs in {self.log_dir}")


async def refill_empty_pool(rollout, syncer, sync_between_steps: Callable[..., Awaitable],
                            every_s: float = REFILL_EVERY_S, empty: EmptyPool | None = None) -> None:
    """Until cancelled: while the pool is empty and a server waits to join (``syncer.membership``),
    send the current version to it at once (``Controller.sync_between_steps``: it waits for a step's
    train and sync to end, and does nothing if the pool was refilled meanwhile); the joiner enters
    the pool once it holds the weights. A failed refill is logged and tried again. ``empty``: told
    at once, so that the next step's update reports the seconds the pool was empty."""
    membership = getattr(syncer, "membership", None)
    if membership is None:
        return

    def still() -> bool:
        return not rollout.urls and bool(membership.joining)

    while True:
        if still():
            try:
                out = await sync_between_steps(still)
                if out is not None:
                    log.warning("weights sent at once to %d server(s) that joined the empty pool (%s)",
                                out.get("joined", 0), ", ".join(rollout.urls) or "none entered")
                    if empty is not None:
                        empty.check(rollout.urls)
            except Exception:  # noqa: BLE001 - the next look tries again; empty_pool_timeout bounds it
                log.exception("sending the weights to servers joining the empty pool failed")
        await asyncio.sleep(every_s)
