"""Rank 0 with an empty pool (``elastic.empty_pool``, ``docs/elastic.md``), with fakes: the watchdog
drops the last server when one can come back and waits, fails past ``rollout.empty_pool_timeout``
(naming it) or at once when nothing can come back; a server that joins the empty pool gets the
current version at once, never inside a step's train and sync; an update with no server sends
nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from fakes import ServerListPool as Pool
from fakes import UpdateRecordingTrainer, make_controller

from areal_fast.config import load_config
from areal_fast.elastic.empty_pool import EmptyPool, refill_empty_pool
from areal_fast.elastic.members import Member, write_members
from areal_fast.launch import rank
from areal_fast.netutil import find_free_port
from areal_fast.weights import port
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.membership import SyncMembership
from areal_fast.weights.port import DistributedSync

B = "http://127.0.0.1:2"


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(rank, "_WATCH_S", 0.01)
    monkeypatch.setattr(port, "DEAD_SERVER_RETRY", dataclasses.replace(port.DEAD_SERVER_RETRY, deadline_s=0.2))


def _dead() -> str:
    return f"http://127.0.0.1:{find_free_port('127.0.0.1')}"


async def _until(cond, timeout_s: float = 10.0):
    async with asyncio.timeout(timeout_s):  # the watchdog of these tests
        while not cond():
            await asyncio.sleep(0.01)


def _lock_waiters(lock: asyncio.Lock) -> int:
    """The tasks waiting for ``lock`` (asyncio keeps them in ``_waiters``; no public count)."""
    return len(lock._waiters or ())


def test_the_last_dead_server_is_dropped_and_the_run_waits_until_one_joins(caplog):
    """Before: "the last inference server ... stopped answering" ended the run."""
    dead = _dead()
    pool = Pool([dead])
    membership = SyncMembership(pool)
    empty = EmptyPool(600.0, "logs", membership=membership)

    rounds = []  # the watchdog's rounds: each ends by telling ``empty`` the pool
    check = empty.check
    empty.check = lambda urls: rounds.append(list(urls)) or check(urls)

    async def run():
        task = asyncio.create_task(rank._watch_servers(pool, "logs", 5.0, empty))
        await _until(lambda: pool.removed)
        mark = len(rounds)
        await _until(lambda: len(rounds) >= mark + 10 or task.done())  # more rounds with the pool empty
        assert not task.done(), task  # the watchdog waits
        await pool.add_server(B)  # a replacement joined
        await _until(lambda: empty.since is None)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="areal_fast"):
        asyncio.run(run())
    assert pool.removed == [dead] and pool.urls == [B]
    said = caplog.text
    assert "pool is empty" in said and "rollout.empty_pool_timeout=600s" in said
    assert "refilled after" in said
    assert membership.empty_s > 0 and membership.take_empty_s() > 0 and membership.empty_s == 0


def test_an_empty_pool_nobody_refills_fails_naming_the_setting():
    dead = _dead()
    with pytest.raises(RuntimeError, match=r"rollout\.empty_pool_timeout=0\.3s.*see logs in logs"):
        asyncio.run(asyncio.wait_for(rank._watch_servers(Pool([dead]), "logs", 5.0, EmptyPool(0.3, "logs")), 20))


def test_nothing_can_come_back_fails_at_once_as_before():
    dead = _dead()
    empty = EmptyPool(600.0, "logs", can_come_back=lambda: False)
    with pytest.raises(RuntimeError, match=rf"last inference server {dead}.*see logs"):
        asyncio.run(asyncio.wait_for(rank._watch_servers(Pool([dead]), "logs", 5.0, empty), 20))
    # a pool emptied by someone else (a failed pause) while nothing can come back: failed at once too
    with pytest.raises(RuntimeError, match="relaunch_servers=false"):
        empty.check([])


@pytest.mark.parametrize("relaunch, launched, sharded, waits", [
    (True, True, False, True),     # relaunched in its slot
    (False, False, False, True),   # rollout.servers: offered back once it answers (elastic.rejoin)
    (False, True, False, False),   # nothing comes back: fail at once
    (True, True, True, False),     # the sharded client cannot wait for a server
])
def test_who_may_empty_the_pool(tmp_path, relaunch, launched, sharded, waits):
    cfg = load_config(None, [f"experiment.output_dir={tmp_path}", f"rollout.relaunch_servers={str(relaunch).lower()}",
                             "rollout.empty_pool_timeout=42"])
    if launched:
        write_members(cfg.experiment.out, [Member(name="server0", url=B, slot=0, pid=1)])
    pool = Pool([B])
    if sharded:
        del pool.allow_empty
    empty = rank.empty_pool(cfg, pool, DistributedSync(UpdateRecordingTrainer(), pool))
    assert empty.may_empty() is waits and getattr(pool, "allow_empty", False) is waits
    assert empty.timeout_s == (42.0 if waits else None)


def test_an_update_with_no_server_sends_nothing_and_a_joiner_then_gets_it_in_full(tmp_path):
    pool, trainer = Pool([]), UpdateRecordingTrainer()
    sync = DistributedSync(trainer, pool, config=WeightSyncConfig(timeout_s=5))
    sync.membership.empty_s = 2.5
    m = asyncio.run(sync.sync(3))  # the step's update while the pool is empty
    assert trainer.calls == [] and m["servers"] == 0 and m["empty_pool_s"] == 2.5
    assert sync.offer(B)
    m = asyncio.run(sync.sync(3))  # the refill: the same version, to the joiner
    assert [(s.urls, v) for s, v in trainer.calls] == [((B,), 3)] and pool.urls == [B] and m["joined"] == 1
    assert m["empty_pool_s"] == 0.0


def test_a_joiner_of_the_empty_pool_gets_the_current_version_at_once_never_during_a_step(tmp_path):
    ctl, _, _ = make_controller(tmp_path)
    pool, trainer = Pool([]), UpdateRecordingTrainer()
    ctl.syncer = DistributedSync(trainer, pool, config=WeightSyncConfig(timeout_s=5))
    ctl.version = 7

    async def run():
        refill = asyncio.create_task(refill_empty_pool(pool, ctl.syncer, ctl.sync_between_steps, every_s=0.01))
        async with ctl.trainer_lock:  # a step's train and sync runs: the refill waits for it
            ctl.syncer.offer(B)
            await _until(lambda: _lock_waiters(ctl.trainer_lock) == 1 or refill.done())
            assert trainer.calls == [] and pool.urls == [] and not refill.done()
            ctl.version = 8  # the step's version moves before the lock is released
        await _until(lambda: pool.urls)
        refill.cancel()
        await asyncio.gather(refill, return_exceptions=True)

    asyncio.run(run())
    assert [(s.urls, v) for s, v in trainer.calls] == [((B,), 8)]  # at once, at the current version


def test_a_refill_that_the_step_made_unneeded_sends_nothing(tmp_path):
    ctl, _, _ = make_controller(tmp_path)
    pool, trainer = Pool([]), UpdateRecordingTrainer()
    ctl.syncer = DistributedSync(trainer, pool, config=WeightSyncConfig(timeout_s=5))

    looked = []  # the refill's attempts that found the lock free, with what they sent

    async def sync_between_steps(still):
        looked.append(await ctl.sync_between_steps(still))
        return looked[-1]

    async def run():
        refill = asyncio.create_task(refill_empty_pool(pool, ctl.syncer, sync_between_steps, every_s=0.01))
        async with ctl.trainer_lock:
            ctl.syncer.offer(B)
            await _until(lambda: _lock_waiters(ctl.trainer_lock) == 1 or refill.done())  # the refill waits
            await ctl.syncer.sync(1)  # the step's own update admits the joiner
            ctl.version = 1
        await _until(lambda: looked or refill.done())  # the refill's look once the step ended
        refill.cancel()
        await asyncio.gather(refill, return_exceptions=True)

    asyncio.run(run())
    assert looked[:1] == [None]  # the refill found the pool full: it sent nothing
    assert [(s.urls, v) for s, v in trainer.calls] == [((B,), 1)]  # once, by the step


def test_the_last_server_that_left_the_members_leaves_a_pool_that_may_be_empty(tmp_path):
    from areal_fast.elastic.pool_watch import follow_members

    write_members(tmp_path, [])  # the launcher saw it die: out of the members
    for allow_empty in (False, True):
        pool = Pool([B])
        pool.allow_empty = allow_empty
        follow_members(pool, DistributedSync(UpdateRecordingTrainer(), pool), tmp_path)
        assert pool.urls == ([] if allow_empty else [B])  # before: kept until another joined
