"""The inference backends by name: the one place the layers above (config, launch, controller) turn
``rollout.api`` into its rollout-client adapter and its weight and adapter transports (a launched
server's command: ``backends/server_command.py``).

    from areal_fast.backends.registry import make_client
    client = make_client(cfg.rollout, urls, api_key=key)       # SGLangRolloutClient or VLLMRolloutClient

The rollout layer defines the client interface (``areal_fast.rollout.client.RolloutClient``) and
never imports this module: its users pass the class along (``ShardedRollout(client_class=...)``).
Adapters are imported on first use (the vLLM one needs nothing the SGLang one does not, but the
config loader stays light).
"""

from __future__ import annotations

import importlib

from areal_fast.rollout.client import RolloutClient

# backend name -> "module:class" of its rollout-client adapter
CLIENTS = {
    "sglang": "areal_fast.backends.sglang.client:SGLangRolloutClient",
    "vllm": "areal_fast.backends.vllm.client:VLLMRolloutClient",
}
BACKENDS = tuple(CLIENTS)


def _load(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def client_class(backend: str) -> type[RolloutClient]:
    """The rollout-client adapter of ``backend`` ('sglang' or 'vllm'); ValueError naming an unknown one."""
    if backend not in CLIENTS:
        raise ValueError(f"rollout.api must be one of {BACKENDS}, got {backend!r}")
    return _load(CLIENTS[backend])


def client_options(rollout_cfg) -> dict:
    """The adapter's own options a run's ``rollout`` section sets (vLLM: the release assumed for a
    server whose /version has not answered yet)."""
    return {"vllm_version": rollout_cfg.vllm_version} if rollout_cfg.api == "vllm" else {}


def make_client(rollout_cfg, urls: list[str], **options) -> RolloutClient:
    """The rollout client of a run's ``rollout`` section over ``urls`` (``options``: the client's)."""
    return client_class(rollout_cfg.api)(urls, **client_options(rollout_cfg), **options)


# (API, weights.method) -> "module:class" of the servers' weight-sync transport (built on every trainer rank)
WEIGHT_TRANSPORTS = {
    ("sglang", "distributed"): "areal_fast.backends.sglang.weight_sync:DistributedWeightSync",
    ("sglang", "disk"): "areal_fast.backends.sglang.weight_sync:DiskWeightSync",
    ("vllm", "distributed"): "areal_fast.backends.vllm.transfer:VLLMTransferWeightSync",
    ("vllm", "disk"): "areal_fast.backends.vllm.disk:VLLMDiskWeightSync",
}
# API -> "module:class" of its adapter-only transport of a LoRA run
LORA_TRANSPORTS = {
    "sglang": "areal_fast.backends.sglang.lora_sync:SGLangLoRASync",
    "vllm": "areal_fast.backends.vllm.lora_sync:VLLMLoRASync",
}


def weight_transport(api: str, method: str) -> type:
    """The weight-sync transport class (``areal_fast.weights.sync.WeightSync``) of servers speaking
    ``api`` for ``weights.method`` ('distributed' or 'disk'), for ``weights.port.make_sync_port``."""
    if (api, method) not in WEIGHT_TRANSPORTS:
        raise ValueError(f"no weight transport for rollout.api {api!r} and weights.method {method!r} "
                         f"(known: {sorted(WEIGHT_TRANSPORTS)})")
    return _load(WEIGHT_TRANSPORTS[api, method])


def lora_transport(api: str) -> type:
    """The adapter-only transport class (``weights.lora_sync.LoRAAdapterSync``) of servers speaking ``api``."""
    if api not in LORA_TRANSPORTS:
        raise ValueError(f"rollout.api must be one of {tuple(LORA_TRANSPORTS)}, got {api!r}")
    return _load(LORA_TRANSPORTS[api])
