"""The controller's sync port (areal_fast.weights.port) with a fake trainer and a fake pool:
the spec each rank builds, the broadcast group re-formed (not a fall back to disk) when a server
died, a joining server updated before it enters the pool, a dead server dropped from a disk update,
and failures with every server alive re-raised."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest
from fakes import ServerListPool as FakePool
from fakes import UpdateRecordingTrainer

from areal_fast.backends.registry import weight_transport
from areal_fast.weights import port
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.port import DiskSync, DistributedSync, SyncSpec, make_sync_port

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


@pytest.fixture(autouse=True)
def _short_death_wait(monkeypatch):
    # deaths in these tests are visible from the start
    monkeypatch.setattr(port, "DEAD_SERVER_RETRY", dataclasses.replace(port.DEAD_SERVER_RETRY, deadline_s=0.2))


def test_spec_is_a_plain_value_every_rank_can_build():
    cfg = WeightSyncConfig(bucket_bytes=4096, dtype="bfloat16", api_key="k")
    spec = SyncSpec.of("distributed", [A + "/"], cfg, weight_transport("sglang", "distributed"))
    again = pickle.loads(pickle.dumps(spec))  # what the announcement to the other ranks carries
    assert again == spec and hash(again) == hash(spec) and spec.urls == (A,)
    assert spec.weight_config() == cfg
    ws = spec.build()
    assert type(ws).__name__ == "DistributedWeightSync" and ws.urls == [A] and ws.config == cfg
    assert type(SyncSpec.of("disk", [A], cfg, weight_transport("sglang", "disk")).build()).__name__ == "DiskWeightSync"
    vllm_disk = SyncSpec.of("disk", [A], cfg, weight_transport("vllm", "disk"))
    assert type(vllm_disk.build()).__name__ == "VLLMDiskWeightSync"
    with pytest.raises(ValueError, match="no transport given"):  # the layer above must choose one
        SyncSpec.of("disk", [A], cfg).build()
    with pytest.raises(ValueError, match="weights.method 'ftp'"):
        weight_transport("sglang", "ftp")


def test_make_sync_port_follows_the_config(tmp_path):
    t, p = UpdateRecordingTrainer(), FakePool([A])
    transport = weight_transport("sglang", "distributed")
    port_ = make_sync_port(WeightSyncConfig(), t, p, tmp_path, transport=transport)
    assert isinstance(port_, DistributedSync) and port_._spec([A]).transport is transport
    assert isinstance(make_sync_port(WeightSyncConfig(method="disk"), t, p, tmp_path, transport=transport), DiskSync)


def test_a_dead_member_re_forms_the_group_and_the_run_stays_distributed(tmp_path):
    """Before: B's death sent every later update to disk ("using disk sync from now on")."""
    pool = FakePool([A, B])

    def fail(spec):
        if B in spec.urls and B in pool.dead:
            return RuntimeError(f"connection reset by {B}")
        return None

    trainer = UpdateRecordingTrainer(fail)
    sync = DistributedSync(trainer, pool, WeightSyncConfig(timeout_s=5))
    asyncio.run(sync.sync(1))
    assert [(s.method, s.urls, v) for s, v in trainer.calls] == [("distributed", (A, B), 1)]
    assert trainer.calls[0][0].weight_config().group_name == "weight_update_group"
    pool.dead.add(B)
    metrics = asyncio.run(sync.sync(2))  # B died: the update is retried at once on a new group without B
    assert [(s.method, s.urls, v) for s, v in trainer.calls[1:]] == [("distributed", (A, B), 2),
                                                                     ("distributed", (A,), 2)]
    assert trainer.calls[-1][0].weight_config().group_name == "weight_update_group-g1"
    assert pool.urls == [A] and metrics["servers"] == 1 and metrics["group_generation"] == 1
    assert "broadcast_s" in metrics and "disk_sync_s" not in metrics
    asyncio.run(sync.sync(3))  # the same servers: the same group, no new generation
    assert trainer.calls[-1][0] == trainer.calls[-2][0] and trainer.calls[-1][1] == 3


def test_a_joining_server_gets_the_whole_update_before_it_enters_the_pool(tmp_path):
    C = "http://127.0.0.1:3"
    pool = FakePool([A, B])
    seen = []
    trainer = UpdateRecordingTrainer(lambda spec: seen.append((spec.urls, pool.urls)))
    sync = DistributedSync(trainer, pool, config=WeightSyncConfig())
    asyncio.run(sync.sync(1))
    assert sync.offer(C + "/") and not sync.offer(C) and not sync.offer(A)  # once; members are not offered
    assert pool.urls == [A, B]  # no request goes to C before it holds the weights
    m = asyncio.run(sync.sync(2))
    assert seen[-1] == ((A, B, C), [A, B])  # C took part in the update while still out of the pool
    assert trainer.calls[-1][0].weight_config().group_name == "weight_update_group-g1"
    assert pool.urls == [A, B, C] and sync.membership.joining == []
    assert (m["servers"], m["joined"], m["joining"], m["group_generation"]) == (3, 1, 0, 1)


def test_a_joining_server_that_dies_is_forgotten_and_the_others_updated(tmp_path):
    C = "http://127.0.0.1:3"
    pool = FakePool([A], dead=[C])
    trainer = UpdateRecordingTrainer(lambda spec: RuntimeError("reset") if C in spec.urls else None)
    sync = DistributedSync(trainer, pool, config=WeightSyncConfig())
    sync.offer(C)
    m = asyncio.run(sync.sync(1))
    assert [s.urls for s, _ in trainer.calls] == [(A,)]  # found dead before the update: never sent one
    assert pool.urls == [A] and sync.membership.joining == [] and m["joined"] == 0


def test_a_new_transport_closes_the_one_it_replaces_on_every_rank():
    from areal_fast.launch.runtime import apply_update

    closed, built = [], []

    class Transport:
        def __init__(self, spec):
            self.spec, self.urls = spec, list(spec.urls)
            built.append(spec)

        def update(self, state, version):
            pass

        def close(self):
            closed.append(tuple(self.urls))

    class Spec(SyncSpec):
        def build(self):
            return Transport(self)

    cfg = WeightSyncConfig()
    one, two = Spec.of("distributed", [A, B], cfg), Spec.of("distributed", [A], cfg)
    cache: dict = {}
    apply_update(cache, one, 1, {})
    apply_update(cache, one, 2, {})  # reused
    apply_update(cache, two, 3, {})
    assert built == [one, two] and list(cache) == [two]
    assert closed == [(A,)]  # the old group destroyed on the servers still members, not on B (gone)


def test_failure_with_every_server_alive_is_raised(tmp_path):
    trainer = UpdateRecordingTrainer(lambda spec: RuntimeError("bucket 3 refused by " + A))
    sync = DistributedSync(trainer, FakePool([A, B]))
    with pytest.raises(RuntimeError, match="bucket 3 refused"):
        asyncio.run(sync.sync(1))
    assert len(trainer.calls) == 1
    disk = DiskSync(trainer, FakePool([A]), tmp_path)
    with pytest.raises(RuntimeError, match="bucket 3 refused"):
        asyncio.run(disk.sync(1))
    assert len(trainer.calls) == 2  # not retried: nobody died


def test_liveness_is_probed_only_after_a_failure(tmp_path):
    """is_dead may be slow (a health probe of a paused server): a good sync never calls it."""
    pool = FakePool([A, B])
    probes = []
    pool.is_dead = lambda url: probes.append(url) or False
    sync = DistributedSync(UpdateRecordingTrainer(), pool)
    asyncio.run(sync.sync(1))
    assert probes == []
