"""SGLang's adapter swap of a LoRA run's adapter-only updates (``weights/lora_sync.py`` writes the
adapter; docs/lora.md): per server ``POST /unload_lora_adapter {lora_name}`` (skipped when the
server does not hold it), ``POST /load_lora_adapter {lora_name, lora_path}``, ``POST
/update_weight_version {new_version, abort_all_requests: false}``, and ``/flush_cache`` with
``weights.flush_cache``. SGLang refuses to load a name it holds, and its unload waits until no
request in flight uses the adapter, so the pause must abort (``rollout.pause_mode: abort``; the
config refuses the others).
"""

from __future__ import annotations

from areal_fast.weights.lora_sync import LoRAAdapterSync

__all__ = ["SGLangLoRASync", "sglang_load_body", "sglang_unload_body", "sglang_weight_version_body"]


# The bodies of the adapter calls (checked against SGLang's own request types in
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


class SGLangLoRASync(LoRAAdapterSync):
    """The adapter-only transport on SGLang servers (and the embedded engine); see the module docstring."""

    def _swap(self, path: str, version: str) -> None:
        name = self.lora.name
        for _url, _answer, err in self.http.each(self.urls, "/unload_lora_adapter", sglang_unload_body(name)):
            if err is not None and "does not exist" not in str(err):
                raise err
        self.http.all(self.urls, "/load_lora_adapter", sglang_load_body(name, path))
        self.http.all(self.urls, "/update_weight_version", sglang_weight_version_body(version))
        if self.config.flushes:
            self.http.all(self.urls, "/flush_cache", None)
