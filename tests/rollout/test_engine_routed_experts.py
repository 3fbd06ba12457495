"""The embedded engine returns the routed experts of every token (``--enable-return-routed-experts``,
``engine/routing_capture.py``) as SGLang 0.5.23 and vLLM 0.32 do: on the tiny Qwen3-MoE in fp32,
the rows it answers for a batch of prompts of different lengths (merged into one running batch by
left padding) are the routing of one HF forward of each whole sequence, through both APIs; the
start position slices them; a resumed request returns the remaining rows; a retracted request's
recomputed positions are overwritten; aborts answer as the real servers do; off by default."""

from __future__ import annotations

import base64
import io
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
N_NEW = [9, 6, 12, 7]  # rows leave the batch at different steps (the leading pad columns are cut)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe")), vocab_size=64, max_position_embeddings=128,
                                eos_token_id=1)


@pytest.fixture(scope="module")
def hf(moe_dir):
    from areal_fast.data.tiny_models import load_hf

    return load_hf(moe_dir)


def _engine(moe_dir, **kw):
    from areal_fast.embedded import start_engine_in_thread

    return start_engine_in_thread(moe_dir, seed=3, dtype="float32", max_running_requests=8, **kw)


@pytest.fixture(scope="module")
def sglang(moe_dir):
    h = _engine(moe_dir, return_routed_experts=True)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def twin(moe_dir):
    h = _engine(moe_dir, return_routed_experts=True, api="vllm", vllm_version="0.32.0")
    yield h
    h.stop()


def _post(url, path, body, ok=True):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        assert not ok, e.read()
        return e.code, json.loads(e.read())


def hf_routing(model, ids: list[int]) -> np.ndarray:
    """The routing of one HF forward of ``ids``: ``[len(ids), layers, top_k]`` (every block sparse)."""
    import torch

    from areal_fast.moe_routing import record_routing

    with torch.no_grad(), record_routing(model) as got:
        model(torch.tensor([ids]))
    return torch.stack([g[0] for g in got], dim=1).numpy()


def _sglang_rows(meta, hf_model) -> np.ndarray:
    from areal_fast.rollout.routed_experts import from_sglang

    cfg = hf_model.config
    return from_sglang(meta["routed_experts"], cfg.num_hidden_layers, cfg.num_experts_per_tok)


def _until(cond, what: str, limit_s: float = 120.0) -> None:
    """Wait for ``cond()`` (a guard against a hang, not a timing check)."""
    import time

    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def _batch(handle, path, bodies):
    """Post every body at once while the engine is paused, so all are admitted in one step (and
    decode as one left-padded batch); the answers in order."""
    sch = handle.server.scheduler
    sch.call(lambda: sch.pause("in_place")).result()
    out = [None] * len(bodies)

    def go(i):
        out[i] = _post(handle.url, path, bodies[i])[1]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    _until(lambda: sch.num_in_flight() == len(bodies), "every request queued")
    sch.call(sch.resume).result()
    for t in threads:
        t.join(60)
    return out


