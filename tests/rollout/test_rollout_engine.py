"""The embedded engine over real HTTP on loopback (served from a thread of this process to save the
~10 s start-up of a subprocess; the subprocess entry point is exercised by tests/rollout/test_rollout_client.py)."""

import asyncio
import json
import random
import socket
import urllib.error
import urllib.request

import aiohttp
import pytest
import torch
from _shared import engine_twins, perturbed_checkpoint, poll_until, tiny_model, until_running, wait_until
from tolerances import ENGINE_LOGPROB_ATOL, FP32_FEW_OPS_ATOL, SAMPLED_FREQ_40K_ATOL

from areal_fast.data.tiny_models import hf_greedy, hf_logprobs, load_hf
from areal_fast.embedded import start_engine_in_thread
from areal_fast.embedded.sampling import SamplingParams, _filter_probs, sample_batch
from areal_fast.embedded.weight_sync import TensorMeta, flattened_bucket_layout, unaligned_tensor

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny_qwen2", vocab_size=VOCAB)


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
        assert max(abs(a[0] - b_) for a, b_ in zip(meta["output_token_logprobs"], ref)) < ENGINE_LOGPROB_ATOL


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
        assert max(abs(a - c) for a, c in zip(got, ref)) < ENGINE_LOGPROB_ATOL
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
    ({"input_ids": [1, VOCAB + 5]}, "vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10_000}}, "context length"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": float("nan")}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "regex"),
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
            await until_running(engine, 1, task=first)  # "dup" runs: the second one is a duplicate
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
            await until_running(engine, 1, task=long)
            async with s.post(engine.url + "/flush_cache") as r:
                busy_flush = r.status
            async with s.post(engine.url + "/pause_generation", json={"mode": "abort"}) as r:
                assert (await r.json())["status"] == "ok"
            partial = await asyncio.wait_for(long, 5)  # pause returns only once nothing holds the model
            late = asyncio.create_task(gen(5, "late"))
            sched = engine.server.scheduler
            await wait_until(lambda: any(r.rid == "late" for r in list(sched._waiting)), "'late' queued while paused")
            # a full turn of the scheduler's loop with "late" queued: a paused one does not admit it
            for _ in range(2):
                await asyncio.wrap_future(sched.call(lambda: None))
            held = (not late.done() and any(r.rid == "late" for r in list(sched._waiting))
                    and not any(r.rid == "late" for r in list(sched._rows)))
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
            await until_running(engine, 1, count=4)
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
    assert _get(engine.url + "/server_info")[1]["version"] == "0.5.23"
    assert _get(engine.url + "/model_info")[1]["model_path"] == model_dir


def test_update_weights_from_disk_changes_outputs_and_version(engine, model_dir, hf_model, tmp_path):
    p = _prompts(1, seed=3)[0]
    new_dir, sd = perturbed_checkpoint(model_dir, 7, tmp_path / "v1")
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
    assert abs(float(lp1[1]) - float(ref)) < FP32_FEW_OPS_ATOL


def test_sampled_frequencies_follow_filtered_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    n = 40_000
    logits = probs.log().expand(n, -1).contiguous()
    toks, lps = sample_batch(logits, [SamplingParams(temperature=1.0, top_k=3)] * n,
                             torch.Generator().manual_seed(0))
    freq = torch.bincount(toks, minlength=5).double() / n
    want = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64) / 0.9
    assert (freq - want).abs().max() < SAMPLED_FREQ_40K_ATOL
    # the logprob is NOT renormalised by top-k (SGLang semantics)
    assert torch.allclose(lps, probs.log()[toks], atol=FP32_FEW_OPS_ATOL)


def test_flattened_bucket_is_packed_back_to_back():
    metas = [TensorMeta("a", torch.bfloat16, (3,)), TensorMeta("b", torch.float32, (2, 1)),
             TensorMeta("c", torch.uint8, (1,)), TensorMeta("d", torch.float64, (1,))]
    offsets, total = flattened_bucket_layout(metas)
    assert offsets == [0, 6, 14, 15] and total == 23  # no padding, as SGLang's FlattenedTensorBucket
    assert unaligned_tensor(metas) == "Unaligned received tensor b: byte offset 6, dtype torch.float32"
    assert unaligned_tensor(metas[1:3]) is None


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


