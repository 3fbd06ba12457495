"""The embedded engine over real HTTP on loopback (served from a thread of this process to save the
~10 s start-up of a subprocess; the subprocess entry point is exercised by tests/test_rollout_client.py)."""

import asyncio
import json
import random
import urllib.error
import urllib.request

import aiohttp
import pytest
import torch

from areal_fast.rollout.engine import start_engine_in_thread
from areal_fast.rollout.engine.sampling import SamplingParams, _filter_probs, sample_batch
from areal_fast.rollout.engine.weight_sync import TensorMeta, flattened_bucket_layout
from areal_fast.rollout.testing import (
    build_tiny_qwen2,
    hf_greedy,
    hf_logprobs,
    load_hf,
    perturbed_state_dict,
    save_state_dict,
)

LOGPROB_ATOL = 1e-4  # fp32 engine (KV cache, left padding, batch) vs one fresh fp32 forward: ~1e-5 seen
VOCAB = 256
FREQ_TOL = 0.012  # 40k draws: one standard error of a frequency is <= 0.0025, so ~5 sigma


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(model_dir):
    h = start_engine_in_thread(model_dir, seed=1234)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf(model_dir)


def _post(url: str, body, raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


def _get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            text, status = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    return status, json.loads(text) if text.startswith("{") else text


async def _gen_many(url: str, bodies: list[dict], stagger_s: float = 0.0) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        async def one(i, b):
            await asyncio.sleep(stagger_s * i)
            async with s.post(url + "/generate", json=b) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 24))] for _ in range(n)]


def test_greedy_equals_hf_generate_under_continuous_batching(engine, hf_model):
    prompts = _prompts(8, seed=0)
    prompts += [prompts[0]] * 3 + [[7] * len(prompts[1])]  # equal lengths share one prefill forward
    bodies = [{"input_ids": p, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 3 + 2 * i, "temperature": 0.0, "ignore_eos": True}}
              for i, p in enumerate(prompts)]
    # staggered arrivals: requests join and leave a running batch at different steps
    res = asyncio.run(_gen_many(engine.url, bodies, stagger_s=0.01))
    for p, b, r in zip(prompts, bodies, res):
        n = b["sampling_params"]["max_new_tokens"]
        assert r["output_ids"] == hf_greedy(hf_model, p, n)
        meta = r["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": n}
        assert meta["completion_tokens"] == n and meta["prompt_tokens"] == len(p)
        assert [x[1] for x in meta["output_token_logprobs"]] == r["output_ids"]
        ref = hf_logprobs(hf_model, p, r["output_ids"], 0.0)
        assert max(abs(a[0] - b_) for a, b_ in zip(meta["output_token_logprobs"], ref)) < LOGPROB_ATOL


def test_sampled_logprobs_equal_fresh_forward(engine, hf_model):
    prompts = _prompts(5, seed=1)
    settings = [{"temperature": 0.7}, {"temperature": 1.0, "top_p": 0.8}, {"temperature": 1.3, "top_k": 20},
                {"temperature": 0.9, "min_p": 0.05}, {"temperature": 0.5, "top_k": 5, "top_p": 0.9}]
    bodies = [{"input_ids": p, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **settings[i % len(settings)]}}
              for i, p in enumerate(prompts)]
    res = asyncio.run(_gen_many(engine.url, bodies, stagger_s=0.005))
    for p, b, r in zip(prompts, bodies, res):
        got = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf_model, p, r["output_ids"], b["sampling_params"]["temperature"])
        assert len(got) == 16
        assert max(abs(a - c) for a, c in zip(got, ref)) < LOGPROB_ATOL
        if b["sampling_params"].get("top_k") == 5:  # only the 5 most likely tokens may ever be drawn
            logits = hf_model(torch.tensor([p + r["output_ids"]])).logits[0, len(p) - 1:-1]
            top5 = logits.topk(5, dim=-1).indices.tolist()
            assert all(t in row for t, row in zip(r["output_ids"], top5))


