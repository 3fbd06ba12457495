"""The sharded rollout client (``areal_fast.rollout.sharded``) against simulated SGLang servers
(``tools/sim_sglang.py``, in this process) with 2 worker processes: every request answered exactly
once with exact tokens, log-probs and per-token versions, across pauses in abort and retract mode,
a killed worker, and close. No timing is asserted."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from array import array
from pathlib import Path

import aiohttp
import pytest
from _shared import wait_until  # noqa: E402, I001

from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.config import ConfigError, RolloutConfig, from_dict  # noqa: E402
from areal_fast.rollout.client import RequestError, RolloutError  # noqa: E402
from areal_fast.rollout.sharded import ShardedRollout  # noqa: E402
from areal_fast.sample import Sample  # noqa: E402
from tools import sim_sglang as sim

PROMPT = list(range(10, 17))
MAX_NEW = 600
KEY = "k3y"


def _cfg(**kw) -> sim.SimConfig:
    # ~200-token answers at 4 ms per tick: every pause below finds requests mid-way
    base = dict(decode_a_s=0.004, decode_b_s=0.0, len_median=200, len_sigma=0.6, len_max=900,
                prefill_tokens_per_s=1e6, max_running=64, vocab_size=5000, seed=5, api_key=KEY)
    base.update(kw)
    return sim.SimConfig(**base)


async def _update_all(urls, version: int) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        for u in urls:
            async with session.post(u + "/update_weights_from_disk",
                                    json={"model_path": "sim", "weight_version": str(version)}) as r:
                assert r.status == 200, await r.text()


async def _progress(cluster, ticks: int = 5) -> None:
    """Every server decoded ``ticks`` more steps (requests are running, mid-answer)."""
    mark = [s.ticks() for s in cluster.servers]
    await wait_until(lambda: all(s.ticks() >= p + ticks for s, p in zip(cluster.servers, mark)), "server progress")


def _check(cfg, rids, gens, version) -> None:
    assert len(gens) == len(rids)
    for rid, g in zip(rids, gens):
        assert isinstance(g, Sample) and g.rid == rid and g.prompt_ids.tolist() == list(PROMPT)
        assert all(isinstance(c, array) for c in (g.output_ids, g.output_logprobs, g.output_versions))
        assert sim.check_sample(rid, len(PROMPT), MAX_NEW, g.output_ids, g.output_logprobs, g.output_versions,
                                g.finish_reason, cfg, version) == []


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_every_request_answered_once_and_exact_across_pauses(mode):
    cfg = _cfg()

    async def run():
        async with sim.SimCluster(4, cfg) as cluster:
            async with ShardedRollout(cluster.urls, 2, client_class=SGLangRolloutClient, api_key=KEY) as rollout:
                assert sorted(rollout.urls) == sorted(cluster.urls)
                assert {tuple(w.urls) for w in rollout.workers} == {tuple(cluster.urls[0::2]),
                                                                    tuple(cluster.urls[1::2])}
                rids = [f"s{i}" for i in range(40)]
                tasks = [asyncio.create_task(rollout.generate(PROMPT, {"max_new_tokens": MAX_NEW}, r)) for r in rids]
                for version in (1, 2):
                    await _progress(cluster)
                    aborted_before = cluster.aborted_answers
                    await rollout.pause(mode)
                    assert set(rollout.server_pause_modes.values()) == {mode}
                    assert len(rollout.server_pause_modes) == 4
                    await _update_all(cluster.urls, version)
                    if mode == "retract":  # nothing comes back at the pause
                        assert cluster.aborted_answers == aborted_before
                    else:
                        assert cluster.aborted_answers > aborted_before
                    await rollout.resume()
                gens = await asyncio.gather(*tasks)
                stats = dict(rollout.stats)
            server_stats = cluster.stats()
        return rids, gens, stats, server_stats

    rids, gens, stats, server_stats = asyncio.run(run())
    _check(cfg, rids, gens, 2)
    assert stats["answers"] == len(rids) and stats["duplicates_dropped"] == 0 and stats["resent"] == 0
    assert server_stats["completed"] == len(rids) and server_stats["duplicates"] == 0
    assert any(len(set(g.output_versions)) > 1 for g in gens), "no sample spans an update"


def test_killed_worker_loses_nothing_and_is_named(caplog):
    cfg = _cfg()

    async def run():
        async with sim.SimCluster(4, cfg) as cluster:
            async with ShardedRollout(cluster.urls, 2, client_class=SGLangRolloutClient, api_key=KEY) as rollout:
                rids = [f"k{i}" for i in range(24)]
                tasks = [asyncio.create_task(rollout.generate(PROMPT, {"max_new_tokens": MAX_NEW}, r)) for r in rids]
                await _progress(cluster)
                await rollout.pause("retract")  # nothing finishes until resume: worker 0 holds requests
                victim = rollout.workers[0]
                in_flight = len(victim.outstanding)
                assert in_flight > 0
                os.kill(victim.proc.pid, signal.SIGKILL)
                await wait_until(lambda: rollout.stats["workers_lost"] == 1, "the controller sees the dead worker")
                assert rollout.urls == rollout.workers[1].urls  # its servers left the pool
                await _update_all(cluster.urls, 1)
                await rollout.resume()
                gens = await asyncio.gather(*tasks)
                return rids, gens, dict(rollout.stats), list(rollout.worker_failures), victim.proc.pid, in_flight

    rids, gens, stats, failures, pid, in_flight = asyncio.run(run())
    _check(cfg, rids, gens, 1)
    assert stats["resent"] == in_flight and stats["answers"] == len(rids) and stats["duplicates_dropped"] == 0
    assert len(failures) == 1 and "rollout worker 0" in failures[0] and f"pid {pid}" in failures[0]
    assert "exit code -9" in failures[0]
    assert any("rollout worker 0" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_leaves_no_process_and_fails_waiting_requests():
    async def run():
        async with sim.SimCluster(2, _cfg()) as cluster:
            rollout = ShardedRollout(cluster.urls, 2, client_class=SGLangRolloutClient, api_key=KEY)
            await rollout.start()
            pids = rollout.worker_pids()
            assert len(pids) == 2 and not any(_gone(p) for p in pids)
            # one long answer per worker (each worker serves one server here)
            rids = [r for r in (f"c{i}" for i in range(100)) if sim.answer_length(r, _cfg()) > 300][:2]
            tasks = [asyncio.create_task(rollout.generate(PROMPT, {"max_new_tokens": MAX_NEW}, r)) for r in rids]
            await _progress(cluster)
            await rollout.close()
            for t in tasks:
                with pytest.raises(RolloutError, match="closed"):
                    await t
            return pids

    pids = asyncio.run(run())
    assert all(_gone(p) for p in pids)  # exited and reaped (a zombie would still answer kill 0)


def test_api_key_and_options_reach_the_workers():
    async def run():
        async with sim.SimCluster(2, _cfg()) as cluster:
            with pytest.raises(RequestError, match="401"):  # a wrong key is the workers' first answer
                async with ShardedRollout(cluster.urls, 2, client_class=SGLangRolloutClient, api_key="wrong"):
                    pass
            async with ShardedRollout(cluster.urls, 2, client_class=SGLangRolloutClient, api_key=KEY,
                                      pause_mode="abort") as rollout:
                await rollout.pause()
                modes = dict(rollout.server_pause_modes)
                await rollout.resume()
                health = await rollout.health(cluster.urls[1])
        return modes, health

    modes, health = asyncio.run(run())
    assert set(modes.values()) == {"abort"} and len(modes) == 2
    assert health.state == "ok"


def test_bad_options_and_requests_are_refused_before_any_process():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    with pytest.raises(ValueError, match=r"client_processes: .*number of servers \(2\), got 3"):
        ShardedRollout(urls, 3, client_class=SGLangRolloutClient)
    with pytest.raises(ValueError, match="client_processes"):
        ShardedRollout(urls, 0, client_class=SGLangRolloutClient)
    with pytest.raises(ValueError, match="pause_mode"):
        ShardedRollout(urls, 2, client_class=SGLangRolloutClient, pause_mode="sometimes")


def test_client_processes_config_is_validated():
    assert RolloutConfig().client_processes == 1
    assert RolloutConfig(n_servers=4, client_processes=4).client_processes == 4
    with pytest.raises(ValueError, match="client_processes"):
        RolloutConfig(client_processes=0)
    with pytest.raises(ValueError, match=r"client_processes: .*\(2\)"):
        RolloutConfig(servers=["http://a:1", "http://b:2"], client_processes=3)
    with pytest.raises(ConfigError, match=r"rollout\.client_processes"):
        from_dict(RolloutConfig, {"n_servers": 2, "client_processes": 5}, prefix="rollout")


_CONTROLLER = """
import asyncio, json
from tools import sim_sglang as sim
from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.rollout.sharded import ShardedRollout

async def main():
    async with sim.SimCluster(2, sim.SimConfig(api_key="k")) as cluster:
        rollout = ShardedRollout(cluster.urls, 2, client_class=SGLangRolloutClient, api_key="k")
        await rollout.start()
        print(json.dumps(rollout.worker_pids()), flush=True)
        await asyncio.sleep(3600)  # until killed

asyncio.run(main())
"""


def _dead_or_zombie(pid: int) -> bool:
    """Gone, or exited and waiting for a reaper (a container's init may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_workers_die_with_a_killed_controller():
    import json
    import subprocess

    root = Path(__file__).resolve().parents[2]  # `python -c` puts its working folder on the path: bench.* imports
    proc = subprocess.Popen([sys.executable, "-c", _CONTROLLER], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        line = proc.stdout.readline()
        assert line, f"the controller process exited with {proc.wait()} before starting its workers"
        pids = json.loads(line)
        assert len(pids) == 2 and not any(_dead_or_zombie(p) for p in pids)
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs in the controller
        proc.wait()

    async def gone():
        await wait_until(lambda: all(_dead_or_zombie(p) for p in pids), "the workers of a killed controller to end")

    asyncio.run(gone())
