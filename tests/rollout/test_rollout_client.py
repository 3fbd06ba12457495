"""RolloutClient against embedded engines on loopback: interruption and stitching, abort, failover, load."""

import asyncio
import random

import pytest
from _shared import disk_update, engine_twins, serve_app, tiny_checkpoints, until_running
from tolerances import ENGINE_LOGPROB_ATOL

from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.data.tiny_models import hf_greedy, hf_logprobs, load_hf
from areal_fast.embedded import launch_engine_subprocess, start_engine_in_thread
from areal_fast.rollout.client import (
    RequestError,
    RolloutError,
    ServerError,
    server_rid,
    version_to_int,
)

VOCAB = 256


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, {v: 100 + v for v in (1, 2)}, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def doomed(dirs):
    """A subprocess engine for the kill test, started early so its start-up overlaps other tests."""
    h = launch_engine_subprocess(dirs[0][0], wait=False)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def engines(dirs, doomed):
    handles = [start_engine_in_thread(dirs[0][0], seed=i) for i in range(2)]
    yield handles
    for h in handles:
        h.stop()


def _run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _update(client: SGLangRolloutClient, path: str, version: str) -> None:
    await asyncio.to_thread(disk_update, [s.url for s in client.servers], path, version)


async def _reset(client: SGLangRolloutClient, base: str) -> None:
    await _update(client, base, "0")


async def _wait_tokens(engine, n: int, required: bool = True) -> None:
    """Wait until some running request on this in-thread engine holds >= n output tokens."""
    sched = engine.server.scheduler
    for _ in range(2000):
        if any(len(r.output_ids) >= n for r in list(sched._rows)):
            return
        await asyncio.sleep(0.002)
    if required:
        raise AssertionError(f"no request reached {n} tokens")


def test_version_to_int():
    assert version_to_int("7") == 7 and version_to_int("default") == 0 and version_to_int("x1") == -1


# abort: the request comes back at the pause and is resubmitted (two segments stitched);
# auto on a 0.5.23 engine: retract, the request stays on the server (one answer, versions from spans)
@pytest.mark.parametrize("mode,segments", [("abort", 2), ("auto", 1)])
def test_pause_update_continue_stitches_tokens_and_versions(engines, dirs, mode, segments):
    paths, sds = dirs
    prompt, n = [9, 8, 7, 6], 120

    async def run():
        async with SGLangRolloutClient([h.url for h in engines]) as c:
            await _reset(c, paths[0])
            task = asyncio.create_task(c.generate(prompt, {"max_new_tokens": n, "temperature": 0.0,
                                                           "ignore_eos": True}, rid="stitch"))
            await asyncio.gather(*(_wait_tokens(e, 15) for e in engines[:1]), return_exceptions=True)
            await asyncio.sleep(0)
            await c.pause_all(mode)
            assert set(c.server_pause_modes.values()) == {"abort" if mode == "abort" else "retract"}
            await c.flush_cache_all()
            await _update(c, paths[1], "1")
            await c.continue_all()
            res = await task
            await _reset(c, paths[0])
            return res

    res = _run(run())
    assert res.finish_reason == "length" and not res.aborted
    assert len(res.output_ids) == len(res.output_logprobs) == len(res.output_versions) == n
    assert res.num_segments == segments
    ids, versions = list(res.output_ids), list(res.output_versions)  # array columns, compared as lists
    k = versions.index(1)
    assert 0 < k < n
    assert versions == [0] * k + [1] * (n - k)  # versions change exactly at the seam
    old, new = load_hf(paths[0]), load_hf(paths[0], sds[1])
    assert ids[:k] == hf_greedy(old, prompt, k)
    # greedy continuation after the update == generating from prompt + partial with the new weights
    assert ids[k:] == hf_greedy(new, prompt + ids[:k], n - k)
    ref = hf_logprobs(old, prompt, ids[:k], 0.0) + hf_logprobs(new, prompt + ids[:k], ids[k:], 0.0)
    assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref)) < ENGINE_LOGPROB_ATOL


def test_explicit_abort_ends_as_length(engines):
    async def run():
        async with SGLangRolloutClient([h.url for h in engines]) as c:
            task = asyncio.create_task(c.generate([3, 4, 5], {"max_new_tokens": 400, "ignore_eos": True}, rid="ab"))
            await _wait_tokens(engines[0], 5)
            await c.abort("ab")
            return await task

    res = _run(run())
    assert res.aborted and res.finish_reason == "length"
    assert 0 < len(res.output_ids) < 400 and len(res.output_logprobs) == len(res.output_ids)


