"""The controller's sync port (areal_fast.weights.port) with a fake trainer and a fake pool:
the spec each rank builds, the fallback from distributed to disk when a server died, a dead
server dropped from a disk update, and failures with every server alive re-raised."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest
from fakes import UpdateRecordingTrainer

from areal_fast.weights import port
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.port import DiskSync, DistributedSync, SyncSpec, make_sync_port

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


class FakePool:
    def __init__(self, urls, dead=()):
        self._urls, self.dead = list(urls), set(dead)

    @property
    def urls(self):
        return list(self._urls)

    def is_dead(self, url):
        return url in self.dead

    def remove_server(self, url):
        self._urls.remove(url)
        return True


@pytest.fixture(autouse=True)
def _short_death_wait(monkeypatch):
    # deaths in these tests are visible from the start
    monkeypatch.setattr(port, "DEAD_SERVER_RETRY", dataclasses.replace(port.DEAD_SERVER_RETRY, deadline_s=0.2))


def test_spec_is_a_plain_value_every_rank_can_build():
    cfg = WeightSyncConfig(bucket_bytes=4096, dtype="bfloat16", api_key="k")
    spec = SyncSpec.of("distributed", [A + "/"], cfg)
    again = pickle.loads(pickle.dumps(spec))  # what the announcement to the other ranks carries
    assert again == spec and hash(again) == hash(spec) and spec.urls == (A,)
    assert spec.weight_config() == cfg
    ws = spec.build()
    assert type(ws).__name__ == "DistributedWeightSync" and ws.urls == [A] and ws.config == cfg
    assert type(SyncSpec.of("disk", [A], cfg).build()).__name__ == "DiskWeightSync"


def test_make_sync_port_follows_the_config(tmp_path):
    t, p = UpdateRecordingTrainer(), FakePool([A])
    assert isinstance(make_sync_port(WeightSyncConfig(), t, p, [A], tmp_path), DistributedSync)
    assert isinstance(make_sync_port(WeightSyncConfig(method="disk"), t, p, [A], tmp_path), DiskSync)


def test_distributed_then_disk_after_a_server_died(tmp_path):
    pool = FakePool([A, B])

    def fail(spec):
        if B in spec.urls and B in pool.dead:
            return RuntimeError(f"connection reset by {B}")
        return None

    trainer = UpdateRecordingTrainer(fail)
    sync = DistributedSync(trainer, pool, [A, B], tmp_path, WeightSyncConfig(timeout_s=5))
    asyncio.run(sync.sync(1))
    assert [(s.method, s.urls, v) for s, v in trainer.calls] == [("distributed", (A, B), 1)]
    pool.dead.add(B)
    metrics = asyncio.run(sync.sync(2))  # B died: the broadcast group is unusable -> disk without B
    assert sync.broken and "disk_sync_s" in metrics
    assert [(s.method, s.urls) for s, v in trainer.calls[1:] if v == 2][-1] == ("disk", (A,))
    assert pool.urls == [A]
    asyncio.run(sync.sync(3))  # and disk for the rest of the run
    assert trainer.calls[-1][0].method == "disk" and trainer.calls[-1][1] == 3
    disk_cfg = trainer.calls[-1][0].weight_config()
    assert disk_cfg.save_root == str(tmp_path) and disk_cfg.timeout_s == 5


def test_failure_with_every_server_alive_is_raised(tmp_path):
    trainer = UpdateRecordingTrainer(lambda spec: RuntimeError("bucket 3 refused by " + A))
    sync = DistributedSync(trainer, FakePool([A, B]), [A, B], tmp_path)
    with pytest.raises(RuntimeError, match="bucket 3 refused"):
        asyncio.run(sync.sync(1))
    assert not sync.broken and len(trainer.calls) == 1
    disk = DiskSync(trainer, FakePool([A]), tmp_path)
    with pytest.raises(RuntimeError, match="bucket 3 refused"):
        asyncio.run(disk.sync(1))
    assert len(trainer.calls) == 2  # not retried: nobody died


def test_liveness_is_probed_only_after_a_failure(tmp_path):
    """is_dead may be slow (a health probe of a paused server): a good sync never calls it."""
    pool = FakePool([A, B])
    probes = []
    pool.is_dead = lambda url: probes.append(url) or False
    sync = DistributedSync(UpdateRecordingTrainer(), pool, [A, B], tmp_path)
    asyncio.run(sync.sync(1))
    assert probes == []
