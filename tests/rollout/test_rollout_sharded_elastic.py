"""A server added to the sharded rollout client mid-run (``ShardedRollout.add_server``, used when an
elastic server joins: ``docs/elastic.md``) gets requests through a worker, also one that had lost
all its servers; every request is answered. Simulated SGLang servers (``tools/sim_sglang.py``)."""

from __future__ import annotations

import asyncio

from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.rollout.sharded import ShardedRollout  # noqa: E402
from tools import sim_sglang as sim

KEY = "k3y"
PROMPT = list(range(10, 17))


def test_an_added_server_takes_requests_through_the_worker_that_lost_its_own():
    cfg = sim.SimConfig(decode_a_s=0.001, decode_b_s=0.0, len_median=20, len_sigma=0.3, len_max=40,
                        prefill_tokens_per_s=1e6, max_running=64, vocab_size=5000, seed=5, api_key=KEY)

    async def run():
        async with sim.SimCluster(3, cfg) as cluster:
            first, second, joiner = cluster.urls
            async with ShardedRollout([first, second], 2, client_class=SGLangRolloutClient,
                                      api_key=KEY) as rollout:
                assert rollout.remove_server(first)  # worker 0 is left without a server
                await rollout.add_server(joiner + "/")
                assert sorted(rollout.urls) == sorted([second, joiner])
                await rollout.add_server(joiner)  # once
                owner = rollout._owner[joiner]
                assert owner.urls == [joiner] and owner is not rollout._owner[second]
                before = cluster.servers[2].ticks()
                gens = await asyncio.gather(*(rollout.generate(PROMPT, {"max_new_tokens": 40}, f"r{i}")
                                              for i in range(16)))
                assert [g.rid for g in gens] == [f"r{i}" for i in range(16)]
                assert cluster.servers[2].ticks() > before  # the joiner decoded some of them

    asyncio.run(run())
