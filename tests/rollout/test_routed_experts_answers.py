"""Routing in the servers' answers is held to the model: an expert id outside ``[0, num_experts)``
(the model's count, from its config) is a malformed answer on both answer paths (SGLang's
``meta_info["routed_experts"]``, vLLM's choice field), and so is a vLLM field of any other shape or
type (a number, a list, an ``.npz``, a header the bytes do not fill): ``MalformedAnswer`` naming the
server and the request, never a TypeError or AttributeError out of the decoder. Stand-in servers
(aiohttp, in process) answer each case."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest

LAYERS, TOP_K, NUM_EXPERTS = 2, 2, 4
WIDTH = LAYERS * TOP_K
PROMPT, NEW = [1, 2], 2
POSITIONS = len(PROMPT) + NEW - 1  # forwarded positions an answer records: prompt + output - the last
ROWS = np.arange(POSITIONS * WIDTH).reshape(POSITIONS, LAYERS, TOP_K) % NUM_EXPERTS


def _out_of_range() -> np.ndarray:
    rows = ROWS.copy()
    rows[1, 0, 1] = 3000  # expert 3000 of a 4-expert model
    return rows


def _npy(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _npz() -> str:
    buf = io.BytesIO()
    np.savez(buf, routed=ROWS.astype(np.uint8))
    return base64.b64encode(buf.getvalue()).decode()


def _header_says(shape: tuple) -> str:
    """A .npy header naming ``shape`` over the bytes of ROWS (np.load would allocate the shape first)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": shape})
    return base64.b64encode(buf.getvalue() + ROWS.astype(np.uint8).tobytes()).decode()


async def _generate(api: str, field, **client):
    """One generate call against a stand-in server of ``api`` whose answer carries ``field`` as its
    routing; returns the sample, or raises what the client raised."""
    from _shared import serve_app
    from aiohttp import web

    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.backends.vllm.client import VLLMRolloutClient

    async def sglang_generate(request):
        req = await request.json()
        ids = [7 + i for i in range(req["sampling_params"]["max_new_tokens"])]
        return web.json_response({"output_ids": ids, "meta_info": {
            "id": req["rid"], "finish_reason": {"type": "length"}, "weight_version": "3", "routed_experts": field,
            "output_token_logprobs": [[-0.25, t, None] for t in ids]}})

    async def completions(request):
        req = await request.json()
        ids = [7 + i for i in range(req["max_tokens"])]
        return web.json_response({"id": f"cmpl-{req['request_id']}", "choices": [{
            "index": 0, "token_ids": ids, "logprobs": {"token_logprobs": [-0.25] * len(ids)},
            "finish_reason": "length", "stop_reason": None, "routed_experts": field,
            "weight_versions": [{"version": "3", "start": 0, "end": len(ids)}]}]})

    async def info(request):
        return web.json_response({"version": "0.5.23", "tp_size": 1, "weight_version": "3"})

    async def version(request):
        return web.json_response({"version": "0.33.0"})

    app = web.Application()
    if api == "sglang":
        app.router.add_post("/generate", sglang_generate)
        for path in ("/server_info", "/get_server_info", "/model_info"):
            app.router.add_get(path, info)
        make = SGLangRolloutClient
    else:
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/version", version)
        make = lambda urls, **kw: VLLMRolloutClient(urls, vllm_version="0.33.0", **kw)  # noqa: E731
    client = {"routed_experts_width": WIDTH, "num_experts": NUM_EXPERTS, **client}
    async with serve_app(app) as url:
        async with make([url], gc_tuning=False, **client) as c:
            return await c.generate(PROMPT, {"max_new_tokens": NEW}, rid="q")


def _field(api: str, rows: np.ndarray) -> str:
    from areal_fast.rollout.routed_experts import to_sglang, to_vllm

    return to_sglang(rows) if api == "sglang" else to_vllm(rows, num_experts=int(rows.max()) + 1)


