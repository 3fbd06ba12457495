"""Elastic servers without real servers (``elastic.supervisor``, ``elastic.pool_watch``, ``launch.reuse``):
the supervisor relaunches a dead server and publishes it only once healthy, follows the target file
(grows; shrinks by taking the server out of the members first and stopping it once rank 0's pool
no longer lists it), gives up after repeated failed starts; rank 0 offers new members to the weight
sync and drops the ones that left; a kept server's reuse verdict against the checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from _shared import poll_until, wait_until

from areal_fast.elastic import pool_watch, supervisor
from areal_fast.elastic.members import Member, Target, read_members, write_members, write_pool, write_target
from areal_fast.launch.base import LaunchedProcess
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
    monkeypatch.setattr(supervisor, "server_ready", lambda url: url in healthy)
    return healthy


def _supervisor(tmp_path, launcher, n=2, **cfg):
    rollout = SimpleNamespace(relaunch_servers=True, health_timeout=300.0, gpus=[], **cfg)
    servers = [launcher.proc(f"server{i}", f"http://127.0.0.1:{40000 + i}") for i in range(n)]
    sup = supervisor.ServerSupervisor(launcher, rollout, "/m", tmp_path, seed=0, api_key=None, servers=servers)
    return sup, servers


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
    for _ in range(3 * supervisor.MAX_FAILED_STARTS):
        sup.tick()
    assert len(launcher.started) == supervisor.MAX_FAILED_STARTS


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
    from areal_fast.elastic.members import read_pool

    A = "http://127.0.0.1:1"
    pool = Pool([A])
    syncer = SimpleNamespace(membership=SyncMembership(pool), offer=lambda u: None)

    async def until_written():
        t = asyncio.create_task(pool_watch.watch_members(pool, syncer, tmp_path, every_s=0.01))
        await wait_until(lambda: read_pool(tmp_path) is not None or t.done(), "the pool file", 30)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    asyncio.run(until_written())
    assert read_pool(tmp_path)["urls"] == [A]


@pytest.mark.parametrize("answers, version, model, ckpt, reuse", [
    (True, "4", "/m", 4, True),    # at the checkpoint's version
    (True, "5", "/m", 4, True),    # ahead of the checkpoint: the first update brings it back to 4
    (True, "3", "/m", 0, False),   # the run starts again at 0 and sends nothing at 0
    (True, "0", "/m", 0, True),
    (False, None, "/m", 4, False),  # wrong key or down
    (True, "4", "/other", 4, False),
    (True, "default", "/m", 0, True),  # vLLM's label before any update is "default": version 0
    (True, "default", "/m", 3, True),
])
def test_a_kept_server_is_reused_only_when_its_weights_can_be_trusted(answers, version, model, ckpt, reuse):
    ok, why = judge(answers, version, model, "/m", ckpt)
    assert ok is reuse and why


# ----------------------------------------------------------------------------- the chaos run's gaps


def test_a_starting_server_is_recorded_with_its_pid_and_state_before_it_is_healthy(tmp_path, ready):
    from areal_fast.elastic.members import read_starting

    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher)
    launcher.dead.add(servers[0].url)
    sup.tick()
    new = sup.starting[0].proc
    new.pid = 4242
    sup._publish()
    (s,) = read_starting(tmp_path)
    assert (s.url, s.pid, s.slot, s.state) == (new.url, 4242, 0, "starting")
    assert _member_urls(tmp_path) == [servers[1].url]  # not a member rank 0 may use yet
    ready.add(new.url)
    sup.tick()
    assert read_starting(tmp_path) == [] and _member_urls(tmp_path) == [new.url, servers[1].url]


def _fake_server(tmp_path, listen: bool = False):
    """A process whose command line reads like an inference server's (``reuse.is_kept_server``);
    ``listen``: it listens on a free port of 127.0.0.1 (``proc.port``), as a healthy server does."""
    import subprocess
    import sys

    code = "import time; time.sleep(120)"
    if listen:
        code = ("import socket, time; s = socket.create_server(('127.0.0.1', 0)); print(s.getsockname()[1], "
                "flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, "areal_fast.embedded"], start_new_session=True,
                            stdout=subprocess.PIPE if listen else None, text=True)
    if listen:
        proc.port = int(proc.stdout.readline())
    else:  # a port bound here and never listened on, held for the test: nobody listens on it meanwhile
        import socket

        proc.reserved = socket.socket()
        proc.reserved.bind(("127.0.0.1", 0))
        proc.port = proc.reserved.getsockname()[1]
    return proc


@pytest.mark.parametrize("marker", ["areal_fast.embedded", "vllm.entrypoints.openai.api_server",
                                    "sglang.launch_server"])
def test_every_launched_kind_of_server_is_recognised_as_a_kept_server(marker):
    """A kept vLLM server (python -m vllm.entrypoints.openai.api_server) is one too: a resume reuses
    or stops it, never leaves it holding its GPUs."""
    import subprocess
    import sys

    from areal_fast.launch import reuse

    # each says when it runs: before its exec, a child's command line is still its parent's
    up = "import sys, time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", up, marker], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        assert reuse.is_kept_server(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    other = subprocess.Popen([sys.executable, "-c", up], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline() == b"up\n"
        assert not reuse.is_kept_server(other.pid)
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("state", ["down", "up", "silent"])
def test_a_resume_stops_a_server_still_starting_or_adopts_it_once_healthy(tmp_path, monkeypatch, state):
    """``silent``: its address answers /health while nobody listens on the port (what answered closed its
    socket): not its own, so it is stopped, never sent the key."""
    from areal_fast.launch import reuse

    proc = _fake_server(tmp_path, listen=state == "up")  # a healthy server listens on its port itself
    try:
        url = f"http://127.0.0.1:{proc.port}"
        write_members(tmp_path, [], model="/m", starting=[Member("server0-3", url, 0, pid=proc.pid,
                                                                 state="starting")])
        monkeypatch.setattr(reuse, "server_ready", lambda u: state != "down" and u == url)
        probed: list[str] = []
        monkeypatch.setattr(reuse, "probe", lambda u, key, rollout_cfg=None: probed.append(u) or (True, "0"))
        monkeypatch.setattr(reuse, "release_groups", lambda *a: None)
        said: list[str] = []
        procs, _ = reuse.reuse_kept_servers(tmp_path, "/m", 2, say=said.append)
        if state == "up":  # at version 0, checkpoint 2: the first update brings it there
            assert [(p.url, p.pid, p.extra["slot"]) for p in procs] == [(url, proc.pid, 0)]
            assert proc.poll() is None
        else:
            assert procs == [] and probed == [] and "was starting" in said[0]
            assert ("nobody listens on its port" if state == "silent" else "does not answer") in said[0]
            proc.wait(timeout=20)  # stopped (SIGTERM to its group); a hang fails here
    finally:
        proc.kill()
        proc.wait()


def test_a_fresh_start_stops_the_servers_a_crashed_run_was_starting(tmp_path):
    from areal_fast.launch.train import _stop_kept_servers

    proc = _fake_server(tmp_path)
    try:
        write_members(tmp_path, [], model="/m", starting=[Member("server1-4", "http://127.0.0.1:45002", 1,
                                                                 pid=proc.pid, state="starting")])
        _stop_kept_servers(tmp_path)
        proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.wait()


def _tick_until(sup, cond, deadline_s=10.0):
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < deadline_s, "the supervisor did not act"
        sup.tick()
        time.sleep(0.01)


def _pool_after_members(out, urls):
    """pool.json as rank 0 writes it once it has seen the members (later than they became members)."""
    import time

    from areal_fast.elastic.members import POOL_FILE, servers_dir, write_json

    write_json(servers_dir(out) / POOL_FILE, {"urls": urls, "joining": [], "generation": 1, "time": time.time() + 1})


def test_a_member_rank_0_dropped_that_does_not_answer_is_killed_and_relaunched(tmp_path, ready, monkeypatch):
    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher, hang_timeout=5.0)
    asked, killed = [], []
    monkeypatch.setattr(supervisor, "server_state", lambda url, t: asked.append((url, t)) or "hung")
    monkeypatch.setattr(supervisor, "kill_now", lambda p: killed.append(p.url) or launcher.dead.add(p.url))
    sup.tick()
    _pool_after_members(tmp_path, [servers[1].url])  # rank 0 dropped server0 as hung; its process lives
    _tick_until(sup, lambda: launcher.started)
    assert asked == [(servers[0].url, 5.0)] and killed == [servers[0].url]
    assert launcher.started == [(0, "server0-2")] and sup.killed_hung == 1


def test_a_slow_member_that_answers_within_hang_timeout_is_not_killed(tmp_path, ready, monkeypatch):
    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher, hang_timeout=5.0)
    asked, killed = [], []
    monkeypatch.setattr(supervisor, "server_state", lambda url, t: asked.append(url) or "alive")
    monkeypatch.setattr(supervisor, "kill_now", lambda p: killed.append(p.url))
    _pool_after_members(tmp_path, [servers[1].url])
    _tick_until(sup, lambda: asked and not sup._checks)
    for _ in range(5):
        sup.tick()
    assert killed == [] and launcher.started == [] and asked == [servers[0].url]  # asked again only after 5 s
    _pool_after_members(tmp_path, [servers[0].url, servers[1].url])  # in the pool: never asked
    sup._answered.clear()
    for _ in range(5):
        sup.tick()
    assert asked == [servers[0].url]


def test_a_member_not_yet_seen_by_rank_0_is_not_suspected(tmp_path, ready, monkeypatch):
    from areal_fast.elastic.members import POOL_FILE, servers_dir, write_json

    launcher = FakeLauncher()
    sup, servers = _supervisor(tmp_path, launcher, hang_timeout=5.0)
    asked: list[str] = []
    monkeypatch.setattr(supervisor, "server_state", lambda url, t: asked.append(url) or "hung")
    write_json(servers_dir(tmp_path) / POOL_FILE, {"urls": [], "joining": [], "time": 1.0})  # a previous run's
    for _ in range(5):
        sup.tick()
    assert asked == []


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


async def _settle(rejoin):
    await asyncio.gather(*rejoin.tasks.values(), return_exceptions=True)


def test_an_external_server_dropped_as_hung_is_offered_again_once_it_answers_with_backoff(tmp_path):
    from areal_fast.elastic.rejoin import Rejoin

    A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"
    pool = Pool([A])  # B (rollout.servers) was dropped as hung
    membership = SyncMembership(pool)
    syncer = SimpleNamespace(membership=membership, offer=membership.offer)
    answers, probes, clock = {B: False}, [], Clock()
    rejoin = Rejoin(lambda u: probes.append(clock.t) or answers[u], clock=clock)

    async def run():
        async def look(t):
            clock.t = t
            pool_watch.follow_members(pool, syncer, tmp_path, {}, rejoin, external=[A, B])
            await rejoin.step(syncer.offer)
            await _settle(rejoin)
            await rejoin.step(syncer.offer)

        for t in (0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 10.0):
            await look(t)
        assert probes == [2.0, 6.0] and membership.joining == []  # 2 s, then 4 s later
        answers[B] = True
        await look(13.0)
        assert membership.joining == []  # backoff: 8 s after 6
        await look(14.0)
        assert membership.joining == [B]  # a joiner: the next update in full, then the pool
        await look(15.0)
        assert probes == [2.0, 6.0, 14.0] and B not in rejoin.waiting

    asyncio.run(run())


def test_a_rejoining_server_held_as_unresponsive_is_offered_after_the_hold(tmp_path):
    from areal_fast.elastic.rejoin import Rejoin

    A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"
    pool = Pool([A])
    membership = SyncMembership(pool)
    membership.withdraw(B, hold_s=3600)  # a hung joiner withdrawn before an update
    syncer = SimpleNamespace(membership=membership, offer=membership.offer)
    clock = Clock()
    rejoin = Rejoin(lambda u: True, clock=clock)

    async def run():
        for t in (0.0, 2.0, 2.1):
            clock.t = t
            pool_watch.follow_members(pool, syncer, tmp_path, {}, rejoin, external=[A, B])
            await rejoin.step(syncer.offer)
            await _settle(rejoin)
        assert membership.joining == [] and B in rejoin.waiting  # refused while held: tried again later
        membership.held.clear()
        clock.t = 100.0
        await rejoin.step(syncer.offer)
        await _settle(rejoin)
        await rejoin.step(syncer.offer)
        assert membership.joining == [B]

    asyncio.run(run())


def test_a_launched_member_dropped_by_rank_0_is_offered_again_once_it_answers(tmp_path):
    from areal_fast.elastic.rejoin import Rejoin

    A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"
    pool = Pool([A, B])
    membership = SyncMembership(pool)
    syncer = SimpleNamespace(membership=membership, offer=membership.offer)
    known: dict = {}
    clock = Clock()
    rejoin = Rejoin(lambda u: True, clock=clock)
    write_members(tmp_path, [Member("s0", A, 0, pid=10), Member("s1", B, 1, pid=11)])

    async def run():
        pool_watch.follow_members(pool, syncer, tmp_path, known, rejoin)
        pool.remove_server(B)  # dropped as hung (SIGSTOP 20 s), same process
        for t in (0.0, 2.0, 2.1):
            clock.t = t
            pool_watch.follow_members(pool, syncer, tmp_path, known, rejoin)
            await rejoin.step(syncer.offer)
            await _settle(rejoin)
        assert membership.joining == [B]

    asyncio.run(run())


def test_kill_now_ends_a_sigstopped_server_and_its_group(tmp_path):
    import os
    import signal

    proc = _fake_server(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        supervisor.kill_now(LaunchedProcess(name="s", log_path=Path("/dev/null"), pid=proc.pid))
        assert proc.wait(timeout=20) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_a_paused_server_that_answers_model_info_but_503_on_health_counts_as_answering_again():
    """A server dropped while hung wakes up paused (the pause before an update reached it late): /health
    says 503 until the pool continues it after its update, so rejoining must not wait for /health 200."""
    import http.server
    import threading

    class Paused(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's protocol
            self.send_response(200 if self.path == "/model_info" else 503)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Paused)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert pool_watch.answers_again(url, 5.0)
        srv.shutdown()
        srv.server_close()
        assert not pool_watch.answers_again(url, 5.0)  # refused
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_large_target_starts_a_bounded_number_of_servers_per_tick(tmp_path, ready):
    launcher = FakeLauncher()
    sup, _ = _supervisor(tmp_path, launcher, n=1)
    write_target(tmp_path, Target(11))
    sup.tick()
    assert 0 < len(launcher.started) <= 4  # not 10 back to back
    assert len(launcher.started) == supervisor.MAX_STARTS_PER_TICK
    sup.tick()
    assert len(launcher.started) == 2 * supervisor.MAX_STARTS_PER_TICK
    for _ in range(3):
        sup.tick()
    assert len(launcher.started) == 10 and len(sup.starting) == 10  # the rest, a few at a time


def test_a_target_file_above_the_cap_is_refused_and_the_target_kept(tmp_path, ready, caplog):
    import json
    import logging

    from areal_fast.elastic.members import TARGET_FILE, servers_dir

    launcher = FakeLauncher()
    start = launcher.start_server

    def runaway_guard(*a, **kw):  # a supervisor that obeyed the file would start 99998 servers
        if len(launcher.started) >= 16:
            raise RuntimeError("more than 16 starts")
        return start(*a, **kw)

    launcher.start_server = runaway_guard
    sup, _ = _supervisor(tmp_path, launcher, n=2)
    servers_dir(tmp_path).mkdir(parents=True, exist_ok=True)
    (servers_dir(tmp_path) / TARGET_FILE).write_text(json.dumps({"n_servers": 100000}))  # by hand
    with caplog.at_level(logging.ERROR, logger="areal_fast.elastic.supervisor"):
        sup.tick()
        sup.tick()
    assert launcher.started == [] and sup.target == 2
    refusals = [m for m in caplog.messages if "100000" in m and "at most 1024" in m]
    assert len(refusals) == 1, caplog.messages  # said once, not every tick


@pytest.mark.parametrize("neighbour", [True, False])
def test_a_relaunched_slurm_step_on_this_node_must_hold_its_own_port(tmp_path, ready, neighbour):
    """A server the supervisor relaunches as a Slurm step that runs on this machine is port-checked
    like a local one: another process listening on its port fails the start at once; nobody listening
    after its /health answered is never promoted (refused at ``rollout.health_timeout``)."""
    import socket
    import subprocess
    import sys

    from areal_fast.launch.slurm import SlurmStep

    step_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the step's task
    squat = socket.create_server(("127.0.0.1", 0))  # this test's process: not in the step's process tree
    port = squat.getsockname()[1]
    if not neighbour:
        squat.close()
    try:
        launcher = FakeLauncher()

        def start_step(rollout_cfg, model_path, slot, name, *, seed, key_file):
            launcher.started.append((slot, name))
            p = SlurmStep(name=name, log_path=Path("/dev/null"), url=f"http://127.0.0.1:{port}", critical=False,
                          pid=step_proc.pid, node="this-node")
            p.extra.update(step="5.7", this_machine=True)  # wait_started read its start record: here
            p.alive = lambda: p.url not in launcher.stopped  # type: ignore[method-assign]
            return p

        launcher.start_server = start_step
        sup, servers = _supervisor(tmp_path, launcher, n=1)
        launcher.dead.add(servers[0].url)
        ready.add(f"http://127.0.0.1:{port}")  # its /health answers (the neighbour's, or before it closed)
        sup.tick()  # server0 reaped; the replacement starts
        assert launcher.started and len(sup.starting) == 1
        sup.tick()  # /health answers: promoted only if the port is the step's own
        assert 0 not in sup.members, "promoted a server whose port is not its own"
        if neighbour:
            assert launcher.stopped == [f"http://127.0.0.1:{port}"] and sup.failed_starts == 1
        else:
            assert launcher.stopped == [] and len(sup.starting) == 1  # asked again until the deadline
            sup.cfg.health_timeout = 0  # the deadline now past (the two ticks above ran within the default)
            poll_until(lambda: sup.tick() or sup.failed_starts == 1, "refused at the health timeout")
            assert launcher.stopped == [f"http://127.0.0.1:{port}"] and 0 not in sup.members
    finally:
        squat.close()
        step_proc.kill()
        step_proc.wait()
