"""The rollout client's scale paths: compact answers (``areal_fast.rollout.answer``), the per-server
pause mode ``auto`` (retract on SGLang >= 0.5.19, abort before), exactness of both paths against the
simulated servers of the benchmarks. Correctness only: nothing here is timed."""

from __future__ import annotations

import asyncio
import gc
from array import array

import aiohttp
import pytest
from _shared import serve_app, wait_until  # noqa: E402, I001
from packaging.version import Version

from areal_fast.backends.sglang.client import SGLangRolloutClient, auto_pause_mode  # noqa: E402
from areal_fast.rollout.answer import AnswerError, parse_generate, token_versions, tune_gc  # noqa: E402
from tools import sim_sglang as sim

PROMPT_LEN = 5
MAX_NEW = 500


def _dumps(obj) -> bytes:
    """orjson's bytes (what SGLang sends), or skip: orjson is optional and never needed to collect."""
    return pytest.importorskip("orjson").dumps(obj)


def _answer(n: int, **meta) -> bytes:
    ids = list(range(100, 100 + n))
    base = {"id": "q|0|", "finish_reason": {"type": "length", "length": n},
            "output_token_logprobs": [[-(i + 1) / 1e6, t, None] for i, t in enumerate(ids)]}
    return _dumps({"output_ids": ids, "meta_info": {**base, **meta}})


def test_parse_generate_is_compact_and_exact():
    spans = [{"version": "3", "start": 0, "end": 4}, {"version": "4", "start": 4, "end": 10}]
    seg = parse_generate(_answer(10, weight_version="4", weight_versions=spans), "u/generate")
    assert isinstance(seg.ids, array) and seg.ids.typecode == "i" and seg.ids.tolist() == list(range(100, 110))
    assert seg.logprobs.typecode == "f" and seg.logprobs == array("f", [-(i + 1) / 1e6 for i in range(10)])
    assert seg.versions.tolist() == [3] * 4 + [4] * 6
    assert seg.weight_version == "4" and seg.finish["type"] == "length" and seg.rid == "q|0|"


def test_answers_from_a_memoryview_with_and_without_orjson(monkeypatch):
    """The HTTP path hands the parser a memoryview of its buffer; the json fallback takes it too."""
    from areal_fast.rollout import answer

    raw = memoryview(bytearray(b"xx" + _answer(4, weight_version="2")))[2:]
    want = parse_generate(bytes(raw), "u").ids.tolist()
    assert parse_generate(raw, "u").ids.tolist() == want
    monkeypatch.setattr(answer, "_orjson", None)
    seg = parse_generate(raw, "u")
    assert seg.ids.tolist() == want and seg.versions.tolist() == [2] * 4


def test_versions_without_spans_and_without_any_version():
    assert parse_generate(_answer(3, weight_version="7"), "u").versions.tolist() == [7, 7, 7]
    # SGLang 0.5.6-0.5.8, a request aborted while waiting: no version in the answer at all
    assert parse_generate(_answer(3), "u").versions is None
    assert token_versions({}, 3, fallback="2").tolist() == [2, 2, 2]
    assert token_versions({}, 0) is not None  # nothing to label


@pytest.mark.parametrize("obj,match", [
    ([1, 2], "answered list"),
    ({"output_ids": [1]}, "not a /generate result"),
    ({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]]}}, "2 output ids but 1 logprobs"),
])
def test_bad_answers_name_the_culprit(obj, match):
    with pytest.raises(AnswerError, match=match) as e:
        parse_generate(_dumps(obj), "http://h:1/generate (rid 'x|0|')")
    assert "http://h:1/generate (rid 'x|0|')" in str(e.value)


