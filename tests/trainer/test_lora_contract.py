"""The adapter calls and the LoRA launch flags, checked against each server's own sources: our
bodies parse with SGLang's and vLLM's request types, and vLLM's argument parser defines our flags."""

import dataclasses

import pytest

from areal_fast.backends.sglang.lora_sync import sglang_load_body, sglang_unload_body, sglang_weight_version_body
from areal_fast.backends.vllm.lora_sync import vllm_load_body
from areal_fast.lora_config import LoRAConfig, server_lora_args

pytestmark = pytest.mark.slow  # imports (and on first use downloads) the servers' sources


@pytest.mark.parametrize("version", ["0.27.0", "0.33.0"])
def test_vllm_takes_our_adapter_load_body_and_lora_flags(version):
    from vllm_wheel import unknown_vllm_flags, vllm_module

    protocol = vllm_module(version, "vllm.entrypoints.serve.lora.protocol")
    req = protocol.LoadLoRAAdapterRequest(**vllm_load_body("areal-lora", "/tmp/a"))
    assert (req.lora_name, req.lora_path, req.load_inplace) == ("areal-lora", "/tmp/a", True)
    protocol.UnloadLoRAAdapterRequest(lora_name="areal-lora")
    assert unknown_vllm_flags(version, server_lora_args("vllm", LoRAConfig(rank=12))) == []


def test_sglang_takes_our_adapter_and_version_bodies():
    from sglang_wheel import sglang_module

    io = sglang_module("0.5.6", "sglang.srt.managers.io_struct")
    body = sglang_load_body("areal-lora", "/tmp/a")
    assert {f.name for f in dataclasses.fields(io.LoadLoRAAdapterReqInput)} >= set(body)
    io.LoadLoRAAdapterReqInput(**body)
    io.UnloadLoRAAdapterReqInput(**sglang_unload_body("areal-lora"))
    v = io.UpdateWeightVersionReqInput(**sglang_weight_version_body(3))
    assert (v.new_version, v.abort_all_requests) == ("3", False)
    assert "lora_path" in {f.name for f in dataclasses.fields(io.GenerateReqInput)}