def test_sglang_launcher_needs_sglang(monkeypatch):
    import importlib.util

    from areal_fast.backends.sglang import server_command as sc

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(RuntimeError, match="sglang is not installed"):
        sc.launch_sglang_server("/nonexistent")
    cmd = sc.sglang_server_command("sglang", "/m", "127.0.0.1", 30001, tp_size=2, weight_version="3")
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--weight-version") + 1] == "3"


def test_4xx_raises_without_retry(engines):
    async def run():
        async with SGLangRolloutClient([h.url for h in engines]) as c:
            with pytest.raises(RequestError) as ei:
                await c.generate([1, 2], {"max_new_tokens": 4, "top_p": 0.0})
            return ei.value, [s.down_until for s in c.servers]

    err, down = _run(run())
    assert err.status == 400 and "top_p" in str(err)
    assert down == [0.0, 0.0]  # a caller error never takes a server out of the pool


def test_killed_server_request_completes_on_other(engines, dirs, doomed):
    paths, _ = dirs
    doomed.wait_healthy()
    prompt, n = [11, 12, 13], 150
    try:
        async def run():
            async with SGLangRolloutClient([doomed.url, engines[0].url], down_cooldown_s=60) as c:
                await _update(c, paths[0], "0")
                task = asyncio.create_task(c.generate(prompt, {"max_new_tokens": n, "temperature": 0.0,
                                                               "ignore_eos": True}, rid="failover"))
                # the request went to the first (least loaded, equal) server: kill it mid-generation.
                # Freeze it there first (an in_place pause keeps the request, and sends nothing back), so
                # it cannot finish before the kill however fast or slow this machine is.
                for _ in range(3000):
                    info = await c._call(c.servers[0], "GET", "/get_server_info")
                    if info["num_running_requests"] >= 1:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the request never started on the doomed server")
                await c._call(c.servers[0], "POST", "/pause_generation", {"mode": "in_place"})
                info = await c._call(c.servers[0], "GET", "/get_server_info")
                assert info["num_running_requests"] == 1  # still there, frozen mid-generation
                doomed.kill()
                return await task

        res = _run(run())
    finally:
        doomed.stop()
    assert res.servers == [engines[0].url]  # the killed server never answered
    assert res.finish_reason == "length" and len(res.output_ids) == n
    assert list(res.output_ids) == hf_greedy(load_hf(paths[0]), prompt, n)  # nothing duplicated or lost


def test_200_concurrent_with_random_pauses_and_updates(engines, dirs):
    paths, _ = dirs
    rng = random.Random(0)
    specs = [(f"r{i}", [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 12))], rng.randrange(1, 40),
              rng.random() < 0.5) for i in range(200)]

    async def run():
        async with SGLangRolloutClient([h.url for h in engines]) as c:
            await _reset(c, paths[0])

            async def updater():
                for v in (1, 2, 3):
                    await _wait_tokens(engines[0], 1, required=v == 1)  # pause while something runs
                    await asyncio.sleep(rng.uniform(0.0, 0.05))
                    await c.pause_all()
                    await c.flush_cache_all()
                    await _update(c, paths[1 + v % 2], str(v))
                    await c.continue_all()

            up = asyncio.create_task(updater())
            results = await asyncio.gather(*(
                c.generate(p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": ign}, rid=rid)
                for rid, p, n, ign in specs))
            await up
            in_flight = [(await c._call(s, "GET", "/get_server_info"))["num_running_requests"] for s in c.servers]
            await _reset(c, paths[0])
            return results, in_flight

    results, in_flight = _run(run(), timeout=90)
    assert sorted(r.rid for r in results) == sorted(s[0] for s in specs)  # each exactly once
    assert in_flight == [0, 0]
    interrupted = 0
    for r, (_, p, n, ign) in zip(results, specs):
        assert r.prompt_ids.tolist() == list(p)
        assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions) <= n
        assert list(r.output_versions) == sorted(r.output_versions)  # tokens never get older along a sequence
        assert r.finish_reason in ("stop", "length") and not r.aborted
        if ign or r.finish_reason == "length":
            assert len(r.output_ids) == n
        interrupted += len(set(r.output_versions)) > 1  # generated across an update (retract or abort)
    assert interrupted > 0
    assert {v for r in results for v in r.output_versions} >= {0, 3}


