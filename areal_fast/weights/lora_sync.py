"""Adapter-only weight updates of a LoRA run (``train.lora``; docs/lora.md).

Each update gathers only the adapter matrices from the FSDP2 shards (collective, every trainer
rank), trainer rank 0 writes them as a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) under ``weights.save_root`` (the run's ``weights_sync/``), named by
version so no server can confuse two versions (vLLM keys its prefix cache by the adapter's path),
and tells every server to swap it in. The base weights never move. The previous version's
directory is removed once every server holds the new one (vLLM may re-read a loaded adapter's
directory when its CPU cache evicts it, so the current one stays).

Per server, after the controller paused generation (its configured pause mode):

* SGLang API (the embedded engine, SGLang): ``POST /unload_lora_adapter {lora_name}`` (skipped when
  the server does not hold it), ``POST /load_lora_adapter {lora_name, lora_path}``,
  ``POST /update_weight_version {new_version, abort_all_requests: false}``, and ``/flush_cache``
  with ``weights.flush_cache``. SGLang refuses to load a name it holds, and its unload waits until
  no request in flight uses the adapter, so the pause must abort (``rollout.pause_mode: abort``;
  the config refuses the others).
* vLLM API: ``[POST /pause if not paused]``, ``POST /v1/load_lora_adapter {lora_name, lora_path,
  load_inplace: true}`` (the adapter replaced under its id: requests kept by an in-place pause
  continue under the new one), ``POST /update_weight_version`` (0.27.0 on: the label the answers'
  per-token spans carry), ``[POST /resume]``.

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

from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.sync import SyncCalls, WeightSync

__all__ = ["LoRAAdapterSync", "adapter_tensors", "spec_extra", "transport_of_spec", "sglang_load_body",
           "sglang_unload_body", "sglang_weight_version_body", "vllm_load_body"]


# The bodies of the adapter calls (checked against each server's own request types in
# tests/trainer/test_lora_contract.py).
def sglang_load_body(name: str, path: str) -> dict:
    """SGLang ``POST /load_lora_adapter`` (LoadLoRAAdapterReqInput)."""
    return {"lora_name": name, "lora_path": path}


def sglang_unload_body(name: str) -> dict:
    """SGLang ``POST /unload_lora_adapter`` (UnloadLoRAAdapterReqInput)."""
    return {"lora_name": name}


def sglang_weight_version_body(version) -> dict:
    """SGLang ``POST /update_weight_version`` without its default abort of every request."""
    return {"new_version": str(version), "abort_all_requests": False}


def vllm_load_body(name: str, path: str) -> dict:
    """vLLM ``POST /v1/load_lora_adapter`` (LoadLoRAAdapterRequest), replacing a loaded one in place."""
    return {"lora_name": name, "lora_path": path, "load_inplace": True}


def adapter_tensors(state: dict) -> dict[str, torch.Tensor]:
    """PEFT file name -> full tensor of every adapter matrix of a (sharded) state dict with HF-style
    names (``actor.sharded_state_dict()``). Collective under FSDP2 (every rank, same order)."""
    from areal_fast.trainer.lora import file_name, is_adapter_param

    out = {}
    for k in sorted(state):
        if is_adapter_param(k):
            v = state[k]
            out[file_name(k)] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
    if not out:
        raise WeightSyncError("adapter-only update: the trainer's state has no LoRA matrices (train.lora unset?)")
    return out


class LoRAAdapterSync(WeightSync):
    """The adapter-only transport; see the module docstring. ``api``: 'sglang' or 'vllm'."""

    def __init__(self, servers, config: WeightSyncConfig | None = None, group=None, *, lora, api: str = "sglang",
                 base_model: str | None = None):
        super().__init__(servers, config, group)
        if api not in ("sglang", "vllm"):
            raise ValueError(f"api must be 'sglang' or 'vllm', got {api!r}")
        self.lora, self.api, self.base_model = lora, api, base_model
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
        from areal_fast.trainer.lora import write_adapter

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
            if self.api == "vllm":
                self._vllm_swap(path, version)
            else:
                self._sglang_swap(path, version)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, self.current = self.current, path
        if old and old != path:
            shutil.rmtree(old, ignore_errors=True)
        self.last_times.update(write_s=t1 - t0, load_s=time.perf_counter() - t1)

    # ------------------------------------------------------------------ SGLang
    def _sglang_swap(self, path: str, version: str) -> None:
        name = self.lora.name
        for _url, _answer, err in self.http.each(self.urls, "/unload_lora_adapter", sglang_unload_body(name)):
            if err is not None and "does not exist" not in str(err):
                raise err
        self.http.all(self.urls, "/load_lora_adapter", sglang_load_body(name, path))
        self.http.all(self.urls, "/update_weight_version", sglang_weight_version_body(version))
        if self.config.flush_cache:
            self.http.all(self.urls, "/flush_cache", None)

    # ------------------------------------------------------------------ vLLM
    @property
    def http(self) -> SyncCalls:
        if self._http is None:
            if self.api == "vllm":
                from areal_fast.backends.vllm.disk import VLLMDiskCalls

                self._http = VLLMDiskCalls(self.config.timeout_s, self.config.resolved_api_key)
            else:
                self._http = SyncCalls(self.config.timeout_s, self.config.resolved_api_key)
        return self._http

    def _vllm_swap(self, path: str, version: str) -> None:
        """The adapter at ``path`` loaded in place on every vLLM server, inside the disk update's
        pause and labelled ``version`` (``VLLMDiskCalls.update_paused``)."""
        http = self.http

        def update(calls, url: str):
            async def load(_b) -> None:
                await http._ask(calls, url, "/v1/load_lora_adapter", vllm_load_body(self.lora.name, path), "POST",
                                "the adapter")

            return http.update_paused(calls, url, load, version, "the adapter update")

        http.run_each(self.urls, update)

    def close(self) -> None:
        super().close()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------- port
def spec_extra(lora, api: str, base_model: str | None) -> tuple:
    items = [(f.name, tuple(v) if isinstance(v := getattr(lora, f.name), list) else v)
             for f in dataclasses.fields(lora)]
    return (("api", api), ("base_model", base_model), *items)


def transport_of_spec(spec) -> LoRAAdapterSync:
    """The transport of a ``SyncSpec`` whose method is 'lora_sglang' or 'lora_vllm' (every rank builds it)."""
    from areal_fast.trainer.lora_config import LoRAConfig

    extra = dict(spec.extra)
    api, base_model = extra.pop("api"), extra.pop("base_model")
    extra["target_modules"] = list(extra["target_modules"])
    return LoRAAdapterSync(list(spec.urls), spec.weight_config(), lora=LoRAConfig(**extra), api=api,
                           base_model=base_model)