def _run(api: str, field, **client):
    return asyncio.run(asyncio.wait_for(_generate(api, field, **client), 60))


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_an_expert_the_model_does_not_have_is_a_malformed_answer(api):
    from areal_fast.rollout.client import MalformedAnswer

    ok = _run(api, _field(api, ROWS))  # the same answer within the model's experts is taken
    assert list(ok.routed_experts) == ROWS.reshape(-1).tolist()
    with pytest.raises(MalformedAnswer, match=r"routed_experts: expert ids outside \[0, 4\) of the model's 4 "
                                              r"experts \(min 0, max 3000") as e:
        _run(api, _field(api, _out_of_range()))
    assert "q|0|" in str(e.value) and e.value.rid == "q|0|" and e.value.url.startswith("http://127.0.0.1:")


VLLM_FIELDS = {
    "a number": (7, "got a int"),
    "a list": (ROWS.tolist(), "got a list"),
    "an object": ({"routed": "AAAA"}, "got a dict"),
    "an npz": (_npz(), "not .npy bytes"),
    "the empty string": ("", "not .npy bytes"),
    "not base64": ("!!not base64!!", "not base64"),
    "a two-dimensional array": (_npy(ROWS.reshape(POSITIONS, WIDTH).astype(np.uint8)), "expected an integer array"),
    "a float array": (_npy(ROWS.astype(np.float32)), "dtype float32"),
    "a header naming more than the bytes": (_header_says((1 << 40, LAYERS, TOP_K)), "the field holds"),
    "a truncated header": (_npy(ROWS.astype(np.uint8))[:12], "not .npy bytes"),
}


@pytest.mark.parametrize("case", list(VLLM_FIELDS))
def test_a_malformed_vllm_routing_field_is_a_malformed_answer(case):
    from areal_fast.rollout.client import MalformedAnswer
    from areal_fast.rollout.routed_experts import from_vllm

    field, match = VLLM_FIELDS[case]
    with pytest.raises(ValueError, match=match):
        from_vllm(field)
    with pytest.raises(MalformedAnswer, match=f"routed_experts: .*{match}") as e:
        _run("vllm", field)
    assert "q|0|" in str(e.value)


def test_the_decoders_keep_any_int16_id_and_the_check_holds_them_to_the_models_experts():
    from areal_fast.rollout.routed_experts import check_expert_ids, from_sglang, from_vllm, to_sglang

    rows = _out_of_range()
    for decoded in (from_vllm(_npy(rows.astype(np.uint16))), from_sglang(to_sglang(rows), LAYERS, TOP_K)):
        assert np.array_equal(decoded, rows) and decoded.max() == 3000  # int16 holds it
        with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
            check_expert_ids(decoded, NUM_EXPERTS)
        check_expert_ids(decoded, 3001)
    with pytest.raises(ValueError, match=r"outside \[-1, 32767\]"):  # below -1: not even an id
        from_sglang(to_sglang(np.full((1, LAYERS, TOP_K), -2)), LAYERS, TOP_K)
    check_expert_ids(from_sglang(to_sglang(np.full((1, LAYERS, TOP_K), -1)), LAYERS, TOP_K), NUM_EXPERTS)


@pytest.mark.parametrize("experts", [None, 0, 40000, 4.0])
def test_asking_for_routing_needs_the_models_expert_count(experts):
    from areal_fast.backends.sglang.client import SGLangRolloutClient

    with pytest.raises(ValueError, match="num_experts"):
        SGLangRolloutClient(["http://127.0.0.1:9"], routed_experts_width=WIDTH, num_experts=experts)
    assert SGLangRolloutClient(["http://127.0.0.1:9"], num_experts=experts).num_experts is None  # no routing asked


def test_the_expert_count_is_read_from_the_models_config(tmp_path):
    from areal_fast.moe_routing import routing_shape

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 3,
                                                      "num_experts_per_tok": 2, "num_local_experts": 8}))
    assert routing_shape(tmp_path) == (6, 8)