def test_sglang_api_rows_equal_hf_for_a_left_padded_batch(sglang, hf):
    """Four prompts of 3 to 11 tokens, sampled, one batch: each answer's rows (start 0, and start 2
    for the second request of each prompt) are HF's routing of prompt + output, positions
    [start, seqlen - 1); the engine answers SGLang's raw int32 base64."""
    bodies = [{"input_ids": p, "return_routed_experts": True, "routed_experts_start_len": s,
               "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
              for p, n in zip(PROMPTS, N_NEW) for s in (0, 2)]
    for body, ans in zip(bodies, _batch(sglang, "/generate", bodies)):
        seq = body["input_ids"] + ans["output_ids"]
        want = hf_routing(hf, seq)[body["routed_experts_start_len"]:len(seq) - 1]
        raw = base64.b64decode(ans["meta_info"]["routed_experts"])
        assert len(raw) == want.size * 4  # int32, no header
        assert np.array_equal(_sglang_rows(ans["meta_info"], hf), want)


def test_vllm_twin_rows_equal_hf_for_a_left_padded_batch(twin, hf):
    """The same through the vLLM twin: each choice's ``routed_experts`` is ``.npy`` base64, uint8
    (4 experts: vLLM's dtype rule), shape (seqlen - 1 - prompt_start, layers, top_k)."""
    from areal_fast.rollout.routed_experts import from_vllm

    bodies = [{"model": "default", "prompt": p, "max_tokens": n, "temperature": 1.0, "ignore_eos": True,
               "return_token_ids": True, "routed_experts_prompt_start": s}
              for p, n in zip(PROMPTS, N_NEW) for s in (0, len(p))]
    for body, ans in zip(bodies, _batch(twin, "/v1/completions", bodies)):
        choice = ans["choices"][0]
        seq = body["prompt"] + choice["token_ids"]
        want = hf_routing(hf, seq)[body["routed_experts_prompt_start"]:len(seq) - 1]
        arr = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
        assert arr.dtype == np.uint8 and arr.shape == want.shape
        assert np.array_equal(from_vllm(choice["routed_experts"]), want)


def test_a_resumed_request_returns_the_remaining_rows(sglang, twin, hf):
    """A request resumed with prompt = earlier prompt + output and the start at the first position
    not returned before (the earlier last token, never forwarded): the two answers' rows together
    are the whole sequence's, in both APIs."""
    from areal_fast.rollout.routed_experts import from_vllm

    p = PROMPTS[1]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    _, a = _post(sglang.url, "/generate", {"input_ids": p, "return_routed_experts": True,
                                           "sampling_params": {"max_new_tokens": 5, **greedy}})
    head = p + a["output_ids"]
    _, b = _post(sglang.url, "/generate", {"input_ids": head, "return_routed_experts": True,
                                           "routed_experts_start_len": len(head) - 1,
                                           "sampling_params": {"max_new_tokens": 6, **greedy}})
    seq = head + b["output_ids"]
    rows = np.concatenate([_sglang_rows(a["meta_info"], hf), _sglang_rows(b["meta_info"], hf)])
    assert np.array_equal(rows, hf_routing(hf, seq)[:len(seq) - 1])
    from areal_fast.backends.vllm.compat import VLLMBehaviour
    from areal_fast.backends.vllm.requests import completion_body

    _, c = _post(twin.url, "/v1/completions", completion_body(  # the body our vLLM client builds
        head, {"max_new_tokens": 6, **greedy}, "resumed", VLLMBehaviour.of("0.32.0"),
        routed_experts_prompt_start=len(head) - 1))
    assert c["choices"][0]["token_ids"] == b["output_ids"]
    assert np.array_equal(from_vllm(c["choices"][0]["routed_experts"]), _sglang_rows(b["meta_info"], hf))


def test_a_retracted_request_recomputes_its_rows(sglang, hf, monkeypatch):
    """Retracted after 3 decode steps, the router changed meanwhile (a weight update), continued:
    the recomputed prefill overwrites the earlier positions, so every row is the new router's
    (HF holding the new weights over the whole sequence), none the old one's."""
    import torch

    sch = sglang.server.scheduler
    step = sch._decode_step

    def then_retract():
        step()
        if sch.steps == 3:
            sch.pause("retract")

    monkeypatch.setattr(sch, "_decode_step", then_retract)
    sch.steps = 0
    p = PROMPTS[2]
    box = {}
    t = threading.Thread(target=lambda: box.update(a=_post(sglang.url, "/generate", {
        "input_ids": p, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}})[1]))
    t.start()
    _until(lambda: sch.paused and sch.num_in_flight(), "the request paused after 3 decode steps")
    gates = [m.weight for m in sglang.server.model.modules() if type(m).__name__.endswith("TopKRouter")]
    old = [g.detach().clone() for g in gates]
    try:
        sch.call(lambda: [g.data.mul_(-1.0) for g in gates]).result()
        _post(sglang.url, "/continue_generation", {})
        t.join(60)
        meta = box["a"]["meta_info"]
        assert meta["total_retractions"] == 1
        seq = p + box["a"]["output_ids"]
        with torch.no_grad():
            for m in hf.modules():
                if type(m).__name__.endswith("TopKRouter"):
                    m.weight.mul_(-1.0)
            new = hf_routing(hf, seq)[:len(seq) - 1]
            for m in hf.modules():
                if type(m).__name__.endswith("TopKRouter"):
                    m.weight.mul_(-1.0)
        got = _sglang_rows(meta, hf)
        assert np.array_equal(got, new)
        assert not np.array_equal(got, hf_routing(hf, seq)[:len(seq) - 1])  # the old router routes otherwise
    finally:
        sch.call(lambda: [g.data.copy_(o) for g, o in zip(gates, old)]).result()


