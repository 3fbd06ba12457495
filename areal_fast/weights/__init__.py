"""Weight resharding and sync from FSDP2 trainers to inference servers.

* :mod:`.layout` - HF <-> SGLang layouts (Qwen2/Qwen2.5, Qwen3, Llama), TP splits;
* :mod:`.plan` - the reshard planner (C++ ``csrc/reshard/``) and its Python reference;
* :mod:`.interval_copy` - executes plans (CUDA kernel / C++ CPU / torch reference);
* :mod:`.gather` - FSDP2 shards -> flattened buckets on rank 0, pipelined;
* :mod:`.config` - :class:`WeightSyncConfig`, the one configuration (torch-free);
* :mod:`.group` - the weight-update process group (hosted store, backend choice);
* :mod:`.sync` - the :class:`WeightSync` interface of every transport and what they share;
* :mod:`.colocated` - the per-TP-rank SGLang-layout shards of a colocated update (GPU only);
* :mod:`.port` - the controller's sync port over the transport the layer above passes in;
* :mod:`.lora_sync`, :mod:`.lora_port` - a LoRA run's adapter-only updates and their port.

The transports that speak one server's API live with it (``areal_fast.backends.sglang.weight_sync``,
``.colocated``, ``.lora_sync``; ``areal_fast.backends.vllm.transfer``, ``.disk``, ``.lora_sync``) and
are chosen by ``areal_fast.backends.registry``: this package names no backend.
* :mod:`.errors` - :class:`WeightSyncError`. Calls to the servers go through ``areal_fast.rollout.calls``.

The protocol is described in ``docs/weight_sync.md``.

Submodules are imported lazily; ``import areal_fast.weights`` does not load the native core.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "WeightSync": "sync", "WeightSyncConfig": "config", "ServerFacts": "group", "WeightSyncError": "errors",
    "ModelSpec": "layout", "DistributedSync": "port", "DiskSync": "port", "make_sync_port": "port",
    "padded_vocab_size": "layout",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"areal_fast.weights.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'areal_fast.weights' has no attribute {name!r}")
