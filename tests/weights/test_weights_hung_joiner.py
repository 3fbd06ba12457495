"""A joining server that hangs (found by bench/bench_chaos.py: a SIGSTOPped member stays in
members.json, its process alive, so rank 0 offers it again after the watchdog dropped it): the sync
port withdraws it after one liveness check instead of waiting ``weights.timeout_s`` on it at every
update, and refuses its offers for ``UNRESPONSIVE_HOLD_S``."""

from __future__ import annotations

import asyncio

from fakes import UpdateRecordingTrainer

from areal_fast.weights import membership
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.port import DistributedSync

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


class Pool:
    def __init__(self, urls, hung=()):
        self._urls, self.hung = list(urls), set(hung)

    @property
    def urls(self):
        return list(self._urls)

    def is_dead(self, url):  # the rollout port's verdict: refused, or no answer within hang_timeout
        return url in self.hung

    def remove_server(self, url):
        self._urls.remove(url)
        return True

    async def add_server(self, url):
        self._urls.append(url)


def test_a_hung_joiner_is_never_sent_an_update_and_its_offers_are_held():
    pool = Pool([A, B], hung=[C])
    # an update that includes the hung server would wait weights.timeout_s on it, then fail
    trainer = UpdateRecordingTrainer(
        lambda spec: TimeoutError(f"{C} did not answer") if C in spec.urls and C in pool.hung else None)
    sync = DistributedSync(trainer, pool, config=WeightSyncConfig())
    asyncio.run(sync.sync(1))
    assert sync.offer(C)  # the launcher offers it: its process is alive
    asyncio.run(sync.sync(2))
    assert [s.urls for s, _ in trainer.calls] == [(A, B), (A, B)], "an update waited on the hung joiner"
    assert sync.membership.joining == [] and pool.urls == [A, B]
    assert not sync.offer(C), "offered again at once: every update would wait on it"
    assert sync.membership.held[C] > membership.time.monotonic() + membership.UNRESPONSIVE_HOLD_S - 30
    sync.membership.held[C] -= membership.UNRESPONSIVE_HOLD_S  # the hold ran out
    pool.hung.clear()  # SIGCONT: it answers again and may join after the hold
    assert sync.offer(C)
    asyncio.run(sync.sync(3))
    assert trainer.calls[-1][0].urls == (A, B, C) and pool.urls == [A, B, C]
