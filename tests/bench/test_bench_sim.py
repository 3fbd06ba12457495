"""The simulated SGLang server of the benchmarks against the real SGLangRolloutClient: every request
answered exactly once, stitched tokens and per-token versions exact across pause / update /
continue in each pause mode. No timing is asserted."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from _shared import wait_until  # noqa: E402, I001

from areal_fast.backends.sglang.client import SGLangRolloutClient  # noqa: E402
from bench import bench_controller_scale as scale
from tools import sim_sglang as sim

PROMPT_LEN = 7
MAX_NEW = 600
RID = "f1"


def _cfg(**kw) -> sim.SimConfig:
    # ~200-token answers at 4 ms per tick: long enough that every pause below finds requests mid-way
    base = dict(decode_a_s=0.004, decode_b_s=0.0, len_median=200, len_sigma=0.6, len_max=900,
                prefill_tokens_per_s=1e6, max_running=16, vocab_size=5000, seed=3)
    base.update(kw)
    return sim.SimConfig(**base)


IN_PLACE_FLAGS = dict(disable_overlap_schedule=True, disable_radix_cache=True)  # what in_place needs of SGLang


async def _update_all(session, urls, version: int, flush: bool = True) -> None:
    for u in urls:
        async with session.post(u + "/update_weights_from_disk",
                                json={"model_path": "sim", "weight_version": str(version), "flush_cache": flush}) as r:
            assert r.status == 200, await r.text()


def test_answer_length_and_logprob_codec():
    cfg = _cfg()
    lens = [sim.answer_length(f"r{i}", cfg) for i in range(2000)]
    assert max(lens) <= 900 and min(lens) >= 1
    lens.sort()
    assert 150 <= lens[1000] <= 260  # median 200 (log-normal, seeded per rid)
    for v, t in [(0, 2), (7, 999), (123, 4321)]:
        assert sim.decode_logprob(sim.logprob_of(v, t)) == (v, t % 1000)


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="SimConfig.max_running"):
        sim.SimConfig(max_running=0)
    with pytest.raises(ValueError, match="unknown key 'decode_x'"):
        sim.SimConfig.from_json('{"decode_x": 1}')


@pytest.mark.parametrize("modes", [("abort", "retract", "in_place")])
def test_client_exact_across_pauses(modes):
    asyncio.run(_run_exact(modes))


async def _run_exact(modes):
    cfg = _cfg(api_key="k3y", **IN_PLACE_FLAGS)
    n_req = 40
    async with sim.SimCluster(3, cfg) as cluster:
        urls = cluster.urls
        async with SGLangRolloutClient(urls, api_key="k3y") as client, \
                aiohttp.ClientSession(headers={"Authorization": "Bearer k3y"}) as session:
            rids = [f"t{i}" for i in range(n_req)]
            tasks = [asyncio.create_task(client.generate(list(range(10, 10 + PROMPT_LEN)),
                                                         {"max_new_tokens": MAX_NEW}, rid=r)) for r in rids]
            version = 0
            for k, mode in enumerate(modes):
                # every request admitted and at least 5*(k+1) ticks decoded since the last pause
                mark = [s.ticks() for s in cluster.servers]
                await wait_until(lambda m=mark: all(s.ticks() >= p + 5 for s, p in zip(cluster.servers, m)),
                                f"progress before pause {k}")
                aborted_before = cluster.aborted_answers
                await client.pause_all(mode)
                version += 1
                if mode == "in_place":  # requests keep their KV: an update may not flush
                    assert not client.may_flush
                await _update_all(session, urls, version, flush=mode != "in_place")
                if mode == "abort":
                    assert cluster.aborted_answers > aborted_before
                else:
                    assert cluster.aborted_answers == aborted_before  # nothing comes back at the pause
                await client.continue_all()
            results = await asyncio.gather(*tasks)
        stats = cluster.stats()
    assert sorted(r.rid for r in results) == sorted(rids)
    assert stats["completed"] == n_req and stats["duplicates"] == 0
    errs = [e for r in results for e in sim.check_sample(r.rid, PROMPT_LEN, MAX_NEW, r.output_ids, r.output_logprobs,
                                                         r.output_versions, r.finish_reason, cfg, version)]
    assert errs == []
    spanning = [r for r in results if len(set(r.output_versions)) > 1]
    assert spanning, "no sample was interrupted by an update"
    assert any(r.num_segments > 1 for r in results)  # the abort pause made the client stitch segments
    assert {v for r in results for v in r.output_versions} <= set(range(version + 1))


def test_flush_refused_after_in_place_update_with_running_requests():
    async def run():
        async with sim.SimCluster(1, _cfg(**IN_PLACE_FLAGS)) as cluster:
            async with SGLangRolloutClient(cluster.urls) as client, aiohttp.ClientSession() as session:
                assert sim.answer_length(RID, _cfg()) > 100  # still running at the pause below
                task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": MAX_NEW}, rid=RID))
                await wait_until(lambda: cluster.servers[0].ticks() >= 3, "progress")
                await client.pause_all("in_place")
                async with session.post(cluster.urls[0] + "/update_weights_from_disk",
                                        json={"weight_version": "1", "flush_cache": True}) as r:
                    assert r.status == 400 and "not flushed" in (await r.json())["message"]
                async with session.post(cluster.urls[0] + "/flush_cache") as r:
                    assert r.status == 400
                await client.continue_all()
                res = await task
        assert sim.check_sample(RID, 3, MAX_NEW, res.output_ids, res.output_logprobs, res.output_versions,
                                res.finish_reason, _cfg(), 1) == []
        assert res.output_versions[0] == 0 and res.output_versions[-1] == 1

    asyncio.run(run())


def test_api_key_required():
    async def run():
        async with sim.SimCluster(1, _cfg(api_key="s3cret")) as cluster, aiohttp.ClientSession() as session:
            async with session.get(cluster.urls[0] + "/model_info") as r:
                assert r.status == 401
            async with session.get(cluster.urls[0] + "/health") as r:
                assert r.status == 200

    asyncio.run(run())


@pytest.mark.parametrize("pause_mode,client_procs", [(None, 1), ("abort", 1), (None, 2)])
def test_scale_benchmark_small_configuration_is_exact(pause_mode, client_procs):
    """The benchmark's own loop (real Controller, gate, ClientRollout; ShardedRollout with 2 worker
    processes) at a tiny scale: every group trained once, every sample exact. ``None`` is the
    production pause mode."""
    cfg = _cfg(api_key="bench-key", time_scale=10.0, len_median=40, len_max=200, max_running=64)
    spec = scale.RunSpec(servers=3, in_flight=48, group_size=4, eta=2, steps=3, train_s=0.05, max_new=200,
                         pause_mode=pause_mode, api_key="bench-key", prompt_len=5, client_procs=client_procs)

    async def run():
        async with sim.SimCluster(spec.servers, cfg) as cluster:
            return await scale.run_controller(spec, cfg, cluster.urls)

    row = asyncio.run(run())
    assert row["errors"] == [] and row["correct"]
    assert row["steps"] == 3 and row["samples_checked"] >= 3 * row["batch_groups"] * spec.group_size
    assert row["received_tokens"] >= row["trained_tokens"] > 0
    assert row["client_procs"] == client_procs
    if client_procs > 1:  # the workers did the HTTP work, and nothing was answered twice or re-sent
        assert row["worker_cpu_s"] > 0 and row["workers_peak_rss_mb"] > 0
        assert row["sharded_stats"]["duplicates_dropped"] == 0 and row["sharded_stats"]["resent"] == 0


def test_in_place_needs_the_servers_flags_and_an_update_without_flush():
    """The client refuses in_place on a simulated SGLang launched without --disable-overlap-schedule
    / --disable-radix-cache (nothing is paused); with them, an update without a flush goes in while
    requests run, and an update that asks for the flush (SGLang's default) is refused."""
    from areal_fast.rollout.client import RolloutError

    async def run(cfg):
        async with sim.SimCluster(1, cfg) as cluster:
            async with SGLangRolloutClient(cluster.urls) as client, aiohttp.ClientSession() as session:
                task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": MAX_NEW}, rid=RID))
                await wait_until(lambda: cluster.servers[0].ticks() >= 3, "progress")
                try:
                    await client.pause_all("in_place")
                except RolloutError as e:
                    refused = str(e)
                    paused = cluster.servers[0].paused
                    task.cancel()
                    return refused, paused
                answers = []
                for flush in (None, False):  # None: the field left out, so SGLang's default (flush)
                    body = {"weight_version": "1"} | ({} if flush is None else {"flush_cache": flush})
                    async with session.post(cluster.urls[0] + "/update_weights_from_disk", json=body) as r:
                        answers.append(r.status)
                await client.continue_all()
                res = await task
                return answers, res.num_segments

    refused, paused = asyncio.run(run(_cfg()))
    assert "--disable-overlap-schedule" in refused and not paused
    answers, segments = asyncio.run(run(_cfg(**IN_PLACE_FLAGS)))
    assert answers == [400, 200] and segments == 1


def test_scale_benchmark_counts_the_prefill_each_pause_mode_recomputes():
    """retract recomputes the KV of every request it retracts; in_place (with its flags, updates
    without flush) recomputes nothing and keeps every sample exact."""
    rows = {}
    for mode in ("retract", "in_place"):
        cfg = _cfg(api_key="bench-key", time_scale=10.0, len_median=60, len_max=200, max_running=64,
                   **(IN_PLACE_FLAGS if mode == "in_place" else {}))
        spec = scale.RunSpec(servers=2, in_flight=32, group_size=4, eta=2, steps=3, train_s=0.05, max_new=200,
                             pause_mode=mode, api_key="bench-key", prompt_len=5)

        async def run(cfg=cfg, spec=spec):
            async with sim.SimCluster(spec.servers, cfg) as cluster:
                return await scale.run_controller(spec, cfg, cluster.urls)

        rows[mode] = asyncio.run(run())
        assert rows[mode]["correct"], rows[mode]["errors"]
        assert rows[mode]["pause_modes_used"] == [mode]
    assert rows["retract"]["running_at_pauses"] > 0 and rows["retract"]["recomputed_prefill_tokens"] > 0
    assert rows["in_place"]["running_at_pauses"] > 0 and rows["in_place"]["recomputed_prefill_tokens"] == 0


def _req(cluster, rid: str, prompt_len: int, before: int, n: int, spans: list[list[int]]):
    base = sim.base_rid(rid)
    req = sim._Req(rid, base, sim._rid_hash(base, cluster.cfg.seed), prompt_len, before, n, True, 0, None)
    req.done, req.spans = n, spans
    return req


@pytest.mark.parametrize("version", ["0.5.18", "0.5.23"])
def test_fast_renderer_gives_the_reference_answers(version):
    """Pre-rendered slices vs token by token: the same JSON for every finish reason, for answers
    crossing the id cycle's end (several times over), with several version spans (empty ones too)
    and an EOS at the end of a span."""
    import random

    import orjson

    cfg = _cfg(vocab_size=1500, sglang_version=version)  # a short cycle (1,498 ids): answers wrap it
    cluster = sim.SimCluster(1, cfg)
    srv, rng = cluster.servers[0], random.Random(7)
    cases = 0
    for trial in range(150):
        n = rng.choice([0, 1, 2, 3, 999, 1498, 1499, 5000])
        spans = [[0, 0]]
        for v in range(1, rng.randint(1, 5)):
            spans.append([v * 3, rng.randint(spans[-1][1], n + 2)])
        req = _req(cluster, f"w{trial}|2|", rng.randint(1, 40), rng.randint(0, 30), n, spans)
        for reason, fr in (("stop", {"type": "stop", "matched": sim.EOS_ID}), ("length", {"type": "length"}),
                           ("abort", {"type": "abort"})):
            want = orjson.loads(srv.render_reference(req, reason, fr))
            got = orjson.loads(srv.render_fast(req, reason, fr))
            assert got == want, (trial, n, spans, reason)
            cases += 1
    assert cases == 450 and cluster.streams.renders >= 5  # several versions were pre-rendered


def test_fast_answers_pass_check_sample():
    """A rendered answer read back as the client does (log-probs into float32) passes check_sample,
    and a token with a wrong version is caught."""
    from array import array

    import orjson

    cfg = _cfg()
    cluster = sim.SimCluster(1, cfg)
    srv = cluster.servers[0]
    n_full = sim.answer_length("z9", cfg)
    req = _req(cluster, "z9", PROMPT_LEN, 0, n_full, [[0, 0], [4, n_full // 2]])
    d = orjson.loads(srv.render_fast(req, "stop", {"type": "stop"}))
    lps = array("f", [t[0] for t in d["meta_info"]["output_token_logprobs"]])
    versions = [0] * (n_full // 2) + [4] * (n_full - n_full // 2)
    assert sim.check_sample("z9", PROMPT_LEN, MAX_NEW, d["output_ids"], lps, versions, "stop", cfg, 4) == []
    versions[0] = 1
    assert sim.check_sample("z9", PROMPT_LEN, MAX_NEW, d["output_ids"], lps, versions, "stop", cfg, 4)


def test_logprob_codec_exact_through_float32():
    """Every version up to 10,000 (and the encoding's last one) with every token residue: the
    value read back from a float32 column decodes to the same (version, id % 1000)."""
    import numpy as np

    versions = np.array([*range(0, 10_001), sim.MAX_VERSION], dtype=np.int64)
    low = np.arange(1000, dtype=np.int64)
    k = (versions[:, None] * 1000 + low[None, :] + 1).ravel()
    lp64 = -k / sim.LP_SCALE
    assert lp64[3 * 1000 + 5] == sim.logprob_of(3, 5) and lp64[-1] == sim.logprob_of(sim.MAX_VERSION, 999)
    lp32 = lp64.astype(np.float32).astype(np.float64)
    assert np.array_equal(lp32, lp64)  # k < 2**24: exact in float32
    back = np.rint(-lp32 * sim.LP_SCALE).astype(np.int64) - 1
    assert np.array_equal(back // 1000, np.repeat(versions, 1000))
    assert np.array_equal(back % 1000, np.tile(low, len(versions)))
    for v, t in [(0, 2), (9_999, 31_999), (10_000, 1), (sim.MAX_VERSION, 999)]:  # the scalar functions too
        lp = float(np.float32(sim.logprob_of(v, t)))
        assert sim.decode_logprob(lp) == (v, t % 1000)


def test_scale_benchmark_new_modes_exact(tmp_path):
    """The command line's new modes on a tiny scale: servers over 2 simulator processes, no decode-rate
    limit, the first step held until the gate stops admitting; every sample exact, every rid once,
    the buffer as full as eta allows at the first step, and the memory fields filled."""
    import json

    scale.main(["--scales", "4:32", "--group-size", "4", "--eta", "2", "--steps", "2", "--train-s", "0.05",
                "--compress", "256", "--max-speed", "--fill-buffer", "--sim-procs", "2", "--buffer-memory-mb",
                "none", "--results", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "controller_scale.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["correct"] and row["errors"] == [] and row["steps"] == 2
    assert row["sim_procs"] == 2 and row["sim"]["max_speed"] and row["fill_buffer"]
    assert row["first_step_finished_groups"] == row["gate_bound_groups"] == 3 * row["batch_groups"]
    # both simulators' counters: every returned sample was a finished answer of one of them
    assert 0 < row["samples_checked"] <= row["answers"] - row["aborted_answers"]
    assert row["at_peak_held_tokens"] > 0 and row["received_tokens"] >= row["trained_tokens"] > 0
    assert row["client_tok_s_per_core"] > 0 and row["sim_cpu_us_per_tok"] > 0


def test_check_sample_catches_each_fault():
    """The vectorised check: an exact sample passes; one wrong id, a wrong finish reason, a token
    with a version other than the one that made it, versions going back, a version never published,
    and columns of different lengths are each reported."""
    cfg = _cfg()
    ids, fin = sim.expected_output("q1", PROMPT_LEN, MAX_NEW, cfg)
    n = len(ids)
    assert n > 4
    vers = [0] * (n // 2) + [2] * (n - n // 2)
    lps = [sim.logprob_of(v, t) for v, t in zip(vers, ids)]

    def errs(**kw):
        a = dict(output_ids=ids, logprobs=lps, versions=vers, finish_reason=fin) | kw
        return sim.check_sample("q1", PROMPT_LEN, MAX_NEW, a["output_ids"], a["logprobs"], a["versions"],
                                a["finish_reason"], cfg, 2)

    assert errs() == []
    assert "differ from position 3" in errs(output_ids=ids[:3] + [ids[3] + 1] + ids[4:])[0]
    assert "differ from position" in errs(output_ids=ids[:-1], logprobs=lps[:-1], versions=vers[:-1])[0]
    assert "finish_reason" in errs(finish_reason="length")[0]
    assert "token 0 reported version 1" in errs(versions=[1] + vers[1:])[0]
    assert any("back in time" in e for e in errs(versions=vers[:-1] + [0], logprobs=lps[:-1] +
                                                 [sim.logprob_of(0, ids[-1])]))
    late = [3] * n
    assert any("newer than" in e for e in errs(versions=late, logprobs=[sim.logprob_of(3, t) for t in ids]))
    assert "logprobs" in errs(logprobs=lps[:-1])[0]