def test_version_adaptation_and_5xx_failover_with_fake_servers():
    """Fake servers: an old SGLang (0.5.5, only /get_server_info) gets no pause mode; a 503 fails over."""
    from aiohttp import web

    async def run():
        calls: list[tuple[str, str, dict]] = []

        def make(name: str, version: str, gen_status: int):
            async def info(request):
                return web.json_response({"version": version, "tp_size": 1, "weight_version": "0"})

            async def any_post(request):
                body = await request.json() if request.can_read_body else {}
                calls.append((name, request.path, body))
                if request.path == "/generate":
                    if gen_status != 200:
                        return web.json_response({"error": {"message": "overloaded"}}, status=gen_status)
                    n = body["sampling_params"]["max_new_tokens"]
                    return web.json_response({"output_ids": [5] * n, "meta_info": {
                        "id": body["rid"], "finish_reason": {"type": "length", "length": n},
                        "weight_version": "4", "output_token_logprobs": [[-0.5, 5, None]] * n}})
                return web.json_response({"success": True, "message": "", "status": "ok"})

            app = web.Application()
            app.router.add_get("/get_server_info", info)
            app.router.add_post("/{tail:.*}", any_post)
            return app

        runners, urls = [], []
        for name, version, st in (("old", "0.5.5", 503), ("mid", "0.5.20", 200)):
            runner = web.AppRunner(make(name, version, st))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        try:
            async with SGLangRolloutClient(urls, down_cooldown_s=60) as c:
                await c.pause_all()
                await c.continue_all()
                res = await c.generate([1, 2], {"max_new_tokens": 3}, rid="x")  # "old" answers 503 first
                assert c.remove_server(urls[0]) and not c.remove_server(urls[0])
                with pytest.raises(Exception, match="last server"):
                    c.remove_server(urls[1])
                await c.add_server(urls[0])
                assert [s.url for s in c.servers] == [urls[1], urls[0]] and c.servers[1].version.release == (0, 5, 5)
        finally:
            for r in runners:
                await r.cleanup()
        return calls, res

    calls, res = _run(run())
    pauses = {name: body for name, path, body in calls if path == "/pause_generation"}
    # mode "auto" per server: 0.5.5 knows no modes (empty body), 0.5.20 has spans -> retract
    assert pauses == {"old": {}, "mid": {"mode": "retract"}}
    gens = [name for name, path, _ in calls if path == "/generate"]
    assert gens == ["old", "mid"]  # least loaded first, 503 -> retried once elsewhere
    assert list(res.output_ids) == [5, 5, 5] and list(res.output_versions) == [4, 4, 4] and len(res.servers) == 1


# ---------------------------------------------------------------------------- against the SGLang twin
@pytest.fixture(scope="module")
def twins(dirs):
    yield from engine_twins(dirs[0][0])


def test_n_greater_than_one_and_unknown_keys_refused_before_sending(twins):
    h = twins("0.5.6")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            with pytest.raises(ValueError, match=r"sampling_params.n=4.*one sample per call"):
                await c.generate([1, 2], {"n": 4})
            with pytest.raises(ValueError, match="sampling_params.no_such_key"):
                await c.generate([1, 2], {"no_such_key": 1})
            with pytest.raises(ValueError, match="without '\\|'"):
                await c.generate([1, 2], {}, rid="a|b")
            return h.server.scheduler.steps

    steps = h.server.scheduler.steps
    assert _run(run()) == steps  # nothing reached the server


def test_server_rids_are_never_prefixes_of_each_other():
    rids = [server_rid(r, k) for r in ("q1-s1", "q1-s10", "q1-s1|x".replace("|", "-"), "q") for k in (0, 1, 10)]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]


def test_abort_of_one_rid_leaves_the_rids_it_prefixes_running(twins):
    h = twins("0.5.23")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            sp = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
            short = asyncio.create_task(c.generate([3, 4], sp, rid="q1-s1"))
            longer = asyncio.create_task(c.generate([3, 4], sp, rid="q1-s10"))
            await until_running(h, 2, count=2)
            await c.abort("q1-s1")
            return await short, await longer

    a, b = _run(run())
    assert a.aborted and len(a.output_ids) < 300
    assert not b.aborted and len(b.output_ids) == 300  # SGLang would have aborted it by prefix


def test_missing_weight_version_on_0_5_6_is_not_labelled_version_0(twins, dirs):
    h = twins("0.5.6")
    disk_update([h.url], dirs[0][0], "3")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            task = asyncio.create_task(c.generate([6, 2], {"max_new_tokens": 300, "ignore_eos": True}, rid="w"))
            await until_running(h, 3)
            await c.pause_all("retract")  # the request goes back to the server's waiting queue
            await c.abort("w")  # aborted while waiting: 0.5.6 sends no weight_version
            await c.continue_all()
            return await task

    res = _run(run())
    assert res.aborted and len(res.output_ids) >= 3
    assert set(res.output_versions) == {3}


