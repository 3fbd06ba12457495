"""A deadline on every wait (``docs/deadlines.md``), each checked with a watchdog:

- a SIGSTOPped embedded engine (its kernel still accepts connections; nothing answers) is dropped
  from the pool by the control call that timed out on it, within ``rollout.control_timeout`` +
  ``rollout.hang_timeout``, and the pause of the other server goes on; the watchdog drops it too;
- a SIGSTOPped weight-sync peer: the gloo broadcast and the update calls end within
  ``weights.timeout_s`` with WeightSyncError (the failure path), and the transport closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from _shared import in_watched_thread

from areal_fast.launch import rank
from areal_fast.rollout.config import RolloutConfig

CONTROL_S, HANG_S = 4.0, 2.0  # short deadlines: the test waits for them (watchdogs: a few times more)
WATCHDOG_S = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen2

    return build_tiny_qwen2(str(tmp_path_factory.mktemp("deadlines") / "model"), hidden_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def two_engines(tiny_model):
    from areal_fast.embedded.launch import launch_engine_subprocess

    handles = [launch_engine_subprocess(tiny_model, dtype="float32") for _ in range(2)]
    try:
        for h in handles:
            h.wait_healthy(120)
        yield handles
    finally:
        for h in handles:
            with _suppress():
                os.kill(h.process.pid, signal.SIGCONT)
            h.stop()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


@pytest.mark.slow  # two engine subprocesses and the deadlines they wait for (~25 s here)
def test_a_sigstopped_server_is_dropped_within_its_deadline(two_engines):
    good, hung = two_engines
    r = RolloutConfig(servers=[good.url, hung.url], control_timeout=CONTROL_S, hang_timeout=HANG_S)

    async def run():
        async with rank.rollout_port(r, [good.url, hung.url], None) as port:
            os.kill(hung.process.pid, signal.SIGSTOP)
            # the pause waits for the hung server's answer until control_timeout, finds it hung
            # (no answer to GET /model_info within hang_timeout), drops it, and pauses the other
            await asyncio.wait_for(port.pause(), WATCHDOG_S)
            assert port.urls == [good.url]
            await asyncio.wait_for(port.resume(), WATCHDOG_S)
            s = await asyncio.wait_for(port.generate([5, 6, 7], {"max_new_tokens": 2}, "after-hang"), WATCHDOG_S)
            assert s.servers == [good.url]

    try:
        asyncio.run(run())
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)


@pytest.mark.slow
def test_the_watchdog_drops_a_sigstopped_server(two_engines, monkeypatch, tmp_path):
    monkeypatch.setattr(rank, "_WATCH_S", 0.05)
    good, hung = two_engines

    class Pool:
        urls = [good.url, hung.url]

        def remove_server(self, url):
            self.urls = [u for u in self.urls if u != url]

    pool = Pool()

    async def run():
        task = asyncio.create_task(rank._watch_servers(pool, tmp_path, hang_timeout_s=HANG_S))
        os.kill(hung.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + WATCHDOG_S
        while hung.url in pool.urls:
            assert not task.done(), task
            assert time.monotonic() < deadline, "the watchdog kept a hung server"
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)
    assert pool.urls == [good.url]


@pytest.mark.slow
def test_a_sigstopped_weight_sync_peer_times_out_the_broadcast(two_engines, tiny_model):
    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
    from areal_fast.data.tiny_models import perturbed_state_dict
    from areal_fast.weights import WeightSyncError
    from areal_fast.weights.sync import WeightSyncConfig

    good, hung = two_engines
    state = perturbed_state_dict(tiny_model, seed=1)
    cfg = WeightSyncConfig(collective="gloo", timeout_s=5.0, dtype="float32", bucket_bytes=1 << 20)
    sync = DistributedWeightSync([good.url, hung.url], cfg)
    sync.update(state, 1)  # the group is made and used once with both servers
    os.kill(hung.process.pid, signal.SIGSTOP)
    box = in_watched_thread(lambda: sync.update({k: v + 1 for k, v in state.items()}, 2), WATCHDOG_S)
    assert isinstance(box.get("error"), WeightSyncError), box
    assert hung.url in str(box["error"]) or "no answer within" in str(box["error"])
    assert sync.version == "1"
    closed = in_watched_thread(sync.close, WATCHDOG_S)
    assert "error" not in closed, closed


@pytest.mark.slow
def test_a_sigstopped_peer_sends_the_sync_port_down_its_failure_path(two_engines, tiny_model, tmp_path):
    """The run's wiring (``rank.rollout_port`` and ``make_sync_port``): the broadcast to a hung
    peer times out (``weights.timeout_s``), the hung server is found hung (not merely "alive")
    and dropped, and the version still reaches the other server."""
    from areal_fast.backends.registry import weight_transport
    from areal_fast.data.tiny_models import perturbed_state_dict
    from areal_fast.launch.runtime import apply_update, make_sync_port
    from areal_fast.rollout.calls import BlockingCalls
    from areal_fast.weights.sync import WeightSyncConfig

    good, hung = two_engines
    state = perturbed_state_dict(tiny_model, seed=2)
    r = RolloutConfig(servers=[good.url, hung.url], control_timeout=CONTROL_S, hang_timeout=HANG_S)

    class Trainer:  # ActorTrainer's update_weights on one rank, without an actor
        transports: dict = {}

        def update_weights(self, spec, version):
            apply_update(self.transports, spec, version, state)

    async def run():
        async with rank.rollout_port(r, [good.url, hung.url], None) as port:
            cfg = WeightSyncConfig(collective="gloo", timeout_s=5.0, dtype="float32", group_name="deadline_group")
            syncer = make_sync_port(cfg, Trainer(), port, tmp_path / "sync",
                                    transport=weight_transport("sglang", "distributed"))
            await asyncio.wait_for(syncer.sync(11), WATCHDOG_S)
            os.kill(hung.process.pid, signal.SIGSTOP)
            await asyncio.wait_for(syncer.sync(12), WATCHDOG_S)
            assert port.urls == [good.url]

    try:
        asyncio.run(run())
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)
    with BlockingCalls() as calls:
        assert str(calls.call(good.url, "GET", "/model_info")["weight_version"]) == "12"
