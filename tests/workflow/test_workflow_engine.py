"""A multi-turn episode against the embedded engine over HTTP through the real rollout client: a
weight update in the middle of a turn and another between turns. The trajectory equals greedy
generation with the weights that were live for each token (nothing lost or repeated at either
seam), versions change exactly at the seams, and the behaviour log-probs are the engine's."""

from __future__ import annotations

import asyncio
from array import array

import pytest
from _shared import disk_update, tiny_checkpoints, until_running
from tolerances import ENGINE_LOGPROB_ATOL

from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.data.tiny_models import hf_greedy, hf_logprobs, load_hf
from areal_fast.embedded import start_engine_in_thread
from areal_fast.rollout.port import ClientRollout
from areal_fast.workflow import EpisodeEngine, Trajectory

FEEDBACK = [5, 6, 7]
N = 120  # tokens per turn: the pause lands mid-turn (the update is requested after 15 tokens)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    paths, sds = tiny_checkpoints(tmp_path_factory, {v: 300 + v for v in (1, 2)})
    engine = start_engine_in_thread(paths[0])
    yield engine, paths, sds
    engine.stop()


class NoReward:
    async def score(self, task, completion):
        raise AssertionError("not used")


def test_weight_updates_within_and_between_turns_resume_the_episode_exactly(setup):
    engine, paths, sds = setup
    prompt = [11, 12, 13, 14]

    async def run():
        between = asyncio.Event()
        go_on = asyncio.Event()

        async def episode(eng):
            traj = Trajectory(prompt_ids=prompt)
            traj.add_model(await eng.generate(traj.context_ids))
            between.set()
            await go_on.wait()  # the test updates the weights here, between the turns
            traj.add_context(FEEDBACK)
            traj.add_model(await eng.generate(traj.context_ids))
            return traj

        async with SGLangRolloutClient([engine.url]) as client:
            rollout = ClientRollout(client)
            eng = EpisodeEngine(rollout, NoReward(), None, {"max_new_tokens": N, "temperature": 0.0,
                                                            "ignore_eos": True}, "wf", training=False)
            task = asyncio.create_task(episode(eng))
            await until_running(engine, 15)  # within turn 1
            await rollout.pause()
            await asyncio.to_thread(disk_update, [engine.url], paths[1], "1")
            await rollout.resume()
            await between.wait()
            await rollout.pause()
            await asyncio.to_thread(disk_update, [engine.url], paths[2], "2")
            await rollout.resume()
            go_on.set()
            traj = await task
            await rollout.pause()
            await asyncio.to_thread(disk_update, [engine.url], paths[0], "0")
            await rollout.resume()
            return traj

    traj = asyncio.run(asyncio.wait_for(run(), 120))
    assert {type(traj.output_ids), type(traj.output_versions), type(traj.output_logprobs)} == {array}
    v = traj.output_versions.tolist()
    assert len(traj.output_ids) == 2 * N + len(FEEDBACK)
    assert traj.loss_mask.tolist() == [1] * N + [0] * len(FEEDBACK) + [1] * N
    k = v.index(1)
    assert 0 < k < N and v == [0] * k + [1] * (N - k) + [-1] * len(FEEDBACK) + [2] * N
    m0, m1, m2 = load_hf(paths[0]), load_hf(paths[0], sds[1]), load_hf(paths[0], sds[2])
    out = traj.output_ids.tolist()
    turn2_ctx = prompt + out[: N + len(FEEDBACK)]
    assert out[:k] == hf_greedy(m0, prompt, k)
    assert out[k:N] == hf_greedy(m1, prompt + out[:k], N - k)
    assert out[N: N + len(FEEDBACK)] == FEEDBACK
    assert out[N + len(FEEDBACK):] == hf_greedy(m2, turn2_ctx, N)
    ref = (hf_logprobs(m0, prompt, out[:k], 0.0) + hf_logprobs(m1, prompt + out[:k], out[k:N], 0.0)
           + [0.0] * len(FEEDBACK) + hf_logprobs(m2, turn2_ctx, out[N + len(FEEDBACK):], 0.0))
    assert max(abs(a - b) for a, b in zip(traj.output_logprobs, ref)) < ENGINE_LOGPROB_ATOL