def test_in_place_pause_forbids_flush_and_retract_allows_it(twins):
    h = twins("0.5.23")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            task = asyncio.create_task(c.generate([8, 1], {"max_new_tokens": 200, "ignore_eos": True}, rid="ip"))
            await until_running(h, 2)
            await c.pause_all("in_place")
            assert not c.may_flush
            with pytest.raises(RolloutError, match="in_place"):
                await c.flush_cache_all(timeout_s=5)
            await c.continue_all()
            await until_running(h, 4)
            await c.pause_all("retract")
            assert c.may_flush
            await c.flush_cache_all(timeout_s=5)  # retracted requests hold no KV
            await c.continue_all()
            return await task

    res = _run(run())
    assert len(res.output_ids) == 200 and not res.aborted


def test_health_tells_a_paused_server_from_a_dead_one(twins):
    h = twins("0.5.23")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            ok = await c.health(h.url)
            await c.pause_all()
            try:
                raw, _ = await c._request(c.servers[0], "GET", "/health")  # SGLang's probe: 503 once
                # the pause outlasts it
                paused = await c.health(h.url)
            finally:
                await c.continue_all()
            gone = await c.health("http://127.0.0.1:9")  # nothing listens on the discard port
            return ok, raw, paused, gone

    ok, raw, paused, gone = _run(run())
    assert ok.state == "ok" and raw == 503
    assert paused.state == "paused" and paused.alive
    assert gone.state == "down" and not gone.alive


def test_current_weight_version_comes_from_model_info_from_0_5_19(twins, dirs):
    h = twins("0.5.19")
    disk_update([h.url], dirs[0][0], "7")

    async def run():
        async with SGLangRolloutClient([h.url]) as c:
            return c.servers[0].info["weight_version"], c.servers[0].weight_version, await c.weight_versions()

    launch, current, listed = _run(run())
    assert launch == "default" and current == "7" and listed == ["7"]


def test_api_key_from_the_environment(twins, monkeypatch):
    h = twins("0.5.23", api_key="k3y")

    async def run(key=None):
        async with SGLangRolloutClient([h.url], api_key=key) as c:
            return (await c.generate([1, 2], {"max_new_tokens": 2})).output_ids

    monkeypatch.delenv("AREAL_FAST_API_KEY", raising=False)
    with pytest.raises(RequestError) as ei:
        _run(run())
    assert ei.value.status == 401
    monkeypatch.setenv("AREAL_FAST_API_KEY", "k3y")
    assert len(_run(run())) == 2


def test_answers_are_classified_by_what_they_say():
    """Fake 0.5.21 server: a 500 TypeError is the caller's error (not retried, server kept); a 400
    from /flush_cache is a transient state (retried until 200); a 502 is the server's (retried)."""
    from aiohttp import web

    async def run():
        state = {"flush": 0, "gen": 0}

        async def info(request):
            return web.json_response({"version": "0.5.21", "tp_size": 1, "weight_version": "0"})

        async def flush(request):
            state["flush"] += 1
            if state["flush"] < 3:
                return web.Response(status=400, text="Cache not flushed because there are running requests.")
            return web.Response(text="Cache flushed.")

        async def generate(request):
            state["gen"] += 1
            body = await request.json()
            if "min_p" in body["sampling_params"]:
                return web.Response(status=500, text="TypeError: unexpected keyword argument 'min_p'")
            if state["gen"] == 2:
                return web.Response(status=502, text="bad gateway")
            n = body["sampling_params"]["max_new_tokens"]
            return web.json_response({"output_ids": [5] * n, "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "length"}, "weight_version": "0",
                "output_token_logprobs": [[-0.1, 5, None]] * n}})

        app = web.Application()
        app.router.add_get("/server_info", info)
        app.router.add_post("/flush_cache", flush)
        app.router.add_post("/generate", generate)
        async with serve_app(app) as url, SGLangRolloutClient([url], retry_backoff_s=0.0, down_cooldown_s=0.0) as c:
            with pytest.raises(RequestError) as ei:
                await c.generate([1], {"max_new_tokens": 2, "min_p": 0.1})
            await c.flush_cache_all(timeout_s=10, poll_s=0.0)
            res = await c.generate([1], {"max_new_tokens": 2})  # the 502 is retried
            return ei.value, state, res, c.servers[0]

    err, state, res, server = _run(run())
    assert err.status == 500 and state["gen"] == 3  # the TypeError was sent once, never retried
    assert state["flush"] == 3 and list(res.output_ids) == [5, 5] and server.url in res.servers
    assert issubclass(ServerError, RolloutError)
