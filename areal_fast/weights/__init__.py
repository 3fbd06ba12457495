"""Weight resharding and sync from FSDP2 trainers to inference servers.

* :mod:`.layout` - HF <-> SGLang layouts (Qwen2/Qwen2.5, Qwen3, Llama), TP splits;
* :mod:`.plan` - the reshard planner (C++ ``csrc/reshard/``) and its Python reference;
* :mod:`.interval_copy` - executes plans (CUDA kernel / C++ CPU / torch reference);
* :mod:`.gather` - FSDP2 shards -> flattened buckets on rank 0, pipelined;
* :mod:`.config` - :class:`WeightSyncConfig`, the one configuration (torch-free);
* :mod:`.group` - the weight-update process group (hosted store, backend choice);
* :mod:`.sync` - :class:`WeightSync` transports (distributed broadcast, disk), sessions;
* :mod:`.colocated` - per-TP-rank SGLang shards through CUDA IPC (GPU only);
* :mod:`.port` - the controller's sync port over those transports, with the disk fallback;
* :mod:`.errors` - :class:`WeightSyncError`. Calls to the servers go through ``areal_fast.rollout.calls``.

The protocol is described in ``docs/weight_sync.md``.

Submodules are imported lazily; ``import areal_fast.weights`` does not load the native core.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "WeightSync": "sync", "DistributedWeightSync": "sync", "DiskWeightSync": "sync", "WeightSyncConfig": "config",
    "ServerFacts": "group", "WeightSyncError": "errors", "ModelSpec": "layout", "ColocatedWeightSync": "colocated",
    "DistributedSync": "port", "DiskSync": "port", "make_sync_port": "port", "padded_vocab_size": "layout",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"areal_fast.weights.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'areal_fast.weights' has no attribute {name!r}")
