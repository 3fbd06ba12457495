"""Adapters that turn the real parts into the controller's narrow ports.

- :class:`ClientRollout`  <- ``areal_fast.rollout.client.RolloutClient`` (pool, interruptible generate)
- :class:`ActorTrainer`   <- ``areal_fast.trainer.PPOActor`` (rank 0 drives followers on other ranks)
- :class:`DiskSync`       <- safetensors of the full state dict + /update_weights_from_disk on every server
- :class:`RewardPort`     <- ``areal_fast.reward.RewardService``
- :class:`ManagerGate`    <- ``areal_fast.rollout.staleness.StalenessManager``

Multi-rank trainers (torchrun): rank 0 runs the controller; every collective trainer call is
announced to the other ranks with one ``broadcast_object_list`` of ``(op, arg)`` first, and
:func:`follower_loop` on ranks > 0 executes the same call. Ops: train, save, load, state, export, stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path

from areal_fast.controller import Generation

log = logging.getLogger(__name__)
_DEATH_VISIBLE_S = 3.0  # how long a failed control call waits for a server's death to show


# ----------------------------------------------------------------------------- rollout


class ClientRollout:
    """RolloutPort over ``RolloutClient``; knows how to forget a dead server.

    Control calls (pause, continue, weight updates) go to every server; when one fails, the
    servers whose process is gone (``is_dead(url)``) are dropped and the call is retried on the
    others. A failure with every server alive is re-raised."""

    def __init__(self, client, is_dead=None):
        self.client = client
        self.is_dead = is_dead or (lambda url: False)

    async def control(self, fn, what: str, attempts: int = 3):
        """Run ``await fn()`` (a call on all servers), dropping dead servers between attempts."""
        for attempt in range(attempts):
            try:
                return await fn()
            except Exception as e:  # noqa: BLE001 - a dead server is dropped, anything else re-raised
                # a connection reset can arrive a moment before the process is seen to exit
                deadline = time.monotonic() + _DEATH_VISIBLE_S
                dead = [u for u in self.urls if self.is_dead(u)]
                while not dead and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    dead = [u for u in self.urls if self.is_dead(u)]
                if not dead or attempt == attempts - 1:
                    raise RuntimeError(f"{what} failed: {e!r}") from e
                for u in dead:
                    log.warning("%s: server %s died; continuing with the others", what, u)
                    self.remove_server(u)

    async def generate(self, input_ids, sampling, rid) -> Generation:
        r = await self.client.generate(list(input_ids), sampling, rid=rid)
        return Generation(output_ids=list(r.output_ids), logprobs=list(r.output_logprobs),
                          versions=list(r.output_versions), finish_reason=r.finish_reason)

    async def pause(self) -> None:
        await self.control(self.client.pause_all, "pause_generation")

    async def resume(self) -> None:
        await self.control(self.client.continue_all, "continue_generation")

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.client.servers]

    def remove_server(self, url: str) -> bool:
        """Drop ``url`` from the pool (requests in flight there are retried elsewhere by the client)."""
        url = url.rstrip("/")
        if url in self.urls and len(self.client.servers) == 1:
            raise RuntimeError(f"the last inference server {url} died; cannot continue")
        return self.client.remove_server(url)


# ----------------------------------------------------------------------------- trainer


class ActorTrainer:
    """TrainerPort over PPOActor. On rank 0 of a multi-rank run every call is announced first."""

    def __init__(self, actor):
        self.actor = actor
        self.world = actor.world

    def _announce(self, op: str, arg=None) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list([(op, arg)], src=0)

    def train(self, samples: list[dict]) -> dict:
        self._announce("train")
        return self.actor.train_batch(samples)

    def save(self, path: Path) -> None:
        from areal_fast.trainer import save_checkpoint

        self._announce("save", str(path))
        save_checkpoint(self.actor, str(path))

    def load(self, path: Path) -> None:
        from areal_fast.trainer import load_checkpoint

        self._announce("load", str(path))
        load_checkpoint(self.actor, str(path))

    def full_state_dict(self) -> dict:
        self._announce("state")
        return self.actor.full_state_dict()

    def export(self, path: Path) -> None:
        from areal_fast.trainer import export_hf

        self._announce("export", str(path))
        export_hf(self.actor, str(path))

    def stop(self) -> None:
        self._announce("stop")


def follower_loop(actor) -> None:
    """Ranks > 0: execute rank 0's announced trainer calls until 'stop' (or rank 0 vanishes)."""
    import torch.distributed as dist

    from areal_fast.trainer import export_hf, load_checkpoint, save_checkpoint

    syncs: dict = {}
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, arg = box[0]
        if op == "train":
            actor.train_batch(None)
        elif op == "save":
            save_checkpoint(actor, arg)
        elif op == "load":
            load_checkpoint(actor, arg)
        elif op == "state":
            actor.full_state_dict()
        elif op == "export":
            export_hf(actor, arg)
        elif op == "wsync":
            spec, version = arg
            if spec not in syncs:  # each rank holds its own sync object (it joins the gathers)
                syncs[spec] = make_distributed_sync(*spec)
            syncs[spec].update(actor.sharded_state_dict(), version)
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"follower: unknown op {op!r} from rank 0")


# ----------------------------------------------------------------------------- weight sync


