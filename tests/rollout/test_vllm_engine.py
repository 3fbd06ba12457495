"""The embedded engine as vLLM's twin (``--api vllm --vllm-version X``), driven by the vLLM adapter
of the rollout client (``VLLMRolloutClient``) and the vLLM disk update (``backends.vllm.disk``).

- token ids in and out and per-token log-probs equal to the HF reference (greedy);
- a disk update never leaves the server paused, when the reload fails as when it succeeds
  (AReaL issue 1160), and a server the client paused stays paused until the client resumes it;
- a keep (in_place) pause: the request stays on the server across a disk update, one segment,
  its tokens labelled by the weight-version spans of the two versions;
- the routes follow the release: 0.11.0 has no /pause (the client pauses by draining) and
  reloads with update_config + reload_weights.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from _shared import perturbed_checkpoint, tiny_model, until_running, wait_until
from tolerances import ENGINE_LOGPROB_ATOL

from areal_fast.backends.vllm.client import VLLMRolloutClient
from areal_fast.backends.vllm.disk import VLLMDiskCalls
from areal_fast.data.tiny_models import hf_greedy, hf_logprobs, load_hf
from areal_fast.embedded import start_engine_in_thread
from areal_fast.weights.errors import WeightSyncError

VOCAB = 256
PROMPT = [3, 17, 42, 9, 100]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny_qwen2_vllm", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def new_weights(model_dir, tmp_path_factory):
    return perturbed_checkpoint(model_dir, 7, tmp_path_factory.mktemp("ckpt_v1"))[0]


@pytest.fixture()
def twin(model_dir):
    h = start_engine_in_thread(model_dir, seed=1, api="vllm", vllm_version="0.33.0", weight_version="0")
    yield h
    h.stop()


def _get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def _post(url: str, body: dict | None = None) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


async def _generate(url: str, version: str, n: int, **sampling):
    async with VLLMRolloutClient([url], vllm_version=version) as c:
        return await c.generate(PROMPT, {"max_new_tokens": n, "temperature": 0.0, **sampling}, rid="q")


def test_twin_generates_token_ids_and_logprobs_as_the_reference(twin, model_dir):
    s = asyncio.run(_generate(twin.url, "0.33.0", 8, ignore_eos=True))
    hf = load_hf(model_dir)
    assert list(s.output_ids) == hf_greedy(hf, PROMPT, 8)
    ref = hf_logprobs(hf, PROMPT, list(s.output_ids), 0.0)
    assert max(abs(a - b) for a, b in zip(s.output_logprobs, ref)) < ENGINE_LOGPROB_ATOL
    assert list(s.output_versions) == [0] * 8 and s.num_segments == 1
    assert _get(twin.url + "/health")[0] == 200 and _get(twin.url + "/version")[1] == {"version": "0.33.0"}


def test_disk_update_never_leaves_the_server_paused(twin, new_weights, model_dir):
    calls = VLLMDiskCalls(timeout_s=60)
    try:
        with pytest.raises(WeightSyncError, match="reload"):
            calls.update_one(twin.url, {"model_path": str(model_dir) + "/no-such-dir", "weight_version": "1"})
        assert _get(twin.url + "/is_paused")[1] == {"is_paused": False}, "a failed reload left the server paused"
        calls.update_one(twin.url, {"model_path": new_weights, "weight_version": "1"})
        assert _get(twin.url + "/is_paused")[1] == {"is_paused": False}
        assert _get(twin.url + "/weight_info")[1] == {"weight_version": "1"}
        s = asyncio.run(_generate(twin.url, "0.33.0", 6, ignore_eos=True))
        assert list(s.output_ids) == hf_greedy(load_hf(new_weights), PROMPT, 6) and set(s.output_versions) == {1}
        # a server the client paused stays paused: resuming it is the client's
        assert _post(twin.url + "/pause?mode=keep")[0] == 200
        calls.update_one(twin.url, {"model_path": model_dir, "weight_version": "2"})
        assert _get(twin.url + "/is_paused")[1] == {"is_paused": True}
        assert _post(twin.url + "/resume")[0] == 200
    finally:
        calls.close()


def test_keep_pause_keeps_the_request_across_a_disk_update(twin, new_weights):
    async def run():
        async with VLLMRolloutClient([twin.url], vllm_version="0.33.0", pause_mode="in_place") as c:
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 300, "ignore_eos": True,
                                                           "temperature": 1.0}, rid="long"))
            await until_running(twin, 2, task=task)
            await c.pause_all()
            calls = VLLMDiskCalls(timeout_s=60)
            try:
                await asyncio.to_thread(calls.update_one, twin.url, {"model_path": new_weights, "weight_version": "1"})
            finally:
                calls.close()
            await c.continue_all()
            return await asyncio.wait_for(task, 120)

    s = asyncio.run(run())
    assert s.num_segments == 1 and len(s.output_ids) == 300
    v = list(s.output_versions)
    assert v[0] == 0 and v[-1] == 1 and v == sorted(v), "tokens labelled by the weights that made them"


def test_abort_pause_resubmits_prompt_plus_partial_output(twin):
    """An abort pause ends the request with what it has; after /resume the shared client resubmits
    prompt + output so far (its pre-encoded ids) and stitches the two segments."""
    async def run():
        async with VLLMRolloutClient([twin.url], vllm_version="0.33.0", pause_mode="abort") as c:
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 300, "ignore_eos": True,
                                                           "temperature": 1.0}, rid="cut"))
            await until_running(twin, 2, task=task)
            await c.pause_all()
            await wait_until(lambda: c.servers[0].in_flight == 0, "the aborted segment to come back")
            await c.continue_all()
            return await asyncio.wait_for(task, 120)

    s = asyncio.run(run())
    assert s.num_segments == 2 and len(s.output_ids) == 300 and not s.aborted


def test_routes_follow_the_release_0_11(model_dir, new_weights):
    h = start_engine_in_thread(model_dir, seed=1, api="vllm", vllm_version="0.11.0")
    calls = VLLMDiskCalls(timeout_s=60)
    try:
        assert _post(h.url + "/pause")[0] == 404 and _get(h.url + "/is_paused")[0] == 404
        assert _post(h.url + "/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": new_weights}})[0] == 500
        calls.update_one(h.url, {"model_path": new_weights, "weight_version": "1"})  # update_config + reload

        async def run():
            async with VLLMRolloutClient([h.url], vllm_version="0.11.0") as c:
                await c.pause_all()  # no /pause: drains (nothing in flight here)
                await c.continue_all()
                c.servers[0].weight_version = "1"  # 0.11 has no label: the run's loop keeps it
                return await c.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True})

        s = asyncio.run(run())
        assert list(s.output_ids) == hf_greedy(load_hf(new_weights), PROMPT, 5) and set(s.output_versions) == {1}
    finally:
        calls.close()
        h.stop()


def test_pause_in_abort_mode_refuses_new_completions_until_resume(twin):
    assert _post(twin.url + "/pause?mode=abort")[0] == 200
    status, _ = _post(twin.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 503
    assert _post(twin.url + "/pause?mode=retract")[0] == 422
    assert _post(twin.url + "/resume")[0] == 200
    assert _post(twin.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200


# ---------------------------------------------------------------------------- started as real vLLM is
def _call(url: str, method: str, body: dict | None = None, key: str | None = None) -> tuple[int, object]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_the_twin_asks_the_key_on_every_route_but_health_as_a_launched_vllm(model_dir):
    """As real vLLM behind the launcher's key guard: /metrics and paths it does not serve are keyed too."""
    h = start_engine_in_thread(model_dir, api="vllm", vllm_version="0.33.0", api_key="k1")
    try:
        routes = [("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"), ("POST", "/abort_requests"),
                  ("POST", "/v1/completions"), ("GET", "/server_info"), ("GET", "/version"), ("GET", "/metrics"),
                  ("POST", "/update_weights"), ("GET", "/health_generate"), ("POST", "/sleep")]
        assert {p: _call(h.url + p, m, {}, key=None)[0] for m, p in routes} == {p: 401 for _, p in routes}
        assert {p: _call(h.url + p, m, {}, key="k2")[0] for m, p in routes} == {p: 401 for _, p in routes}
        assert _call(h.url + "/health", "GET")[0] == 200
        assert _call(h.url + "/pause", "POST", {}, key="k1")[0] == 200
    finally:
        h.stop()


