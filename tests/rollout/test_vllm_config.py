"""rollout.backend 'vllm' at config load: accepted where vLLM serves it, refused with the reason where
not (the version, pause mode, weights method and engine rules of ``backends/vllm/compat.py``); and the
request builders' own refusals. Torch-free, fast."""

from __future__ import annotations

import pytest

from areal_fast.backends.vllm import requests as vr
from areal_fast.backends.vllm.compat import VLLMBehaviour, auto_vllm_pause_mode, vllm_refusal
from areal_fast.backends.vllm.server_command import vllm_server_command
from areal_fast.config import ConfigError, load_config

EXAMPLE = "examples/tiny_reverse.yaml"


@pytest.mark.parametrize("overrides", [
    ["rollout.backend=vllm", "weights.method=disk"],
    ["rollout.backend=vllm", "weights.method=disk", "rollout.vllm_version=0.27.0"],
    ["rollout.backend=vllm", "weights.method=disk", "rollout.pause_mode=abort"],
    ["rollout.backend=vllm"],  # weights.method distributed: vLLM's weight transfer (backends/vllm/transfer.py)
    ["rollout.backend=vllm", "rollout.vllm_version=0.27.0"],
])
def test_config_check_accepts_backend_vllm(overrides):
    cfg = load_config(EXAMPLE, overrides)
    assert cfg.rollout.backend == "vllm"


@pytest.mark.parametrize("overrides, needles", [
    (["rollout.backend=vllm", "rollout.vllm_version=0.11.0"], ["0.11.0", "/update_weight_version", "0.27.0"]),
    (["rollout.backend=vllm", "rollout.vllm_version=0.14.0", "rollout.pause_mode=abort"], ["0.14.0", "0.27.0"]),
    (["rollout.backend=vllm", "rollout.vllm_version=0.21.0", "rollout.pause_mode=abort"],
     ["0.21.0", "/update_weight_version", "0.27.0"]),
    (["rollout.backend=vllm", "weights.method=disk", "rollout.vllm_version=0.26.0"], ["0.26.0", "0.27.0"]),
    (["rollout.backend=vllm", "weights.method=disk", "rollout.client_processes=2", "rollout.n_servers=2"],
     ["client_processes"]),
    (["rollout.backend=vllm", "weights.method=disk", "rollout.vllm_version=0.20.0", "rollout.pause_mode=in_place",
      "rollout.servers=[http://127.0.0.1:8000]"], ["in_place", "0.33.0", "0.20.0"]),
    (["rollout.backend=vllm", "weights.method=disk", "rollout.pause_mode=retract"], ["retract", "SGLang"]),
    (["rollout.backend=vllm", "rollout.vllm_version=0.10.2"], ["0.10.2", "0.11.0 to 0.33.0"]),
    (["rollout.backend=vllm", "rollout.vllm_version=banana"], ["banana"]),
    (["rollout.backend=vllm", "rollout.engine=sglang"], ["engine", "sglang"]),
    (["rollout.backend=tgi"], ["backend", "tgi"]),
])
def test_config_refuses_what_vllm_cannot_serve_with_the_reason(overrides, needles):
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, overrides)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_pause_query_and_disk_update_follow_the_version():
    old, mid, new = (VLLMBehaviour.of(v) for v in ("0.11.0", "0.14.0", "0.33.0"))
    with pytest.raises(ValueError, match="no /pause"):
        vr.pause_query("abort", old)
    assert vr.pause_query("abort", mid) == {"wait_for_inflight_requests": "false"}
    with pytest.raises(ValueError, match="0.16.0"):
        vr.pause_query("in_place", mid)
    assert vr.pause_query("in_place", new) == {"mode": "keep"}
    assert [c["method"] for c in vr.disk_update_calls("/p", old)] == ["update_config", "reload_weights"]
    assert vr.disk_update_calls("/p", new) == [{"method": "reload_weights", "kwargs": {"weights_path": "/p"}}]
    assert "0.16.0" in vllm_refusal("0.14.0", pause_mode="abort", weights_method="distributed")
    assert "0.27.0" in vllm_refusal("0.21.0", pause_mode="abort", weights_method="distributed")
    assert vllm_refusal("0.27.0", pause_mode="abort", weights_method="distributed") is None
    assert vllm_refusal("0.33.0", pause_mode="in_place", weights_method="disk") is None
    assert auto_vllm_pause_mode("0.33.0") == "in_place" and auto_vllm_pause_mode("0.20.0") == "abort"


def test_completion_body_maps_keys_and_refuses_unknown_ones():
    b = VLLMBehaviour.of("0.33.0")
    body = vr.completion_body([1, 2], {"max_new_tokens": 5, "top_k": -1, "sampling_seed": 4}, "r|0|", b)
    assert body["max_tokens"] == 5 and "top_k" not in body and body["seed"] == 4
    assert body["return_weight_versions"] is True and body["logprobs"] == 0 and body["return_token_ids"] is True
    assert "return_weight_versions" not in vr.completion_body([1], {}, "r", VLLMBehaviour.of("0.32.0"))
    with pytest.raises(ValueError, match="sampling_params.json_schema"):
        vr.completion_body([1], {"json_schema": "{}"}, "r", b)


def test_server_command_keeps_the_key_off_the_line_and_gates_weight_transfer():
    cmd = vllm_server_command("/m", "h", 8000, version="0.33.0", api_key_file="/k.yaml", weight_transfer=True)
    assert cmd[cmd.index("--config") + 1] == "/k.yaml" and "--weight-transfer-config" in cmd
    with pytest.raises(ValueError, match="0.16.0"):
        vllm_server_command("/m", "h", 8000, version="0.14.0", weight_transfer=True)
    with pytest.raises(ValueError, match="--api-key"):
        vllm_server_command("/m", "h", 8000, version="0.33.0", extra_args=["--api-key", "x"])
