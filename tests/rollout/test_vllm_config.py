"""rollout.api 'vllm' at config load: accepted where vLLM serves it, refused with the reason where
not (the version, pause mode, weights method and engine rules of ``backends/vllm/compat.py``); and the
request builders' own refusals. Torch-free, fast."""

from __future__ import annotations

import pytest

from areal_fast.backends.vllm import requests as vr
from areal_fast.backends.vllm.compat import (
    VLLMBehaviour,
    auto_vllm_pause_mode,
    served_release,  # noqa: I001
    vllm_refusal,
)
from areal_fast.backends.vllm.server_command import vllm_server_command
from areal_fast.config import ConfigError, load_config

EXAMPLE = "examples/tiny_reverse.yaml"


@pytest.mark.parametrize("overrides", [
    ["rollout.api=vllm", "weights.method=disk"],
    ["rollout.api=vllm", "weights.method=disk", "rollout.vllm_version=0.27.0"],
    ["rollout.api=vllm", "weights.method=disk", "rollout.pause_mode=abort"],
    ["rollout.api=vllm"],  # weights.method distributed: vLLM's weight transfer (backends/vllm/transfer.py)
    ["rollout.api=vllm", "rollout.vllm_version=0.27.0"],
])
def test_config_check_accepts_backend_vllm(overrides):
    cfg = load_config(EXAMPLE, overrides)
    assert cfg.rollout.api == "vllm"


