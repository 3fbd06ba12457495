"""Adapter-only weight updates of a LoRA run (``train.lora``; docs/lora.md).

Each update gathers only the adapter matrices from the FSDP2 shards (collective, every trainer
rank), trainer rank 0 writes them as a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) under ``weights.save_root`` (the run's ``weights_sync/``), named by
version so no server can confuse two versions (vLLM keys its prefix cache by the adapter's path),
and tells every server to swap it in. The base weights never move. The previous version's
directory is removed once every server holds the new one (vLLM may re-read a loaded adapter's
directory when its CPU cache evicts it, so the current one stays).

Per server, after the controller paused generation (its configured pause mode), the server's API
swaps the adapter in (``_swap``): SGLang's in ``backends/sglang/lora_sync.py``, vLLM's in
``backends/vllm/lora_sync.py``; the run's API picks the class (``backends.registry.lora_transport``).

Every request of the run names the adapter (``lora_path`` / ``model``), so tokens are labelled by
the server's weight version exactly as for full-weight updates.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import uuid

import torch
import torch.distributed as dist

from areal_fast.lora_config import LoRAConfig
from areal_fast.weights.adapter import file_name, is_adapter_param, write_adapter
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.sync import WeightSync

__all__ = ["LoRAAdapterSync", "adapter_tensors", "spec_extra", "transport_of_spec"]


def adapter_tensors(state: dict) -> dict[str, torch.Tensor]:
    """PEFT file name -> full tensor of every adapter matrix of a (sharded) state dict with HF-style
    names (``actor.sharded_state_dict()``). Collective under FSDP2 (every rank, same order)."""
    out = {}
    for k in sorted(state):
        if is_adapter_param(k):
            v = state[k]
            out[file_name(k)] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
    if not out:
        raise WeightSyncError("adapter-only update: the trainer's state has no LoRA matrices (train.lora unset?)")
    return out


class LoRAAdapterSync(WeightSync):
    """The adapter-only transport; see the module docstring. What one server's API does with the
    written adapter (``_swap``) is its backend's subclass: ``backends/sglang/lora_sync.py``,
    ``backends/vllm/lora_sync.py``."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None, *, lora,
                 base_model: str | None = None):
        super().__init__(servers, config, group)
        self.lora, self.base_model = lora, base_model
        self.current: str | None = None  # the directory the servers hold now
        self.last_bytes = 0
        self.last_times: dict[str, float] = {}

    def _collect(self, model_or_state):
        t0 = time.perf_counter()
        state = model_or_state if isinstance(model_or_state, dict) else {
            k: v for k, v in model_or_state.state_dict().items()}
        tensors = adapter_tensors(state)
        self.last_times = {"gather_s": time.perf_counter() - t0}
        return tensors

    def _send(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        if self.rank != 0:
            return
        root = self.config.save_root
        t0 = time.perf_counter()
        try:
            os.makedirs(root, exist_ok=True) if root else None
            path = os.path.join(root or "/tmp", f"{self.lora.name}-v{version}-{uuid.uuid4().hex[:8]}")
            self.last_bytes = write_adapter(path, tensors, self.lora, self.base_model,
                                            metadata={"weight_version": str(version)})
        except OSError as e:
            raise WeightSyncError(f"cannot write the adapter under {root or '/tmp'}: {e}") from e
        t1 = time.perf_counter()
        try:
            self._swap(path, version)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, self.current = self.current, path
        if old and old != path:
            shutil.rmtree(old, ignore_errors=True)
        self.last_times.update(write_s=t1 - t0, load_s=time.perf_counter() - t1)

    def _swap(self, path: str, version: str) -> None:
        """Every server drops the adapter it holds and serves the one at ``path``, labelled ``version``."""
        raise NotImplementedError(f"{type(self).__name__}: swapping the adapter is the server API's")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------- port
def spec_extra(lora, base_model: str | None) -> tuple:
    """A LoRA run's settings as a ``SyncSpec``'s hashable, picklable ``extra``."""
    items = [(f.name, tuple(v) if isinstance(v := getattr(lora, f.name), list) else v)
             for f in dataclasses.fields(lora)]
    return (("base_model", base_model), *items)


def transport_of_spec(spec) -> LoRAAdapterSync:
    """The transport of a ``SyncSpec`` of method 'lora' (every rank builds it): ``spec.transport``,
    the server API's :class:`LoRAAdapterSync` subclass, with the run's LoRA settings."""
    extra = dict(spec.extra)
    base_model = extra.pop("base_model")
    extra["target_modules"] = list(extra["target_modules"])
    return spec.transport(list(spec.urls), spec.weight_config(), lora=LoRAConfig(**extra), base_model=base_model)