class DiskSync:
    """SyncPort: write the full HF state dict as safetensors, then /update_weights_from_disk on
    every live server with ``weight_version``. The controller has already paused generation.

    A server that cannot be reached is checked; if its process is gone it is dropped from the
    pool (``on_dead(url)``) and the sync goes on with the others. A live server answering
    success=false fails the sync (the version is not bumped)."""

    def __init__(self, trainer: ActorTrainer, rollout: ClientRollout, work_dir: Path):
        self.trainer, self.rollout = trainer, rollout
        self.work_dir = Path(work_dir)
        self._last: Path | None = None

    def _write(self, version: int) -> Path:
        from safetensors.torch import save_file

        sd = self.trainer.full_state_dict()
        d = self.work_dir / f"v{version:08d}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
        return d

    async def sync(self, version: int) -> dict:
        t0 = time.perf_counter()
        d = await asyncio.to_thread(self._write, version)
        t1 = time.perf_counter()
        client = self.rollout.client

        async def update():
            await client.flush_cache_all()
            await client.begin_weight_update_all()
            try:
                await client.update_weights_from_disk(str(d), weight_version=str(version))
            finally:
                await client.end_weight_update_all()

        await self.rollout.control(update, f"weight sync to version {version}")
        if self._last is not None and self._last != d:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = d
        nbytes = sum(f.stat().st_size for f in d.iterdir())
        return {"write_s": t1 - t0, "load_s": time.perf_counter() - t1, "bytes": nbytes}


def make_distributed_sync(urls: tuple, bucket_bytes: int, timeout_s: float, dtype_name: str | None):
    import torch

    from areal_fast.weights import DistributedWeightSync, WeightSyncConfig

    dtype = getattr(torch, dtype_name) if dtype_name else None
    # Servers on other machines (Ray launcher) reach rank 0 at AREAL_FAST_HOST, not loopback.
    master = os.environ.get("AREAL_FAST_HOST", "127.0.0.1")
    return DistributedWeightSync(list(urls), WeightSyncConfig(bucket_bytes=bucket_bytes, dtype=dtype,
                                                              timeout_s=timeout_s, master_addr=master))


class DistributedSync:
    """SyncPort over ``areal_fast.weights.DistributedWeightSync`` (SGLang's broadcast protocol,
    gloo on CPU / NCCL on GPU, flattened buckets, group created once). Every trainer rank takes
    part (followers get a 'wsync' announcement). If a server of the group dies, the broadcast
    group is unusable; the sync then falls back to :class:`DiskSync` for the rest of the run."""

    def __init__(self, trainer: ActorTrainer, rollout: ClientRollout, urls: list[str], work_dir: Path,
                 bucket_bytes: int, timeout_s: float, device_type: str):
        # fp32 on CPU: the engine computes in fp32 there, and the behaviour log-probs must match
        self.spec = (tuple(urls), bucket_bytes, timeout_s, "bfloat16" if device_type == "cuda" else None)
        self.ws = make_distributed_sync(*self.spec)
        self.trainer, self.rollout = trainer, rollout
        self.fallback = DiskSync(trainer, rollout, work_dir)
        self.broken = False

    def _lost(self) -> list[str]:
        live = set(self.rollout.urls)
        return [t.url for t in self.ws.servers if t.url not in live or self.rollout.is_dead(t.url)]

    def _update(self, version: int) -> None:
        self.trainer._announce("wsync", (self.spec, version))
        self.ws.update(self.trainer.actor.sharded_state_dict(), version)

    async def sync(self, version: int) -> dict:
        if self.broken:
            return await self.fallback.sync(version)
        t0 = time.perf_counter()
        try:
            await self.rollout.control(self.rollout.client.flush_cache_all, "flush_cache")
            if self._lost():  # a member of the broadcast group is gone: do not even start a broadcast
                raise RuntimeError(f"servers left the pool: {self._lost()}")
            await asyncio.to_thread(self._update, version)
        except Exception as e:  # noqa: BLE001
            # A connection reset can arrive a moment before the server's exit is visible.
            deadline = time.monotonic() + _DEATH_VISIBLE_S
            while not self._lost() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if not self._lost():
                raise
            log.warning("distributed weight sync impossible after a server died (%r); using disk sync from now on", e)
            self.broken = True
            return await self.fallback.sync(version)
        return {"broadcast_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- reward and gate


class ServiceReward:
    """RewardPort over RewardService with the configured reward name as default."""

    def __init__(self, service):
        self.service = service

    async def score(self, task, completion):
        return await self.service.score(dict(task), completion)


class ManagerGate:
    """The controller's Gate over ``StalenessManager``."""

    def __init__(self, manager):
        self.m = manager

    def try_admit(self) -> bool:
        return self.m.try_admit()

    def finish(self, accepted: bool) -> None:
        (self.m.on_accept if accepted else self.m.on_reject)()

    def check_consumed(self, token_versions: list[int]) -> bool:
        return self.m.check_consumed(token_versions)

    def set_version(self, version: int) -> None:
        if version >= self.m.version:
            self.m.set_version(version)

    def recover(self, version: int, accepted: int) -> None:
        # Restored buffered groups were accepted before the crash and still count against the bound.
        self.m.restore(version, accepted=accepted)

    def stats(self) -> dict:
        s = self.m.stats
        return {"accepted": self.m.accepted, "running": self.m.running, "bound": self.m.bound(),
                "admitted": s.admitted, "dropped_stale": s.dropped_stale}