def test_the_twin_takes_vllm_s_context_and_served_name_flags(model_dir):
    """``--max-model-len`` and ``--served-model-name`` as vLLM answers them (the real server's answers
    are held to these in tests/rollout/test_real_vllm.py); the twin caches no prefix, and reports
    what it was started with."""
    from areal_fast.embedded.__main__ import parse_args

    args = parse_args(["--model", model_dir, "--api", "vllm", "--max-model-len", "32", "--served-model-name", "a",
                       "b", "--no-enable-prefix-caching"])
    assert (args.max_model_len, args.served_model_name, args.enable_prefix_caching) == (32, ["a", "b"], False)
    with pytest.raises(SystemExit):
        parse_args(["--model", model_dir, "--max-model-len", "32"])  # vLLM's: --api vllm only
    h = start_engine_in_thread(model_dir, api="vllm", vllm_version="0.33.0", max_model_len=32,
                               served_model_names=["a", "b"])
    try:
        assert [m["id"] for m in _get(h.url + "/v1/models")[1]["data"]] == ["a", "b"]
        status, e = _call(h.url + "/v1/completions", "POST", {"model": "default", "prompt": PROMPT})
        assert status == 404 and e["error"] == {"message": "The model `default` does not exist. Valid aliases: a, b.",
                                                "type": "NotFoundError", "param": "model", "code": 404}
        status, e = _call(h.url + "/v1/completions", "POST", {"model": "b", "prompt": [3] * 40})
        assert status == 400 and e["error"]["param"] == "input_tokens" and "context length is 32 tokens" in \
            e["error"]["message"]
        status, e = _call(h.url + "/v1/completions", "POST", {"model": "a", "prompt": [3] * 4, "max_tokens": 33})
        assert status == 400 and e["error"]["param"] == "max_tokens"
        status, a = _call(h.url + "/v1/completions", "POST", {"model": "a", "prompt": [3] * 30, "max_tokens": 8,
                                                                "ignore_eos": True})
        assert status == 200 and a["usage"]["completion_tokens"] == 2  # the rest of the context
        info = _get(h.url + "/server_info")[1]["vllm_config"]
        assert info["cache_config"]["enable_prefix_caching"] is False and info["model_config"]["max_model_len"] == 32
    finally:
        h.stop()


