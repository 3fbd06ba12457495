"""Adapters that turn the real parts into the controller's narrow ports.

- the rollout port is ``areal_fast.rollout.port.ClientRollout`` (beside the client it adapts: the
  rollout layer imports nothing from launch/)
- :class:`ActorTrainer`   <- ``areal_fast.trainer.PPOActor`` (rank 0 drives followers on other ranks)
- weight sync ports: ``areal_fast.weights.port`` (:class:`DistributedSync`, :class:`DiskSync`), re-exported
- :class:`ServiceReward`  <- ``areal_fast.reward.RewardService``

The controller's gate needs no adapter: ``areal_fast.rollout.staleness.StalenessManager`` is it.

Multi-rank trainers (torchrun): rank 0 runs the controller; every collective trainer call is
announced to the other ranks with one ``broadcast_object_list`` of ``(op, arg)`` first, and
:func:`follower_loop` on ranks > 0 executes the same call. Ops: train, save, load, state, export, wsync, stop.
"""

from __future__ import annotations

import logging
from pathlib import Path

from areal_fast.weights.port import DiskSync, DistributedSync, make_sync_port  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- trainer


class ActorTrainer:
    """TrainerPort over PPOActor. On rank 0 of a multi-rank run every call is announced first."""

    def __init__(self, actor):
        self.actor = actor
        self.world = actor.world
        self.weight_syncs: dict = {}  # this rank's weight-sync transports, one per SyncSpec

    def update_weights(self, spec, version: int) -> None:
        """Run the weight update ``spec`` (``areal_fast.weights.port.SyncSpec``) to the controller's
        ``version`` on every rank."""
        self._announce("wsync", (spec, version))
        apply_update(self.weight_syncs, spec, version, self.actor.sharded_state_dict())

    def _announce(self, op: str, arg=None) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list([(op, arg)], src=0)

    def train(self, samples: list[dict], version: int) -> dict:
        """One step from the weights of the controller's ``version`` (every rank is told it)."""
        self._announce("train", version)
        return self.actor.train_batch(samples, version)

    def save(self, path: Path, version: int) -> None:
        from areal_fast.trainer import save_checkpoint

        self._announce("save", (str(path), version))
        save_checkpoint(self.actor, str(path), version)

    def check(self, path: Path) -> int:
        """Raise if the trainer checkpoint at ``path`` cannot be read (rank 0 only, before the
        collective load is announced, so a corrupt checkpoint never reaches the other ranks): its
        state file (read without running code), its DCP metadata and the length of every shard.
        Returns the trainer version it holds (the controller compares it with its own)."""
        from areal_fast.trainer.checkpoint import verify_checkpoint

        return verify_checkpoint(str(path))["version"]

    def load(self, path: Path) -> None:
        """Load the checkpoint on every rank; a damaged file is a :class:`CorruptCheckpoint` (the
        controller moves the checkpoint aside and tries the previous one, the followers wait)."""
        from areal_fast.checkpoint import CorruptCheckpoint
        from areal_fast.trainer import CheckpointError, load_checkpoint

        self._announce("load", str(path))
        try:
            load_checkpoint(self.actor, str(path))
        except CheckpointError as e:
            raise CorruptCheckpoint(str(e)) from e

    def full_state_dict(self) -> dict:
        self._announce("state")
        return self.actor.full_state_dict()

    def export(self, path: Path) -> None:
        from areal_fast.trainer import export_hf

        self._announce("export", str(path))
        export_hf(self.actor, str(path))

    def stop(self) -> None:
        self._announce("stop")


def apply_update(transports: dict, spec, version: int, state) -> None:
    """One rank's part of the weight update ``spec`` to ``version`` (collective; rank 0 talks to the
    servers). ``transports``: this rank's cache, one transport per spec, so the weight group is
    created once and reused; a new spec of the same method (the servers changed) closes the old one."""
    ws = transports.get(spec)
    if ws is None:
        for old in [s for s in transports if s.method == spec.method]:
            close_superseded(transports.pop(old), spec.urls)  # servers changed: the group is formed again
        ws = transports[spec] = spec.build()
    ws.update(state, version)


def close_superseded(transport, still_members) -> None:
    """Close a transport whose servers changed (``weights.membership``): its group is destroyed on this
    rank and on the servers that are members of the new group (the others died, hung or left: a call
    to a hung one would wait for the whole sync timeout)."""
    if hasattr(transport, "urls"):
        transport.urls = [u for u in transport.urls if u in set(still_members)]
    try:
        transport.close()
    except Exception as e:  # noqa: BLE001 - the old group may have a dead member; the new one does not
        log.warning("closing the weight transport to %s: %s", getattr(transport, "urls", "?"), e)


def follower_loop(actor) -> None:
    """Ranks > 0: execute rank 0's announced trainer calls until 'stop' (or rank 0 vanishes); each op
    is one function of :data:`FOLLOWER_OPS`."""
    import torch.distributed as dist

    syncs: dict = {}  # this rank's weight transports (each rank holds its own: it joins the gathers)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, arg = box[0]
        if op == "stop":
            return
        follow = FOLLOWER_OPS.get(op)
        if follow is None:
            raise RuntimeError(f"follower: unknown op {op!r} from rank 0")
        follow(actor, arg, syncs)


def _follow_train(actor, version, _syncs) -> None:
    actor.train_batch(None, version)


def _follow_save(actor, path_version, _syncs) -> None:
    from areal_fast.trainer import save_checkpoint

    save_checkpoint(actor, *path_version)


def _follow_load(actor, path, _syncs) -> None:
    from areal_fast.trainer import CheckpointError, load_checkpoint

    try:
        load_checkpoint(actor, path)
    except CheckpointError as e:  # rank 0 got it too (DCP's load is collective): it falls back
        log.warning("follower: checkpoint %s not loaded (%s); waiting for rank 0", path, e)


def _follow_state(actor, _arg, _syncs) -> None:
    actor.full_state_dict()


def _follow_export(actor, path, _syncs) -> None:
    from areal_fast.trainer import export_hf

    export_hf(actor, path)


def _follow_wsync(actor, spec_version, syncs: dict) -> None:
    from areal_fast.weights import WeightSyncError

    spec, version = spec_version
    try:
        apply_update(syncs, spec, version, actor.sharded_state_dict())
    except WeightSyncError as e:
        # Rank 0 got the same error (the transports share it with every rank) and decides: it
        # retries without a dead server (a new wsync follows) or ends the run (then the next
        # broadcast fails here). A follower that exited here would kill a run that rank 0 was about
        # to save.
        log.warning("follower: weight update to version %s failed (%s); waiting for rank 0", version, e)


# op -> what a follower does with its argument (rank 0's side: ActorTrainer's announcements)
FOLLOWER_OPS = {"train": _follow_train, "save": _follow_save, "load": _follow_load, "state": _follow_state,
                "export": _follow_export, "wsync": _follow_wsync}


# ----------------------------------------------------------------------------- reward


class ServiceReward:
    """RewardPort over RewardService with the configured reward name as default."""

    def __init__(self, service):
        self.service = service

    async def score(self, task, completion):
        return await self.service.score(dict(task), completion)