def test_aborts_answer_as_sglang(sglang, hf, monkeypatch):
    """Aborted while running: the rows of what it forwarded ([0, seqlen - 1) of the partial output);
    aborted in the waiting queue: no routed_experts (SGLang answers it from its abort path)."""
    sch = sglang.server.scheduler
    step = sch._decode_step

    def then_pause():
        step()
        if sch.steps == 3:
            sch.pause("in_place")

    monkeypatch.setattr(sch, "_decode_step", then_pause)
    sch.steps = 0
    box = {}
    body = {"input_ids": PROMPTS[0], "rid": "running", "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.update(a=_post(sglang.url, "/generate", body)[1]))
    t.start()
    _until(lambda: sch.paused and sch.num_in_flight(), "the request paused after 3 decode steps")
    w = threading.Thread(target=lambda: box.update(w=_post(sglang.url, "/generate", {**body, "rid": "waiting"})[1]))
    w.start()
    _until(lambda: sch.num_in_flight() == 2, "the second request queued")
    _post(sglang.url, "/abort_request", {"rid": "running"})
    _post(sglang.url, "/abort_request", {"rid": "waiting"})
    t.join(60)
    w.join(60)
    _post(sglang.url, "/continue_generation", {})
    a = box["a"]
    assert a["meta_info"]["finish_reason"]["type"] == "abort" and len(a["output_ids"]) == 4
    seq = PROMPTS[0] + a["output_ids"]
    assert np.array_equal(_sglang_rows(a["meta_info"], hf), hf_routing(hf, seq)[:len(seq) - 1])
    assert box["w"]["meta_info"]["finish_reason"]["type"] == "abort" and "routed_experts" not in box["w"]["meta_info"]


def test_a_bad_start_is_refused_as_the_real_servers_do(sglang, twin):
    """SGLang aborts the request with its message (HTTP 400); vLLM answers 400 naming the
    parameter: its input check past the prompt, its schema below 0."""
    for start, words in ((6, "is higher than the number of input tokens len(req.origin_input_ids)=5"),
                         (-1, "is lower than 0")):
        code, body = _post(sglang.url, "/generate", {"input_ids": PROMPTS[1], "return_routed_experts": True,
                                                     "routed_experts_start_len": start,
                                                     "sampling_params": {"max_new_tokens": 2}}, ok=False)
        assert code == 400 and f"recv_req.routed_experts_start_len={start} {words}" in body["error"]["message"]
    code, body = _post(twin.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2,
                                                     "routed_experts_prompt_start": 6}, ok=False)
    assert code == 400 and body["error"] == {
        "message": "routed_experts_prompt_start must be between 0 and the prompt length (5), inclusive. "
                   "(parameter=routed_experts_prompt_start, value=6)",
        "type": "BadRequestError", "param": "routed_experts_prompt_start", "code": 400}
    code, body = _post(twin.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2,
                                                     "routed_experts_prompt_start": -1}, ok=False)
    assert code == 400 and body["error"]["param"] == "body.routed_experts_prompt_start"
    assert "greater_than_equal" in body["error"]["message"]


