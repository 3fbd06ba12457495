"""Contract: every request body weight sync sends parses with SGLang's own request types.

The bodies are captured from real updates (distributed, with several buckets and per-tensor,
and disk) against recording fake servers (tests/fakes.py), then validated the way
SGLang's HTTP server reads a ``Body()`` argument: a pydantic ``TypeAdapter`` of the request type
from ``sglang.srt.managers.io_struct`` of the released wheel (0.5.6 and 0.5.23, imported on CPU
through tests/sglang_wheel.py). Skipped only when the wheel cannot be downloaded.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
from areal_fast.weights.config import WeightSyncConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakes import FakeServer  # noqa: E402
from sglang_wheel import sglang_module  # noqa: E402

TYPES = {  # endpoint -> SGLang request type
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}


def _captured_bodies(version: str, tmp_path) -> list[tuple[str, dict]]:
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(40, 16, generator=g),
             "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g),
             "model.norm.weight": torch.randn(16, generator=g)}
    server = FakeServer(version=version)
    cfg = dict(bucket_bytes=1 << 10, dtype="bfloat16", collective="gloo", timeout_s=30)
    try:
        ws = DistributedWeightSync([server.url], WeightSyncConfig(**cfg))
        try:
            ws.update(state, 1)
            ws.config.load_format = None  # per-tensor broadcasts
            ws.update(state, 2)
        finally:
            ws.close()
        DiskWeightSync([server.url], WeightSyncConfig(**cfg, save_root=str(tmp_path))).update(state, 3)
    finally:
        server.close()
    return [(p, b) for p, b, _ in server.calls if p in TYPES]


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_every_body_parses_with_sglang_types(version, tmp_path):
    from pydantic import TypeAdapter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns about its GPU-only quantization methods on CPU
        io = sglang_module(version, "sglang.srt.managers.io_struct")
    bodies = _captured_bodies(version, tmp_path)
    sent = {p for p, _ in bodies}
    want = set(TYPES) - ({"/begin_weight_update", "/end_weight_update"} if version == "0.5.6" else set())
    assert sent == want, f"endpoints sent to a {version} server: {sorted(sent)}"
    for path, body in bodies:
        req = TypeAdapter(getattr(io, TYPES[path])).validate_python(body)
        for key, value in body.items():  # every field we send lands, with our value
            assert getattr(req, key) == value, (version, path, key)
        if path == "/update_weights_from_disk":
            assert req.load_format in ("auto", "safetensors")


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_sglang_types_refuse_a_misspelled_body(version):
    """The check above can fail: SGLang's types refuse a wrong type."""
    from pydantic import TypeAdapter, ValidationError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        io = sglang_module(version, "sglang.srt.managers.io_struct")
    with pytest.raises(ValidationError):
        TypeAdapter(io.InitWeightsUpdateGroupReqInput).validate_python(
            {"master_address": "127.0.0.1", "master_port": "not a port", "rank_offset": 1, "world_size": 2})
