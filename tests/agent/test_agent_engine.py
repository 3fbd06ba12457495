"""The openai SDK as the client of the agent endpoint, against the embedded engine over HTTP through the
real rollout client: a tool call and a second turn that continues the exact tokens, a generation
interrupted by a weight update and resumed (each token with the version that made it, equal to
greedy generation under the weights live for it), bad input (400) and the key (401)."""

from __future__ import annotations

import asyncio
import json

import pytest
from _shared import disk_update, tiny_checkpoints, until_running
from tolerances import ENGINE_LOGPROB_ATOL

from areal_fast.agent.client import AgentClient
from areal_fast.agent.server import AgentServer
from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.data.tiny_models import hf_greedy, hf_logprobs, load_hf
from areal_fast.data.tokenizer import CharTokenizer
from areal_fast.embedded import start_engine_in_thread
from areal_fast.rollout.port import ClientRollout
from areal_fast.workflow import EpisodeEngine

TOK = CharTokenizer("0123456789*+=")
KEY = "engine-and-agent-key"
MODEL = "areal-fast"
N = 120  # tokens of the interrupted turn: the update is asked for after 15


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("openai")
    paths, sds = tiny_checkpoints(tmp_path_factory, {1: 301}, vocab_size=16, eos_token_id=TOK.eos_token_id)
    base, v1, sd1 = paths[0], paths[1], sds[1]
    engine = start_engine_in_thread(base, api_key=KEY)
    yield engine, base, v1, sd1
    engine.stop()


async def _with_sdk(engine, sampling, body, marker=None):
    """``body(sdk, client, rollout)`` with an openai.AsyncOpenAI on the agent endpoint of one episode."""
    import openai

    async with SGLangRolloutClient([engine.url], api_key=KEY) as rc:
        rollout = ClientRollout(rc)
        eng = EpisodeEngine(rollout, None, TOK, sampling, "agent-ep", training=False,
                            chat_client=AgentClient.for_engine)
        client = eng.openai(call_marker=marker)
        async with AgentServer() as server:
            sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
            try:
                return await body(sdk, client, rollout)
            finally:
                await sdk.close()


def test_tool_call_then_second_turn_on_the_exact_tokens(setup):
    engine, base, _, _ = setup
    prompt = [{"role": "user", "content": "7*34="}]
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    first = hf_greedy(load_hf(base), [TOK.bos_token_id] + TOK.encode("7*34=", add_bos=False), 6)
    marker = TOK.decode(first)[0]  # the tool format's marker: a character this model writes first
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]

    async def body(sdk, client, rollout):
        r1 = await sdk.chat.completions.create(model=MODEL, messages=prompt, tools=tools)
        call = r1.choices[0].message.tool_calls[0]
        assert call.function.name == "calc" and r1.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments) == {"expression": TOK.decode(first)}
        msgs = prompt + [r1.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "238"}]
        r2 = await sdk.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        assert r2.usage.completion_tokens == 4 and r2.choices[0].finish_reason == "length"
        return client.calls

    c1, c2 = asyncio.run(asyncio.wait_for(_with_sdk(engine, sampling, body, marker), 120))
    assert c1.sample.output_ids.tolist() == first
    assert c2.parent == c1.completion_id
    assert c2.sample.prompt_ids.tolist() == (c1.sample.prompt_ids.tolist() + first + [TOK.eos_token_id]
                                             + TOK.encode("238", add_bos=False))
    ref = hf_logprobs(load_hf(base), c2.sample.prompt_ids.tolist(), c2.sample.output_ids.tolist(), 0.0)
    assert max(abs(a - b) for a, b in zip(c2.sample.output_logprobs, ref)) < ENGINE_LOGPROB_ATOL


def test_generation_interrupted_by_a_weight_update_resumes_with_versions(setup):
    engine, base, v1, sd1 = setup
    sampling = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}

    async def body(sdk, client, rollout):
        task = asyncio.create_task(sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "12+3="}]))
        await until_running(engine, 15)
        await rollout.pause()
        await asyncio.to_thread(disk_update, [engine.url], v1, "1", KEY)
        await rollout.resume()
        r = await task
        await rollout.pause()
        await asyncio.to_thread(disk_update, [engine.url], base, "0", KEY)
        await rollout.resume()
        return r, client.calls[0]

    r, call = asyncio.run(asyncio.wait_for(_with_sdk(engine, sampling, body), 180))
    s = call.sample
    v = s.output_versions.tolist()
    k = v.index(1)
    assert r.usage.completion_tokens == N and 0 < k < N and v == [0] * k + [1] * (N - k)
    prompt, out = s.prompt_ids.tolist(), s.output_ids.tolist()
    m0, m1 = load_hf(base), load_hf(base, sd1)
    assert out[:k] == hf_greedy(m0, prompt, k) and out[k:] == hf_greedy(m1, prompt + out[:k], N - k)
    assert r.choices[0].message.content == TOK.decode(out)


def test_bad_input_is_a_400_and_the_key_is_required(setup):
    engine, _, _, _ = setup
    import openai

    async def body(sdk, client, rollout):
        msgs = [{"role": "user", "content": "1="}]
        for extra, what in (({"model": "gpt-4o-mini"}, "is not served here"), ({"n": 3}, "only n=1"),
                            ({"stream": True, "logprobs": True, "top_logprobs": 2}, "top_logprobs: not supported")):
            with pytest.raises(openai.BadRequestError, match=what):
                await sdk.chat.completions.create(**{"model": MODEL, "messages": msgs, **extra})
        for key in ("not-the-key", KEY):  # the run's key is not an episode's key
            wrong = openai.AsyncOpenAI(base_url=str(sdk.base_url), api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model=MODEL, messages=msgs)
            await wrong.close()
        return client.calls

    assert asyncio.run(asyncio.wait_for(_with_sdk(engine, {"max_new_tokens": 2, "temperature": 0.0}, body), 60)) == []


def test_the_engine_refuses_the_key_handed_to_agent_code(setup):
    """Agent code gets its episode's key, never the run's: with it, every engine route (generate,
    load other weights, pause, resume, abort, flush) answers 401."""
    import aiohttp

    engine, base, _, _ = setup

    async def go():
        async with SGLangRolloutClient([engine.url], api_key=KEY) as rc:
            eng = EpisodeEngine(ClientRollout(rc), None, TOK, {"max_new_tokens": 2}, "agent-ep", training=False,
                                chat_client=AgentClient.for_engine)
            client = eng.openai()
            async with AgentServer() as server, aiohttp.ClientSession() as http:
                server.open(client)
                statuses = {}
                for path, body in (("/update_weights_from_disk", {"model_path": base}),
                                   ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
                                   ("/pause_generation", {}), ("/continue_generation", {}),
                                   ("/abort_request", {"abort_all": True}), ("/flush_cache", {})):
                    async with http.post(engine.url + path, json=body,
                                         headers={"Authorization": f"Bearer {client.api_key}"}) as r:
                        statuses[path] = r.status
                return client.api_key, statuses

    handed, statuses = asyncio.run(asyncio.wait_for(go(), 60))
    assert handed and handed != KEY and set(statuses.values()) == {401}, statuses
