"""Ranks > 0 follow rank 0's announced trainer calls (``launch.runtime.follower_loop``)."""

from __future__ import annotations

import torch.distributed as dist

from areal_fast.launch import runtime
from areal_fast.weights import WeightSyncError


class _Actor:
    def sharded_state_dict(self):
        return {}


def test_a_failed_weight_update_does_not_end_the_follower(monkeypatch):
    """A weight update that fails (a server died mid-update) raises on every rank; rank 0 retries
    without the dead server, so the follower must take part in the retry instead of exiting."""
    ops = [("wsync", ("spec-with-dead-server", 3)), ("wsync", ("spec-without-it", 3)), ("stop", None)]
    applied = []

    def announce(box, src=0):
        box[0] = ops.pop(0)

    def apply_update(transports, spec, version, state):
        applied.append(spec)
        if spec == "spec-with-dead-server":
            raise WeightSyncError("http://127.0.0.1:1/update_weights_from_disk: Connection reset by peer")

    monkeypatch.setattr(dist, "broadcast_object_list", announce)
    monkeypatch.setattr(runtime, "apply_update", apply_update)
    runtime.follower_loop(_Actor())  # returns at "stop"
    assert applied == ["spec-with-dead-server", "spec-without-it"] and not ops