def test_off_by_default(moe_dir):
    """Without the flag nothing is recorded: SGLang's answer has no routed_experts even when asked;
    the vLLM twin's choice has it null (as real vLLM 0.32 answers without the server flag)."""
    for kw in ({}, {"api": "vllm", "vllm_version": "0.32.0"}):
        h = _engine(moe_dir, **kw)
        try:
            assert h.server.routing is None and h.server.scheduler.routing is None
            if kw:
                _, a = _post(h.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3,
                                                        "routed_experts_prompt_start": 1})
                assert "routed_experts" in a["choices"][0] and a["choices"][0]["routed_experts"] is None
            else:
                _, a = _post(h.url, "/generate", {"input_ids": PROMPTS[0], "return_routed_experts": True,
                                                  "sampling_params": {"max_new_tokens": 3}})
                assert "routed_experts" not in a["meta_info"]
        finally:
            h.stop()


def test_the_flag_is_refused_where_it_cannot_work(tmp_path, moe_dir):
    """A dense model, and a release without routed experts, are refused at start, naming the flag."""
    from areal_fast.data.tiny_models import build_tiny_qwen2
    from areal_fast.embedded.__main__ import parse_args

    assert parse_args(["--model-path", "m", "--enable-return-routed-experts"]).enable_return_routed_experts
    dense = build_tiny_qwen2(str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="enable-return-routed-experts: the model has no top-k router"):
        _engine(dense, return_routed_experts=True)
    with pytest.raises(ValueError, match="enable-return-routed-experts: sglang 0.5.6 returns no routed experts"):
        _engine(moe_dir, return_routed_experts=True, sglang_version="0.5.6")
    from areal_fast.backends.vllm.compat import VLLMBehaviour
    from areal_fast.backends.vllm.requests import completion_body

    with pytest.raises(ValueError, match="routed_experts_prompt_start: vLLM 0.27.0's completion request has no"):
        completion_body([1, 2], {}, "r", VLLMBehaviour.of("0.27.0"), routed_experts_prompt_start=1)


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_the_client_stitches_a_requests_routing_across_pauses(api, sglang, twin, hf, monkeypatch):
    """Through the rollout client (SGLang's API, or the vLLM adapter against the twin): a request
    paused in abort mode twice while it generates is resubmitted with its prompt and output so far,
    each segment asking only for the positions not recorded yet; the sample's column is HF's routing
    of the whole forwarded sequence, row by row."""
    import asyncio
    import time

    from _shared import until_running

    import areal_fast.rollout.client as client_mod
    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.backends.vllm.client import VLLMRolloutClient

    handle = sglang if api == "sglang" else twin
    sch = handle.server.scheduler
    forward = sch._forward

    def slow_forward(*a, **kw):  # a step every ~20 ms at least, so that a segment outlasts the polling
        time.sleep(0.02)
        return forward(*a, **kw)

    monkeypatch.setattr(sch, "_forward", slow_forward)
    starts = []
    stitch = client_mod.segment_routing
    monkeypatch.setattr(client_mod, "segment_routing",
                        lambda ans, w, sent, start, url, n: starts.append(start) or stitch(ans, w, sent, start, url, n))
    width = hf.config.num_hidden_layers * hf.config.num_experts_per_tok
    make = (SGLangRolloutClient if api == "sglang"
            else lambda urls, **kw: VLLMRolloutClient(urls, vllm_version="0.32.0", **kw))

    async def run():
        async with make([handle.url], routed_experts_width=width, num_experts=hf.config.num_experts) as c:
            task = asyncio.create_task(c.generate(PROMPTS[1], {"max_new_tokens": 40, "temperature": 1.0,
                                                                "ignore_eos": True}))
            for _ in range(2):  # each pause once the running segment has made a few tokens (no timer)
                await until_running(handle, 3, task=task)
                await c.pause_all("abort")
                await c.continue_all()
            return await task

    s = asyncio.run(asyncio.wait_for(run(), 120))
    seq = list(s.prompt_ids) + list(s.output_ids)
    assert len(s.output_ids) == 40 and s.num_segments == 3, s.num_segments
    # only the positions not recorded yet (a segment aborted before it ran records none: the same start)
    assert starts[0] == 0 and starts[-1] > 0 and all(b >= a for a, b in zip(starts, starts[1:])), starts
    got = np.frombuffer(s.routed_experts, dtype=np.int16).reshape(len(seq) - 1, -1)
    assert (got == hf_routing(hf, seq[:-1]).reshape(len(seq) - 1, -1)).all()