def test_a_server_that_caches_prefixes_is_not_paused_in_place(model_dir):
    """A pause in place keeps vLLM's prefix cache across the update: a server that reports prefix
    caching on (as real vLLM does by default) is refused at connect when the mode resolves to in
    place (auto on 0.33.0), and at an in-place pause; an abort pause (which resets the cache) is not."""
    from areal_fast.rollout.calls import RequestError, RolloutError

    h = start_engine_in_thread(model_dir, api="vllm", vllm_version="0.33.0", prefix_caching=True)
    try:
        async def connect(mode):
            async with VLLMRolloutClient([h.url], vllm_version="0.33.0", pause_mode=mode) as c:
                await c.pause_all("abort")
                await c.continue_all()
                await c.pause_all("in_place")

        for mode in ("auto", "in_place"):
            with pytest.raises(RequestError, match="--no-enable-prefix-caching"):
                asyncio.run(connect(mode))
        with pytest.raises(RolloutError, match="enable_prefix_caching"):
            asyncio.run(connect("abort"))
    finally:
        h.stop()


def test_a_lost_server_info_read_is_asked_again_not_taken_as_no_prefix_cache(model_dir, monkeypatch):
    """The first /server_info read fails (a timeout): the in-place pause after it still reads the
    server's prefix caching, and refuses."""
    from areal_fast.rollout.calls import RolloutError

    h = start_engine_in_thread(model_dir, api="vllm", vllm_version="0.33.0", prefix_caching=True)
    real_call, lost = VLLMRolloutClient._call, []

    async def call(self, s, method, path, *a, **kw):
        if path.startswith("/server_info") and not lost:
            lost.append(path)
            raise TimeoutError("the answer was lost")
        return await real_call(self, s, method, path, *a, **kw)

    monkeypatch.setattr(VLLMRolloutClient, "_call", call)
    try:
        async def go():
            async with VLLMRolloutClient([h.url], vllm_version="0.33.0", pause_mode="abort") as c:
                await c.pause_all("abort")  # its first read (at connect) is lost
                await c.continue_all()
                await c.pause_all("in_place")

        with pytest.raises(RolloutError, match="enable_prefix_caching"):
            asyncio.run(go())
        assert lost
    finally:
        h.stop()


