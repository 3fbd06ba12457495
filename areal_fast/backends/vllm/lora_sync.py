"""vLLM's adapter swap of a LoRA run's adapter-only updates (``weights/lora_sync.py`` writes the
adapter; docs/lora.md): per server ``[POST /pause if not paused]``, ``POST /v1/load_lora_adapter
{lora_name, lora_path, load_inplace: true}`` (the adapter replaced under its id: requests kept by
an in-place pause continue under the new one), ``POST /update_weight_version`` (0.27.0 on: the
label the answers' per-token spans carry), ``[POST /resume]``: the disk update's pause and label
(``disk.VLLMDiskCalls.update_paused``).
"""

from __future__ import annotations

from areal_fast.backends.vllm.disk import VLLMDiskCalls
from areal_fast.weights.lora_sync import LoRAAdapterSync

__all__ = ["VLLMLoRASync", "vllm_load_body"]


def vllm_load_body(name: str, path: str) -> dict:
    """vLLM ``POST /v1/load_lora_adapter`` (LoadLoRAAdapterRequest), replacing a loaded one in place
    (checked against vLLM's own request type in tests/trainer/test_lora_contract.py)."""
    return {"lora_name": name, "lora_path": path, "load_inplace": True}


class VLLMLoRASync(LoRAAdapterSync):
    """The adapter-only transport on vLLM servers (and the embedded engine's vLLM twin)."""

    @property
    def http(self) -> VLLMDiskCalls:
        if self._http is None:
            self._http = VLLMDiskCalls(self.config.timeout_s, self.config.resolved_api_key)
        return self._http

    def _swap(self, path: str, version: str) -> None:
        """The adapter at ``path`` loaded in place on every vLLM server, inside the disk update's
        pause and labelled ``version`` (``VLLMDiskCalls.update_paused``)."""
        http = self.http

        def update(calls, url: str):
            async def load(_b) -> None:
                await http._ask(calls, url, "/v1/load_lora_adapter", vllm_load_body(self.lora.name, path), "POST",
                                "the adapter")

            return http.update_paused(calls, url, load, version, "the adapter update")

        http.run_each(self.urls, update)