@pytest.mark.parametrize("enabled", [True, False])
def test_parse_leaves_the_collector_as_it_found_it(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        parse_generate(_answer(50, weight_version="1"), "u")
        with pytest.raises(AnswerError):
            parse_generate(b"[]", "u")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_tune_gc_freezes_and_sets_thresholds():
    before = gc.get_threshold()
    try:
        out = tune_gc((12_345, 11, 13))
        assert gc.get_threshold() == (12_345, 11, 13) and out["frozen"] > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_auto_pause_mode_by_version_and_bad_setting():
    assert auto_pause_mode(Version("0.5.19")) == "retract" and auto_pause_mode(Version("0.5.23")) == "retract"
    assert auto_pause_mode(Version("0.5.18")) == "abort" and auto_pause_mode(Version("0.5.6")) == "abort"
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        SGLangRolloutClient(["http://127.0.0.1:1"], pause_mode="in-place")


# ----------------------------------------------------------------------------- against the simulator


def _cfg(version: str) -> sim.SimConfig:
    # ~200-token answers at 4 ms per tick: every pause below finds requests mid-way
    return sim.SimConfig(decode_a_s=0.004, decode_b_s=0.0, len_median=200, len_sigma=0.6, len_max=900,
                         prefill_tokens_per_s=1e6, max_running=16, vocab_size=5000, seed=5, sglang_version=version)


@pytest.mark.parametrize("pause_mode", ["auto", "abort"])
def test_mixed_pool_exact_across_pauses(pause_mode):
    """One 0.5.8 server (no spans: auto aborts) and two 0.5.23 servers (auto retracts): every request
    answered once, tokens and per-token versions exact; nothing comes back from a retracting server."""
    asyncio.run(_mixed(pause_mode))


async def _mixed(pause_mode: str) -> None:
    old_cfg, new_cfg = _cfg("0.5.8"), _cfg("0.5.23")
    async with sim.SimCluster(1, old_cfg) as old, sim.SimCluster(2, new_cfg) as new:
        servers = old.servers + new.servers
        async with SGLangRolloutClient(old.urls + new.urls, pause_mode=pause_mode, gc_tuning=False) as client, \
                aiohttp.ClientSession() as session:
            rids = [f"m{i}" for i in range(36)]
            tasks = [asyncio.create_task(client.generate(list(range(10, 10 + PROMPT_LEN)), {"max_new_tokens": MAX_NEW},
                                                         rid=r)) for r in rids]
            for version in (1, 2):
                mark = [s.ticks() for s in servers]
                await wait_until(lambda m=mark: all(s.ticks() >= p + 5 for s, p in zip(servers, m)), "progress")
                aborted = (old.aborted_answers, new.aborted_answers)
                await client.pause_all()
                want = {"auto": ["abort", "retract", "retract"], "abort": ["abort"] * 3}[pause_mode]
                assert [client.server_pause_modes[s.url] for s in servers] == want
                for s in servers:
                    async with session.post(s.url + "/update_weights_from_disk",
                                            json={"model_path": "sim", "weight_version": str(version)}) as r:
                        assert r.status == 200
                assert old.aborted_answers > aborted[0]  # the old server always aborts
                if pause_mode == "auto":
                    assert new.aborted_answers == aborted[1]  # retract: nothing came back
                await client.continue_all()
            results = await asyncio.gather(*tasks)
    assert sorted(r.rid for r in results) == sorted(rids)
    for cl in (old, new):
        assert cl.duplicates == 0
    assert len(old.completed_rids | new.completed_rids) == len(rids)
    errs = []
    for r in results:
        # a sample's segments may run on both kinds of server: either config checks ids and versions
        errs += sim.check_sample(r.rid, PROMPT_LEN, MAX_NEW, r.output_ids, r.output_logprobs, r.output_versions,
                                 r.finish_reason, new_cfg, 2)
    assert errs == []
    assert any(len(set(r.output_versions)) > 1 for r in results), "no sample spans an update"
    if pause_mode == "auto":
        on_new = [r for r in results if set(r.servers) <= set(new.urls)]
        assert on_new and all(r.num_segments == 1 for r in on_new)  # retract: one answer per request


def test_large_pool_two_choices_exact():
    """Above PICK_SCAN_MAX servers a request goes to the less loaded of two drawn at random: still
    every request once, exact, and no server left idle."""
    from areal_fast.rollout.client import PICK_SCAN_MAX

    async def run():
        cfg = _cfg("0.5.23")
        async with sim.SimCluster(PICK_SCAN_MAX + 4, cfg) as cl:
            async with SGLangRolloutClient(cl.urls, gc_tuning=False) as client:
                rids = [f"p{i}" for i in range(8 * len(cl.urls))]
                tasks = [asyncio.create_task(client.generate([3] * PROMPT_LEN, {"max_new_tokens": MAX_NEW}, rid=r))
                         for r in rids]
                await wait_until(lambda: all(s.running for s in cl.servers), "every server busy")
                await client.pause_all()
                await client.continue_all()
                results = await asyncio.gather(*tasks)
        assert sorted(r.rid for r in results) == sorted(rids) and cl.duplicates == 0
        errs = [e for r in results for e in sim.check_sample(r.rid, PROMPT_LEN, MAX_NEW, r.output_ids,
                                                             r.output_logprobs, r.output_versions, r.finish_reason,
                                                             cfg, 0)]
        assert errs == []

    asyncio.run(run())


@pytest.mark.parametrize("http", ["native", "aiohttp"])
def test_control_call_sent_again_once_when_the_connection_breaks(http):
    """A server that drops the connection of the first /continue_generation (as a kept-alive
    connection closed under the client does): continue_all succeeds with a second call; a server
    that always drops it still fails."""
    from aiohttp import web

    async def run(drops: int):
        calls = {"continue": 0}

        async def info(request):
            return web.json_response({"version": "0.5.23", "tp_size": 1, "weight_version": "0"})

        async def model_info(request):
            return web.json_response({"weight_version": "0"})

        async def cont(request):
            calls["continue"] += 1
            if calls["continue"] <= drops:
                request.transport.close()  # no answer: the client sees the connection end
                raise web.HTTPInternalServerError()
            return web.json_response({"success": True})

        app = web.Application()
        app.router.add_get("/server_info", info)
        app.router.add_get("/model_info", model_info)
        app.router.add_post("/continue_generation", cont)
        async with serve_app(app) as url, SGLangRolloutClient([url], gc_tuning=False, http=http) as c:
            await c.continue_all()
        return calls["continue"]

    assert asyncio.run(run(drops=1)) == 2
    with pytest.raises(aiohttp.ClientConnectionError if http == "aiohttp" else ConnectionError):
        asyncio.run(run(drops=2))