# ---------------------------------------------------------------------------- scheduling
def test_a_request_sent_again_after_an_abort_pause_keeps_its_group_s_place(model_dir):
    """vLLM queues by arrival unless started with ``--scheduling-policy priority`` (the launcher's, and
    the twin's as a run launches it: ``embedded_vllm_args``). After an abort pause every interrupted
    request is sent again at once, and they arrive in no set order: here the newer groups' requests
    arrive first (sent during the pause, which vLLM 0.32 queues), one request runs at a time, and the
    interrupted request of the oldest group must still run before the newest group's: every segment
    carries its group's admission order (``ADMISSION_ORDER``) as its priority. Queued by arrival it
    ran last, behind both newer groups (and, with updates in between, past the staleness bound)."""
    from areal_fast.backends.vllm.server_command import embedded_vllm_args
    from areal_fast.embedded.__main__ import parse_args
    from areal_fast.rollout.staleness import ADMISSION_ORDER

    launched = parse_args(["--model", model_dir, *embedded_vllm_args("0.32.0")])
    h = start_engine_in_thread(model_dir, seed=1, api="vllm", vllm_version="0.32.0", weight_version="0",
                               max_running_requests=1, scheduling_policy=launched.scheduling_policy)
    sampling = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0}
    finished: list[str] = []

    async def group_request(client, order: int, rid: str):
        ADMISSION_ORDER.set(order)  # as the controller sets it in the group's task
        s = await client.generate(PROMPT, sampling, rid=rid)
        finished.append(rid)
        return s

    async def run():
        async with VLLMRolloutClient([h.url], vllm_version="0.32.0", pause_mode="abort") as c, \
                VLLMRolloutClient([h.url], vllm_version="0.32.0") as newer:
            old = asyncio.create_task(group_request(c, 1, "old"))
            await until_running(h, 2, task=old)
            await c.pause_all()
            await wait_until(lambda: c.servers[0].in_flight == 0, "the interrupted segment to come back")
            news = [asyncio.create_task(group_request(newer, k, f"new{k}")) for k in (2, 3)]
            await wait_until(lambda: len(h.server.scheduler._waiting) == 2, "the newer requests to queue")
            assert (await asyncio.to_thread(_post, h.url + "/update_weight_version", {"new_version": "1"}))[0] == 200
            await c.continue_all()
            return await asyncio.wait_for(asyncio.gather(old, *news), 120)

    try:
        old, *_ = asyncio.run(run())
    finally:
        h.stop()
    assert old.num_segments == 2 and old.output_versions[0] == 0 and old.output_versions[-1] == 1
    assert finished.index("old") < finished.index("new3"), f"finished in the order {finished}"


def test_the_twin_schedules_and_reports_as_vllm_started_so(model_dir):
    """``--scheduling-policy`` (vLLM's flag, ``--api vllm`` only) is reported in ``/server_info``; a
    completion's ``priority`` is taken under either policy (vLLM 0.32 and 0.33 take it under first
    come first served and ignore it) and refused with vLLM's schema answer when not a 64-bit integer."""
    from areal_fast.embedded.__main__ import parse_args

    assert parse_args(["--model", model_dir, "--api", "vllm"]).scheduling_policy is None
    with pytest.raises(SystemExit):
        parse_args(["--model", model_dir, "--scheduling-policy", "priority"])  # vLLM's: --api vllm only
    with pytest.raises(SystemExit):
        parse_args(["--model", model_dir, "--api", "vllm", "--scheduling-policy", "lifo"])
    for policy in (None, "priority"):
        h = start_engine_in_thread(model_dir, api="vllm", vllm_version="0.32.0", scheduling_policy=policy)
        try:
            info = _get(h.url + "/server_info")[1]["vllm_config"]
            assert info["scheduler_config"]["policy"] == (policy or "fcfs")
            body = {"prompt": PROMPT, "max_tokens": 2, "priority": -5}
            assert _call(h.url + "/v1/completions", "POST", body)[0] == 200
            for bad in ("1", 1.5, 2**63):
                status, e = _call(h.url + "/v1/completions", "POST", {**body, "priority": bad})
                assert status == 400 and e["error"]["param"] == "body.priority", (bad, e)
        finally:
            h.stop()


def test_a_first_come_first_served_server_paused_with_abort_is_named_in_a_note(model_dir, caplog):
    """The client connects to a server it will pause with abort and reads its scheduling policy: first
    come first served is named, with the flag that keeps an interrupted request's place; a priority
    server is not."""
    import logging

    async def connect(url, mode):
        async with VLLMRolloutClient([url], vllm_version="0.32.0", pause_mode=mode) as c:
            s = await c.generate(PROMPT, {"max_new_tokens": 2}, rid="q")
            return c.servers[0].info.get("scheduling_policy"), s

    warned = {}
    for policy in (None, "priority"):
        h = start_engine_in_thread(model_dir, api="vllm", vllm_version="0.32.0", scheduling_policy=policy)
        try:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="areal_fast.backends.vllm.client"):
                got, _ = asyncio.run(connect(h.url, "abort"))
            assert got == (policy or "fcfs")
            warned[got] = [r.getMessage() for r in caplog.records if "--scheduling-policy priority" in r.getMessage()]
            if got == "fcfs":
                assert len(warned[got]) == 1 and h.url in warned[got][0], warned[got]
        finally:
            h.stop()
    assert not warned["priority"]