def test_stop_token_ids_and_eos(engine, hf_model):
    p = _prompts(1, seed=2)[0]
    greedy = hf_greedy(hf_model, p, 8)
    stop = greedy[3]
    k = greedy.index(stop)
    s, r = _post(engine.url + "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [stop], "ignore_eos": True}})
    assert s == 200
    assert r["output_ids"] == greedy[:k + 1]  # the matched stop token is included
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # EOS (id 1 in this config) stops unless ignore_eos; force it via a prompt whose greedy hits EOS is
    # hard with random weights, so check that ignore_eos=False still runs to length when EOS is absent
    s, r = _post(engine.url + "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.0}})
    expect = greedy[:greedy.index(1) + 1] if 1 in greedy else greedy
    assert r["output_ids"] == expect


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": [1, VOCAB + 5]}, "vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10_000}}, "context length"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "n=1"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "hello"}, "input_ids"),
])
def test_bad_request_is_sglang_400(engine, body, needle):
    status, ans = _post(engine.url + "/generate", body)
    assert status == 400
    msg = ans["error"]["message"] if "error" in ans else ans["message"]
    assert needle in msg and "Traceback" not in msg


def test_bad_json_and_duplicate_rid(engine):
    status, ans = _post(engine.url + "/generate", None, raw=b"{not json")
    assert status == 400 and ans["object"] == "error" and ans["code"] == 400

    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [3, 4], "rid": "dup", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            first = asyncio.create_task(s.post(engine.url + "/generate", json=body))
            await asyncio.sleep(0.2)
            async with s.post(engine.url + "/generate", json=body) as r2:
                second = (r2.status, await r2.json())
            async with s.post(engine.url + "/abort_request", json={"rid": "dup"}) as ra:
                assert ra.status == 200
            r1 = await first
            return second, await r1.json()

    (st2, ans2), ans1 = asyncio.run(run())
    assert st2 == 400 and "dup" in ans2["error"]["message"]
    assert ans1["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(ans1["output_ids"]) < 400


def test_pause_aborts_running_and_holds_new_until_continue(engine):
    async def run():
        async with aiohttp.ClientSession() as s:
            async def gen(n, rid):
                async with s.post(engine.url + "/generate", json={
                        "input_ids": [5, 6, 7], "rid": rid, "return_logprob": True,
                        "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}) as r:
                    return await r.json()

            long = asyncio.create_task(gen(400, "long"))
            await asyncio.sleep(0.2)
            async with s.post(engine.url + "/flush_cache") as r:
                busy_flush = r.status
            async with s.post(engine.url + "/pause_generation", json={"mode": "abort"}) as r:
                assert (await r.json())["status"] == "ok"
            partial = await asyncio.wait_for(long, 5)  # pause returns only once nothing holds the model
            late = asyncio.create_task(gen(5, "late"))
            await asyncio.sleep(0.3)
            held = not late.done()
            async with s.post(engine.url + "/flush_cache") as r:
                idle_flush = r.status
            async with s.post(engine.url + "/continue_generation", json={}) as r:
                assert r.status == 200
            return partial, held, await asyncio.wait_for(late, 10), busy_flush, idle_flush

    partial, held, late, busy_flush, idle_flush = asyncio.run(run())
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(partial["output_ids"]) < 400
    assert len(partial["meta_info"]["output_token_logprobs"]) == len(partial["output_ids"])
    assert held, "a /generate sent while paused must wait for continue_generation"
    assert late["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    # flush succeeds only when nothing runs ("late", queued while paused, holds no cache)
    assert busy_flush == 400 and idle_flush == 200
    assert _post(engine.url + "/flush_cache", {})[0] == 200


def test_abort_all(engine):
    async def run():
        async with aiohttp.ClientSession() as s:
            async def gen(i):
                async with s.post(engine.url + "/generate", json={
                        "input_ids": [i + 2], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
                    return await r.json()

            tasks = [asyncio.create_task(gen(i)) for i in range(4)]
            await asyncio.sleep(0.3)
            async with s.post(engine.url + "/abort_request", json={"rid": "", "abort_all": True}) as r:
                assert r.status == 200
            return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    for r in asyncio.run(run()):
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(r["output_ids"]) < 400


def test_health_and_info(engine, model_dir):
    assert _get(engine.url + "/health")[0] == 200
    assert _get(engine.url + "/health_generate")[0] == 200
    status, info = _get(engine.url + "/get_model_info")
    assert status == 200 and info["is_generation"] is True and info["model_path"] == model_dir
    status, info = _get(engine.url + "/get_server_info")
    assert status == 200 and info["version"] == "0.5.23" and info["tp_size"] == 1
    assert "weight_version" in info and "max_total_num_tokens" in info


def test_update_weights_from_disk_changes_outputs_and_version(engine, model_dir, hf_model, tmp_path):
    p = _prompts(1, seed=3)[0]
    sd = perturbed_state_dict(model_dir, seed=7)
    new_dir = save_state_dict(sd, model_dir, str(tmp_path / "v1"))
    before = _post(engine.url + "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})[1]
    status, ans = _post(engine.url + "/update_weights_from_disk", {"model_path": new_dir, "weight_version": "1"})
    assert status == 200 and ans["success"] is True and "num_paused_requests" in ans
    after = _post(engine.url + "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})[1]
    assert after["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]
    assert after["output_ids"] == hf_greedy(load_hf(model_dir, sd), p, 12)
    assert after["output_ids"] != before["output_ids"]
    assert _get(engine.url + "/get_model_info")[1]["weight_version"] == "1"
    # a bad path is a 400 with success false, and the weights stay
    status, ans = _post(engine.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert status == 400 and ans["success"] is False
    # restore the original weights for any later test
    status, ans = _post(engine.url + "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "0"})
    assert ans["success"] is True
    again = _post(engine.url + "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})[1]
    assert again["output_ids"] == before["output_ids"]


# ---------------------------------------------------------------------------- pure units
def test_filter_probs_top_k_top_p_min_p():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.25)]
    out = _filter_probs(probs, params)
    assert (out[0] > 0).tolist() == [True, True, False, False, False]
    assert (out[1] > 0).tolist() == [True, True, False, False, False]  # mass before 3rd = 0.7, not < 0.7
    assert (out[2] > 0).tolist() == [True, True, True, False, False]  # >= 0.25 * 0.5


def test_sample_batch_greedy_rows_and_seeding():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)] * 2
    t1, lp1 = sample_batch(logits, params, torch.Generator().manual_seed(5))
    t2, lp2 = sample_batch(logits, params, torch.Generator().manual_seed(5))
    assert torch.equal(t1, t2) and torch.equal(lp1, lp2)
    assert t1[0] == logits[0].argmax() and t1[2] == logits[2].argmax()
    ref = torch.log_softmax(logits[1] / 0.8, -1)[t1[1]]
    assert abs(float(lp1[1]) - float(ref)) < 1e-6


def test_sampled_frequencies_follow_filtered_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    n = 40_000
    logits = probs.log().expand(n, -1).contiguous()
    toks, lps = sample_batch(logits, [SamplingParams(temperature=1.0, top_k=3)] * n,
                             torch.Generator().manual_seed(0))
    freq = torch.bincount(toks, minlength=5).double() / n
    want = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64) / 0.9
    assert (freq - want).abs().max() < FREQ_TOL
    # the logprob is NOT renormalised by top-k (SGLang semantics)
    assert torch.allclose(lps, probs.log()[toks], atol=1e-6)


def test_flattened_bucket_offsets_are_dtype_aligned():
    metas = [TensorMeta("a", torch.bfloat16, (3,)), TensorMeta("b", torch.float32, (2, 1)),
             TensorMeta("c", torch.uint8, (1,)), TensorMeta("d", torch.float64, (1,))]
    offsets, total = flattened_bucket_layout(metas)
    assert offsets == [0, 8, 16, 24] and total == 32


def test_model_failure_is_a_500_and_the_engine_keeps_serving(engine):
    sched = engine.server.scheduler
    real = sched.model

    class Broken:
        config = real.config

        def __call__(self, **kw):
            raise RuntimeError("simulated device failure")

    sched.model = Broken()
    try:
        status, ans = _post(engine.url + "/generate", {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 3}})
    finally:
        sched.model = real
    assert status == 500 and "simulated device failure" in ans["error"]["message"]
    status, ans = _post(engine.url + "/generate", {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(ans["output_ids"]) <= 3