@pytest.mark.parametrize("overrides, needles", [
    (["rollout.api=vllm", "rollout.vllm_version=0.11.0"], ["0.11.0", "/update_weight_version", "0.27.0"]),
    (["rollout.api=vllm", "rollout.vllm_version=0.14.0", "rollout.pause_mode=abort"], ["0.14.0", "0.27.0"]),
    (["rollout.api=vllm", "rollout.vllm_version=0.21.0", "rollout.pause_mode=abort"],
     ["0.21.0", "/update_weight_version", "0.27.0"]),
    (["rollout.api=vllm", "weights.method=disk", "rollout.vllm_version=0.26.0"], ["0.26.0", "0.27.0"]),
    (["rollout.api=vllm", "weights.method=disk", "rollout.client_processes=2", "rollout.n_servers=2"],
     ["client_processes"]),
    (["rollout.api=vllm", "weights.method=disk", "rollout.vllm_version=0.20.0", "rollout.pause_mode=in_place",
      "rollout.servers=[http://127.0.0.1:8000]"], ["in_place", "0.33.0", "0.20.0"]),
    (["rollout.api=vllm", "weights.method=disk", "rollout.pause_mode=retract"], ["retract", "SGLang"]),
    (["rollout.api=vllm", "rollout.vllm_version=0.10.2"], ["0.10.2", "0.11.0 to 0.33.0"]),
    (["rollout.api=vllm", "rollout.vllm_version=banana"], ["banana"]),
    (["rollout.api=vllm", "rollout.server=sglang"], ["server", "sglang"]),
    (["rollout.api=tgi"], ["rollout.api", "tgi"]),
    (["rollout.api=vllm", "rollout.server=vllm", "weights.method=disk",
      "rollout.server_args=[--load-format,dummy]"], ["--load-format dummy", "disk"]),
    (["rollout.api=vllm", "rollout.server=vllm", "rollout.server_python=/nonexistent/python"],
     ["server_python", "/nonexistent/python"]),
    (["rollout.server_env={OMP_NUM_THREADS: '4'}"], ["server_env", "OMP_NUM_THREADS"]),
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
    # keep in place: from 0.20.0 keep's default clear_cache=true would drop the kept requests' KV
    assert vr.pause_query("in_place", new) == {"mode": "keep", "clear_cache": "false"}
    assert vr.pause_query("in_place", VLLMBehaviour.of("0.19.0")) == {"mode": "keep"}
    assert vr.pause_query("abort", new) == {"mode": "abort"}
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
    assert body["max_tokens"] == 5 and body["top_k"] == 0 and body["seed"] == 4
    # every sampling key is sent (the caller's or neutral): nothing is left to the checkpoint's
    # generation_config.json, which vLLM would fill in (top_k 20 and a repetition penalty for Qwen2.5)
    assert {k: body[k] for k in vr.NEUTRAL_SAMPLING} == vr.NEUTRAL_SAMPLING | {"top_k": 0}
    assert vr.completion_body([1], {"temperature": 0.7, "top_k": 5}, "r", b)["temperature"] == 0.7
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


def test_abort_names_the_engine_id_of_the_request():
    """vLLM registers a completion with request_id R as cmpl-R-0 and /abort_requests matches that id
    only: an abort by R matches nothing, yet is answered {"aborted": 1}."""
    assert vr.abort_body(["q|0|", "q|1.2|"]) == {"request_ids": ["cmpl-q|0|-0", "cmpl-q|1.2|-0"]}
    assert vr.abort_body(None) == {"request_ids": []}


def test_abort_requests_is_used_only_where_it_is_mounted_by_default():
    assert not VLLMBehaviour.of("0.25.0").has_abort_requests and VLLMBehaviour.of("0.26.0").has_abort_requests


@pytest.mark.parametrize("reported, release, warns", [
    ("0.32.0", "0.32.0", False), ("0.33.0+cu126", "0.33.0", False), ("0.33.0rc1", "0.33.0", False),
    ("0.32.1.dev17+g0123abc", "0.32.1", False), ("0.34.0", "0.33.0", True), ("1.0.0.dev3", "0.33.0", True),
])
def test_a_server_version_is_read_leniently(reported, release, warns):
    got, warning = served_release(reported)
    assert str(got) == release and bool(warning) == warns
    if warns:
        assert reported in warning and "0.33.0" in warning


@pytest.mark.parametrize("reported", ["0.10.2", "banana", ""])
def test_a_server_version_outside_the_range_is_refused_naming_it(reported):
    with pytest.raises(ValueError, match="version"):
        served_release(reported)


def test_launched_servers_sample_and_score_as_the_trainer_assumes():
    cmd = vllm_server_command("/m", "h", 8000, version="0.32.0")
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"
    with pytest.raises(ValueError, match="--logprobs-mode"):
        vllm_server_command("/m", "h", 8000, version="0.32.0", extra_args=["--logprobs-mode=raw_logprobs"])


@pytest.mark.parametrize("args, gpus", [([], 2), (["-pp", "2"], 4), (["--pipeline-parallel-size=3", "-dp", "2"], 12),
                                        (["--data-parallel-size", "4"], 8)])
def test_a_vllm_server_takes_tensor_x_pipeline_x_data_parallel_gpus(args, gpus):
    from areal_fast.backends.vllm.server_command import gpus_of

    assert gpus_of(2, args) == gpus


# ---------------------------------------------------------------------------- hostile /v1/completions answers
def _answer(ids=(5, 6), lps=(-0.5, -0.25), spans=None, rid="q|0|", finish="length", **choice):
    c = {"index": 0, "token_ids": list(ids), "logprobs": {"token_logprobs": list(lps)}, "finish_reason": finish,
         "stop_reason": None, **choice}
    if spans is not None:
        c["weight_versions"] = spans
    return {"id": f"cmpl-{rid}", "choices": [c]}


@pytest.mark.parametrize("answer, match", [
    (_answer(lps=(True, -0.1)), "not a number"),
    (_answer(lps=(float("-inf"), -0.1)), "JSON object"),  # -Infinity is not JSON: the decoder refuses it
    (_answer(lps=(float("nan"), -0.1)), "JSON object"),
    (_answer(lps=(-0.1, 0.5)), "finite log-prob <= 0"),
    (_answer(ids=(5, True)), "token ids"),
    (_answer(spans=[{"version": "-3", "start": 0, "end": 2}]), "version"),
    (_answer(spans=[{"version": str(2**40), "start": 0, "end": 2}]), "outside"),
    (_answer(spans=[{"version": "1", "start": "0", "end": 2}]), "tile"),
    (_answer(spans=[{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 0, "end": 2}]), "tile"),
    (_answer(spans=[{"version": "1", "start": 0, "end": 1}]), "cover 1 of the 2"),
    (_answer(spans={"version": "1"}), "not a list"),
    (_answer(rid="another|0|"), "another|0|"),
    (_answer(stop_reason=[1]), "stop_reason"),
    ([1, 2], "JSON object"),
])
def test_a_malformed_completion_is_one_error_naming_server_and_request(answer, match):
    """The vLLM adapter holds answers to the SGLang path's rules: each breach is a MalformedAnswer
    naming the server and the request id, never a raw exception or a silently taken value."""
    import asyncio

    from _shared import serve_app
    from aiohttp import web

    from areal_fast.backends.vllm.client import VLLMRolloutClient
    from areal_fast.rollout.client import MalformedAnswer

    async def completions(request):
        return web.json_response(answer)

    async def version(request):
        return web.json_response({"version": "0.33.0"})

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/version", version)
        async with serve_app(app) as url:
            async with VLLMRolloutClient([url], vllm_version="0.33.0") as c:
                with pytest.raises(MalformedAnswer) as e:
                    await c.generate([1, 2], {"max_new_tokens": 2}, rid="q")
                assert url in str(e.value) and "q|0|" in str(e.value) and e.value.rid == "q|0|"
                return str(e.value)

    assert match in asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("x", [float("-inf"), float("nan"), float("inf"), 1e-30 + 1.0])
def test_a_decoded_log_prob_that_is_not_finite_and_at_most_zero_is_refused(x):
    with pytest.raises(vr.CompletionAnswerError, match="log-prob"):
        vr.parse_completion(_answer(lps=(x, -0.1)))


def test_a_well_formed_completion_with_spans_is_taken():
    ok = vr.parse_completion(_answer(spans=[{"version": "1", "start": 0, "end": 1},
                                            {"version": "default", "start": 1, "end": 2}]), request_id="q|0|")
    assert ok["ids"] == [5, 6] and ok["logprobs"] == [-0.5, -0.25]


def test_the_rollout_sections_default_release_is_the_newest_read():
    """The section names no backend, so its default is written there; it must be the version table's."""
    from areal_fast.backends.vllm.compat import DEFAULT_VLLM_VERSION
    from areal_fast.rollout.config import RolloutConfig

    assert RolloutConfig().vllm_version == DEFAULT_VLLM_VERSION