# ---------------------------------------------------------------------------- the strict SGLang twin
# One engine per SGLang version mode, shared by the tests below (a tiny model starts in ~1 s).
@pytest.fixture(scope="module")
def twins(model_dir):
    yield from engine_twins(model_dir)


async def _post_async(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    async with s.post(url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def test_n_greater_than_one_answers_a_list_with_suffixed_rids(twins, hf_model):
    h = twins("0.5.23")
    prompt = [5, 9, 2]
    status, ans = _post(h.url + "/generate", {"input_ids": prompt, "rid": "grp", "return_logprob": True,
                                              "sampling_params": {"n": 3, "max_new_tokens": 4,
                                                                  "temperature": 0.0, "ignore_eos": True}})
    assert status == 200 and isinstance(ans, list) and len(ans) == 3
    assert [a["meta_info"]["id"] for a in ans] == ["grp_0", "grp_1", "grp_2"]
    want = hf_greedy(hf_model, prompt, 4)
    assert all(a["output_ids"] == want for a in ans)


@pytest.mark.parametrize("version,status", [("0.5.6", 500), ("0.5.21", 500), ("0.5.22", 400), ("0.5.23", 400)])
def test_unknown_sampling_key_status_per_version(twins, version, status):
    h = twins(version)
    got, ans = _post(h.url + "/generate", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}})
    assert got == status
    if status == 400:  # the schema check's body names the key: {"error": "unknown field `bogus` ..."}
        assert isinstance(ans["error"], str) and "bogus" in ans["error"]
    else:  # SamplingParams(**params) raised a TypeError nobody catches: Starlette's bare 500
        assert ans == "Internal Server Error"


