"""Elastic servers without real servers (``launch.elastic``, ``launch.pool_watch``, ``launch.reuse``):
the supervisor relaunches a dead server and publishes it only once healthy, follows the target file
(grows; shrinks by taking the server out of the members first and stopping it once rank 0's pool
no longer lists it), gives up after repeated failed starts; rank 0 offers new members to the weight
sync and drops the ones that left; a kept server's reuse verdict against the checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_fast.launch import elastic, pool_watch
from areal_fast.launch.base import LaunchedProcess
from areal_fast.launch.members import Member, Target, read_members, write_members, write_pool, write_target
from areal_fast.launch.reuse import judge
from areal_fast.weights.membership import SyncMembership


class FakeLauncher:
    """Starts fake server processes (alive until told otherwise) on ports 40000 + n."""

    def __init__(self, fail: bool = False):
        self.started: list[tuple[int, str]] = []
        self.stopped: list[str] = []
        self.fail = fail
        self.dead: set[str] = set()

    def proc(self, name: str, url: str) -> LaunchedProcess:
        p = LaunchedProcess(name=name, log_path=Path("/dev/null"), url=url, critical=False)
        p.alive = lambda: url not in self.dead and url not in self.stopped  # type: ignore[method-assign]
        return p

    def start_server(self, rollout_cfg, model_path, slot, name, *, seed, key_file):
        self.started.append((slot, name))
        url = f"http://127.0.0.1:{40000 + len(self.started) + 10}"
        if self.fail:
            self.dead.add(url)
        return self.proc(name, url)

    def stop_process(self, p, grace):
        self.stopped.append(p.url)


@pytest.fixture
def ready(monkeypatch):
    healthy: set[str] = set()
    monkeypatch.setattr(elastic, "server_ready", lambda url: url in healthy)
    return healthy


def _supervisor(tmp_path, launcher, n=2, **cfg):
    rollout = SimpleNamespace(relaunch_servers=True, health_timeout=300.0, gpus=[], **cfg)
    servers = [launcher.proc(f"server{i}", f"http://127.0.0.1:{40000 + i}") for i in range(n)]
    return elastic.ServerSupervisor(launcher, rollout, "/m", tmp_path, seed=0, api_key=None, servers=servers), servers


def _member_urls(out):
    return [m.url for m in read_members(out)]


def test_a_dead_server_is_relaunched_in_its_slot_and_published_once_healthy(tmp_path, ready):
    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher)
    assert _member_urls(tmp_path) == [servers[0].url, servers[1].url]
    launcher.dead.add(servers[0].url)
    sup.tick()
    assert launcher.started == [(0, "server0-2")]  # slot 0 again, a new name
    assert _member_urls(tmp_path) == [servers[1].url]  # the dead one left; the new one is not healthy yet
    new = sup.starting[0].proc.url
    sup.tick()
    assert _member_urls(tmp_path) == [servers[1].url]
    ready.add(new)
    sup.tick()
    assert _member_urls(tmp_path) == [new, servers[1].url] and not sup.starting
    assert read_members(tmp_path)[0].slot == 0


def test_without_relaunch_the_run_goes_on_with_fewer(tmp_path, ready):
    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher)
    sup.relaunch = False
    launcher.dead.add(servers[1].url)
    sup.tick()
    assert launcher.started == [] and _member_urls(tmp_path) == [servers[0].url]


def test_the_target_file_adds_and_removes_servers_draining_first(tmp_path, ready):
    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher)
    write_target(tmp_path, Target(3))
    sup.tick()
    assert launcher.started == [(2, "server2")]
    ready.add(sup.starting[0].proc.url)
    sup.tick()
    assert len(_member_urls(tmp_path)) == 3
    write_pool(tmp_path, _member_urls(tmp_path), [])
    write_target(tmp_path, Target(2, remove=[servers[0].url]))
    sup.tick()
    assert servers[0].url not in _member_urls(tmp_path)  # out of the members at once...
    assert launcher.stopped == []  # ...but still in rank 0's pool: not stopped yet
    write_pool(tmp_path, _member_urls(tmp_path), [])
    sup.tick()
    assert launcher.stopped == [servers[0].url] and len(_member_urls(tmp_path)) == 2


def test_repeated_failed_starts_stop_the_relaunching(tmp_path, ready):
    launcher = FakeLauncher(fail=True)
    sup, servers = _supervisor(tmp_path, launcher, n=1)
    launcher.dead.add(servers[0].url)
    for _ in range(3 * elastic.MAX_FAILED_STARTS):
        sup.tick()
    assert len(launcher.started) == elastic.MAX_FAILED_STARTS


class Pool:
    def __init__(self, urls):
        self.urls = list(urls)

    def is_dead(self, url):
        return False

    def remove_server(self, url):
        self.urls.remove(url)

    async def add_server(self, url):
        self.urls.append(url)


def test_rank_0_offers_new_members_and_drops_the_ones_that_left(tmp_path):
    A, B, C = (f"http://127.0.0.1:{p}" for p in (1, 2, 3))
    pool = Pool([A, B])
    syncer = SimpleNamespace(membership=SyncMembership(pool))
    syncer.offer = syncer.membership.offer
    pool_watch.follow_members(pool, syncer, tmp_path)  # no members file: servers not launched, nothing moves
    assert pool.urls == [A, B]
    write_members(tmp_path, [Member("s0", A, 0), Member("s2", C, 2)])
    pool_watch.follow_members(pool, syncer, tmp_path)
    assert pool.urls == [A] and syncer.membership.joining == [C]  # C enters only after its first update
    write_members(tmp_path, [Member("s0", A, 0)])
    pool_watch.follow_members(pool, syncer, tmp_path)
    assert syncer.membership.joining == []
    write_members(tmp_path, [])
    pool_watch.follow_members(pool, syncer, tmp_path)
    assert pool.urls == [A]  # never the last one


def test_a_server_dropped_as_dead_is_not_offered_again_until_a_new_process_serves_its_address(tmp_path):
    A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"
    pool = Pool([A, B])
    syncer = SimpleNamespace(membership=SyncMembership(pool))
    syncer.offer = syncer.membership.offer
    known: dict = {}
    write_members(tmp_path, [Member("s0", A, 0, pid=10), Member("s1", B, 1, pid=11)])
    pool_watch.follow_members(pool, syncer, tmp_path, known)
    pool.remove_server(B)  # rank 0 found B dead before the launcher took it out of the members
    pool_watch.follow_members(pool, syncer, tmp_path, known)
    assert syncer.membership.joining == []
    write_members(tmp_path, [Member("s0", A, 0, pid=10), Member("s1", B, 1, pid=12)])  # relaunched on B's port
    pool_watch.follow_members(pool, syncer, tmp_path, known)
    assert syncer.membership.joining == [B]


def test_the_pool_file_follows_the_pool(tmp_path):
    from areal_fast.launch.members import read_pool

    A = "http://127.0.0.1:1"
    pool = Pool([A])
    syncer = SimpleNamespace(membership=SyncMembership(pool), offer=lambda u: None)

    async def briefly():
        t = asyncio.create_task(pool_watch.watch_members(pool, syncer, tmp_path, every_s=0.01))
        await asyncio.sleep(0.05)
        t.cancel()

    asyncio.run(briefly())
    assert read_pool(tmp_path)["urls"] == [A]


@pytest.mark.parametrize("answers, version, model, ckpt, reuse", [
    (True, "4", "/m", 4, True),    # at the checkpoint's version
    (True, "5", "/m", 4, True),    # ahead of the checkpoint: the first update brings it back to 4
    (True, "3", "/m", 0, False),   # the run starts again at 0 and sends nothing at 0
    (True, "0", "/m", 0, True),
    (False, None, "/m", 4, False),  # wrong key or down
    (True, "4", "/other", 4, False),
])
def test_a_kept_server_is_reused_only_when_its_weights_can_be_trusted(answers, version, model, ckpt, reuse):
    ok, why = judge(answers, version, model, "/m", ckpt)
    assert ok is reuse and why