def test_abort_request_aborts_every_rid_with_that_prefix(twins):
    h = twins("0.5.23")

    async def run():
        async with aiohttp.ClientSession() as s:
            def gen(rid):
                return asyncio.create_task(_post_async(s, h.url + "/generate", {
                    "input_ids": [3, 4], "rid": rid, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))

            tasks = {rid: gen(rid) for rid in ("q1-s1", "q1-s10", "q2-s1")}
            await until_running(h, 1, count=3)
            assert (await _post_async(s, h.url + "/abort_request", {"rid": "q1-s1"}))[0] == 200
            done = {rid: (await asyncio.wait_for(t, 10))[1] for rid, t in tasks.items() if rid != "q2-s1"}
            still = not tasks["q2-s1"].done()
            await _post_async(s, h.url + "/abort_request", {"rid": "q2-s1"})
            await tasks["q2-s1"]
            return done, still

    done, still = asyncio.run(run())
    assert all(d["meta_info"]["finish_reason"]["type"] == "abort" for d in done.values())  # q1-s10 too
    assert still  # q2-s1 does not start with q1-s1


def test_retract_pause_recomputes_with_new_weights_and_in_place_keeps_running(twins, model_dir, tmp_path):
    h = twins("0.5.23")
    new_dir, sd = perturbed_checkpoint(model_dir, 11, tmp_path / "v1")
    prompt, n = [7, 3, 9], 60

    async def cycle(mode: str):
        async with aiohttp.ClientSession() as s:
            _post(h.url + "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "0"})
            task = asyncio.create_task(_post_async(s, h.url + "/generate", {
                "input_ids": prompt, "rid": f"r-{mode}", "return_logprob": True,
                "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}))
            await until_running(h, 5)
            await _post_async(s, h.url + "/pause_generation", {"mode": mode})
            running = h.server.scheduler.has_running()
            flush = await _post_async(s, h.url + "/update_weights_from_disk", {
                "model_path": new_dir, "weight_version": "1", "flush_cache": mode == "retract"})
            await _post_async(s, h.url + "/continue_generation", {})
            ans = (await asyncio.wait_for(task, 30))[1]
            _post(h.url + "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "0"})
            return running, flush, ans

    running, flush, ans = asyncio.run(cycle("retract"))
    assert not running and flush[0] == 200  # retract empties the batch, so the flush is allowed
    meta = ans["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["total_retractions"] == 1
    spans = meta["weight_versions"]
    assert [sp["version"] for sp in spans] == ["0", "1"] and spans[1]["end"] == n
    k = spans[0]["end"]
    out = ans["output_ids"]
    assert out[:k] == hf_greedy(load_hf(model_dir), prompt, k)
    # the retracted request was prefilled again by the new weights: exactly a fresh continuation
    assert out[k:] == hf_greedy(load_hf(model_dir, sd), prompt + out[:k], n - k)

    running, flush, ans = asyncio.run(cycle("in_place"))
    assert running and flush[0] == 200  # flush_cache false: allowed with requests kept in place
    assert ans["meta_info"]["total_retractions"] == 0
    assert [sp["version"] for sp in ans["meta_info"]["weight_versions"]] == ["0", "1"]


def test_in_place_pause_then_flushing_update_refused_from_0_5_22_and_crashes_before(twins, model_dir):
    async def run(h):
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(_post_async(s, h.url + "/generate", {
                "input_ids": [4, 4], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
            await until_running(h, 2)
            await _post_async(s, h.url + "/pause_generation", {"mode": "in_place"})
            upd = await _post_async(s, h.url + "/update_weights_from_disk",
                                    {"model_path": model_dir, "weight_version": "5", "flush_cache": True})
            async with s.get(h.url + "/health") as r:
                health = r.status
            await _post_async(s, h.url + "/continue_generation", {})
            gen = await asyncio.wait_for(task, 30)
            return upd, health, gen

    upd, health, gen = asyncio.run(run(twins("0.5.22")))
    assert upd[0] == 400 and upd[1]["success"] is False and "not flushed" in upd[1]["message"]
    assert gen[0] == 200 and gen[1]["meta_info"]["weight_version"] == "5"  # the weights did load
    # before 0.5.22 the scheduler dies on the failed flush: everything after is a 5xx
    upd, health, gen = asyncio.run(run(twins("0.5.21", max_running_requests=8)))  # its own: it dies
    assert upd[0] >= 500 and "flush" in json.dumps(upd[1])
    assert health == 503 and gen[0] >= 500


def test_abort_in_waiting_has_no_weight_version_on_0_5_6(twins):
    async def run(h):
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(_post_async(s, h.url + "/generate", {
                "input_ids": [6, 2], "rid": "w", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
            await until_running(h, 3)
            await _post_async(s, h.url + "/pause_generation", {"mode": "retract"})  # back to the waiting queue
            await _post_async(s, h.url + "/abort_request", {"rid": "w"})
            await _post_async(s, h.url + "/continue_generation", {})
            return (await asyncio.wait_for(task, 10))[1]["meta_info"]

    old, new = asyncio.run(run(twins("0.5.6"))), asyncio.run(run(twins("0.5.23")))
    assert old["finish_reason"]["type"] == "abort" and "weight_version" not in old
    assert "weight_versions" not in old  # spans exist from 0.5.19
    assert new["weight_version"] == new["weight_versions"][0]["version"]


def test_health_is_503_while_paused_longer_than_the_probe_timeout(twins):
    h = twins("0.5.23")

    async def run():
        async with aiohttp.ClientSession() as s:
            await _post_async(s, h.url + "/pause_generation", {"mode": "abort"})
            try:
                statuses = []
                for path in ("/health", "/health_generate"):
                    async with s.get(h.url + path) as r:
                        statuses.append(r.status)
                    # A timed-out probe is aborted, and that abort is itself scheduler output (as in
                    # SGLang), which would let the next probe answer 200: wait until it is gone.
                    for _ in range(500):
                        async with s.get(h.url + "/server_info") as r:
                            if (await r.json())["num_running_requests"] == 0:
                                break
                        await asyncio.sleep(0.01)
                    else:
                        raise AssertionError("the timed-out health probe was never aborted")
                async with s.get(h.url + "/model_info") as r:  # answers without the scheduler
                    info = r.status
            finally:
                await _post_async(s, h.url + "/continue_generation", {})
            async with s.get(h.url + "/health") as r:
                after = r.status
            return statuses, info, after

    statuses, info, after = asyncio.run(run())
    assert statuses == [503, 503] and info == 200 and after == 200


def test_server_info_weight_version_is_the_launch_value_from_0_5_19(twins, model_dir):
    for version, want in (("0.5.6", "3"), ("0.5.19", "default")):
        h = twins(version)
        assert _post(h.url + "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "3"})[0] == 200
        assert _get(h.url + "/server_info")[1]["weight_version"] == want
        assert _get(h.url + "/model_info")[1]["weight_version"] == "3"  # the current one, every version
        _post(h.url + "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "default"})


def test_weight_update_sessions_from_0_5_21(twins):
    h = twins("0.5.21")
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
              "group_name": "g", "load_format": None, "flush_cache": True}
    st, ans = _post(h.url + "/update_weights_from_distributed", update)
    assert st == 400 and "between begin_weight_update() and end_weight_update()" in ans["message"]
    st, ans = _post(h.url + "/end_weight_update", {})
    assert st == 400 and "no weight-update session is open" in ans["message"]
    assert _post(h.url + "/begin_weight_update", {})[0] == 200
    st, ans = _post(h.url + "/begin_weight_update", {})
    assert st == 400 and "already open" in ans["message"]
    assert _post(h.url + "/end_weight_update", {})[0] == 200
    old = twins("0.5.6")
    assert _post(old.url + "/begin_weight_update", {})[0] == 404  # no sessions before 0.5.21


def test_unaligned_flattened_bucket_refused_before_receiving_on_0_5_23(twins):
    h = twins("0.5.23")
    assert _post(h.url + "/begin_weight_update", {})[0] == 200
    try:
        st, ans = _post(h.url + "/update_weights_from_distributed", {
            "names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [2]],
            "group_name": "none", "load_format": "flattened_bucket"})
    finally:
        _post(h.url + "/end_weight_update", {})
    assert st == 400 and "Unaligned received tensor b: byte offset 6" in ans["message"]


def test_disk_update_uses_the_launch_load_format_and_dummy_cannot_load(twins, model_dir, hf_model):
    h = twins("0.5.23", load_format="dummy")
    st, ans = _post(h.url + "/update_weights_from_disk", {"model_path": model_dir, "load_format": None})
    assert st == 400 and "dummy" in ans["message"]
    st, ans = _post(h.url + "/update_weights_from_disk", {"model_path": model_dir, "load_format": "safetensors",
                                                          "weight_version": "1"})
    assert st == 200 and ans["success"] is True
    out = _post(h.url + "/generate", {"input_ids": [2, 5], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}})[1]["output_ids"]
    assert out == hf_greedy(hf_model, [2, 5], 6)  # the real weights replaced the dummy ones


def test_api_key_required_except_health(twins):
    h = twins("0.5.23", api_key="s3cret")
    assert _get(h.url + "/health")[0] == 200
    st, ans = _get(h.url + "/server_info")
    assert st == 401 and ans == {"error": "Unauthorized"}
    assert _post(h.url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})[0] == 401
    req = urllib.request.Request(h.url + "/server_info", headers={"Authorization": "Bearer s3cret"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def test_engine_api_key_from_config_file_command_line_or_environment(tmp_path, monkeypatch):
    """Where ``python -m areal_fast.embedded`` finds its key: --api-key over --config FILE over
    $AREAL_FAST_API_KEY (the launcher uses the file: a command line is readable by every local user)."""
    from areal_fast.embedded.__main__ import parse_args

    f = tmp_path / "key.yaml"
    f.write_text("api-key: from-file\n")
    base = ["--model-path", "/m"]
    monkeypatch.delenv("AREAL_FAST_API_KEY", raising=False)
    assert parse_args(base).api_key is None
    monkeypatch.setenv("AREAL_FAST_API_KEY", "from-env")
    assert parse_args(base).api_key == "from-env"
    assert parse_args(base + ["--config", str(f)]).api_key == "from-file"
    assert parse_args([f"--config={f}", *base, "--api-key", "from-argv"]).api_key == "from-argv"
    monkeypatch.setenv("AREAL_FAST_API_KEY", "")
    assert parse_args(base).api_key is None  # an empty variable is no key


@pytest.mark.parametrize("text,suffix,argv_extra,culprit", [
    ("api_key: k\n", ".yaml", [], "unknown option 'api_key' (options are spelled with dashes: 'api-key')"),
    ("bogus: 1\n", ".yaml", [], "unknown option 'bogus'"),
    ("config: other.yaml\n", ".yml", [], "unknown option 'config'"),
    ("- api-key\n", ".yaml", [], "mapping of option names"),
    ("port: [1, 2]\n", ".yaml", [], "'port' needs one value"),
    ("port:\n", ".yaml", [], "'port' needs one value"),
    ("skip-tokenizer-init: 1\n", ".yaml", [], "'skip-tokenizer-init' is a switch"),
    ("port: 'x'\n", ".yaml", [], "--port: invalid int value: 'x'"),
    ("api-key: k\n", ".json", [], "must be YAML"),
    ("api-key: k\n", ".yaml", ["--config", "again.yaml"], "more than once"),
])
def test_engine_config_file_errors_name_the_file_and_option(tmp_path, capsys, text, suffix, argv_extra, culprit):
    from areal_fast.embedded.__main__ import parse_args

    f = tmp_path / f"server{suffix}"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "/m", "--config", str(f), *argv_extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and culprit in err
    if "invalid int" not in culprit and "more than once" not in culprit:
        assert str(f) in err


def test_engine_config_file_missing_is_named(tmp_path, capsys):
    from areal_fast.embedded.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-path", "/m", "--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: cannot read it" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["inf", "nan", "-1", "soon"])
def test_flush_cache_timeout_must_be_finite(engine, timeout):
    status, ans = _post(engine.url + f"/flush_cache?timeout={timeout}", {})
    assert status == 400 and "timeout" in json.dumps(ans)


def test_oversized_bodies_are_refused_with_413(engine):
    huge = b'{"input_ids": [' + b"1, " * (engine.server.generate_limit // 3 + 1) + b'1]}'
    st, ans = _post(engine.url + "/generate", None, raw=huge)
    assert st == 413 and "limit" in json.dumps(ans)
    st, ans = _post(engine.url + "/pause_generation", None, raw=b'{"mode": "' + b"a" * (1 << 17) + b'"}')
    assert st == 413


def _raw_request(url: str, head: bytes, body: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


@pytest.mark.parametrize("value", [b"Bearer s3cr\xe9t", b"Bearer \xff\xfe", "Bearer 秘密".encode()])
def test_non_ascii_authorization_is_401_not_500(twins, value):
    """The key comparison once took the header's str as UTF-8 and raised (500) on undecodable bytes."""
    h = twins("0.5.23", api_key="s3cret")
    with _raw_request(h.url, b"GET /server_info HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                      + value + b"\r\n") as s:
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_a_request_whose_client_went_away_is_aborted(twins):
    """Engine side: as SGLang, a /generate whose connection closed is aborted, not run to its end
    (aiohttp does not cancel the handler). Watchdog: the request must leave the batch in 30 s."""
    h = twins("0.5.23")
    sched = h.server.scheduler
    max_new = h.server.context_length - 8
    body = json.dumps({"input_ids": [3, 4], "rid": "gone", "return_logprob": True,
                       "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}).encode()
    s = _raw_request(h.url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n", body)

    async def running():
        await until_running(h, 1)

    asyncio.run(running())
    req = next(r for r in list(sched._rows) if r.rid == "gone")
    # frozen in place, so that it cannot finish before the engine sees the closed connection (it
    # looks every DISCONNECT_POLL_S; a fast machine generates the whole answer in less)
    sched.call(lambda: sched.pause("in_place")).result()
    s.close()
    try:
        poll_until(lambda: req not in list(sched._rows), "the request of a client that went away to be aborted", 30)
    finally:
        sched.call(sched.resume).result()
    assert req.finish_reason["type"] == "abort" and len(req.output_ids) < max_new
