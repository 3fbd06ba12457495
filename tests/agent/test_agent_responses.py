"""The Responses API (``client.responses.create``) on the agent engine, with a scripted model and the
openai SDK: a tool call as a ``function_call`` item, its ``function_call_output`` continuing the exact
tokens, the same recording (tokens, log-probs, versions, loss mask) as ``chat.completions`` records
for the same conversation, ``previous_response_id``, the buffered event stream, the in-process client
answering as HTTP does, and the requests we refuse (400 naming the Responses parameter)."""

from __future__ import annotations

import json

import pytest
from test_agent_session import EOS, MODEL, TOK, TOOLS, Scores, ScriptedRollout, ids, run

from areal_fast.agent.client import AgentClient
from areal_fast.agent.request import ChatRequestError
from areal_fast.agent.server import AgentServer
from areal_fast.agent.trajectories import assemble
from areal_fast.workflow import EpisodeEngine

R_TOOLS = [{"type": "function", "name": "calculator", "description": "",
            "parameters": TOOLS[0]["function"]["parameters"]}]
OUTPUTS = [ids("43*7") + [EOS], ids("238") + [EOS]]  # a call, then the answer after the tool's result


def client_for(outputs=OUTPUTS):
    rollout = ScriptedRollout(list(outputs))
    eng = EpisodeEngine(rollout, Scores(), TOK, {"max_new_tokens": 12, "temperature": 1.0}, "ep1", training=True,
                        chat_client=AgentClient.for_engine)
    return eng.openai(call_marker="*"), rollout


async def _over_http(client, body):
    import openai

    async with AgentServer() as server:
        sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
        try:
            return await body(sdk)
        finally:
            await sdk.close()


async def _responses_episode(sdk, *, chained: bool):
    r1 = await sdk.responses.create(model=MODEL, input="7*34=", tools=R_TOOLS)
    (call,) = r1.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "238"}
    if chained:
        r2 = await sdk.responses.create(model=MODEL, previous_response_id=r1.id, input=[result], tools=R_TOOLS)
    else:  # the items sent back as the SDK returned them, as openai-agents does
        r2 = await sdk.responses.create(model=MODEL, input=[{"role": "user", "content": "7*34="}, *r1.output, result],
                                        tools=R_TOOLS)
    return r1, r2


def _recording(client) -> list[tuple]:
    trajectories = assemble(client.calls)
    return [(c.sample.prompt_ids.tolist(), c.sample.output_ids.tolist(), c.sample.output_logprobs.tolist(),
             c.sample.output_versions.tolist(), c.parent is not None) for c in client.calls] + [
        (t.prompt_ids.tolist(), t.output_ids.tolist(), t.output_logprobs.tolist(), t.output_versions.tolist(),
         t.loss_mask.tolist()) for t in trajectories]


@pytest.mark.parametrize("chained", [False, True], ids=["items_sent_back", "previous_response_id"])
def test_function_call_round_trip_records_exactly_what_chat_completions_records(chained):
    pytest.importorskip("openai")
    resp_client, resp_rollout = client_for()
    r1, r2 = run(_over_http(resp_client, lambda sdk: _responses_episode(sdk, chained=chained)))
    call = r1.output[0]
    assert (type(r1).__name__, r1.status, call.type, call.name) == ("Response", "completed", "function_call",
                                                                    "calculator")
    assert json.loads(call.arguments) == {"expression": "43*7"}
    assert call.call_id == resp_client.calls[0].tool_calls[0].id
    assert r2.output_text == "238" and r2.output[0].type == "message" and r2.status == "completed"
    assert r2.usage.output_tokens == 4 and r2.usage.input_tokens == len(resp_client.calls[1].sample.prompt_ids)
    # the second turn continues the first token for token: the call's tokens, then the tool's result
    assert resp_rollout.prompts[1] == resp_rollout.prompts[0] + OUTPUTS[0] + ids("238")

    chat_client, chat_rollout = client_for()

    async def chat(sdk):
        msgs = [{"role": "user", "content": "7*34="}]
        c1 = await sdk.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        tc = c1.choices[0].message.tool_calls[0]
        msgs += [c1.choices[0].message, {"role": "tool", "tool_call_id": tc.id, "content": "238"}]
        await sdk.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)

    run(_over_http(chat_client, chat))
    assert chat_rollout.prompts == resp_rollout.prompts
    assert _recording(resp_client) == _recording(chat_client)
    assert [t.loss_mask.tolist() for t in assemble(resp_client.calls)] == [
        [1] * len(OUTPUTS[0]) + [0] * 3 + [1] * len(OUTPUTS[1])]


def test_inprocess_responses_answer_as_http_does_and_set_reward_takes_the_response_id():
    pytest.importorskip("openai")
    http_client, _ = client_for()
    over_http = run(_over_http(http_client, lambda sdk: _responses_episode(sdk, chained=False)))
    inproc_client, _ = client_for()
    import openai

    async def go():
        r1 = await inproc_client.responses.create(model=MODEL, input="7*34=", tools=R_TOOLS,
                                                  temperature=openai.NOT_GIVEN, extra_headers={"X-Trace": "1"},
                                                  extra_body={"store": False})
        call = r1.output[0]
        r2 = await inproc_client.responses.create(model=MODEL, previous_response_id=r1.id, tools=R_TOOLS,
                                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "238"}])
        return r1, r2

    in_process = run(go())
    for a, b in zip(over_http, in_process, strict=True):
        assert type(b).__name__ == "Response"
        assert a.model_dump(exclude={"created_at", "previous_response_id"}) == b.model_dump(
            exclude={"created_at", "previous_response_id"})
    inproc_client.set_reward(in_process[1].id, 0.5)
    assert inproc_client.calls[1].reward == 0.5


def test_stream_events_carry_the_same_response_and_logprobs_are_the_recorded_ones():
    pytest.importorskip("openai")
    client, _ = client_for([ids("238") + [EOS], ids("238") + [EOS]])

    async def go(sdk):
        plain = await sdk.responses.create(model=MODEL, input="5=", include=["message.output_text.logprobs"])
        events = [e async for e in await sdk.responses.create(model=MODEL, input="5=", stream=True)]
        return plain, events

    plain, events = run(_over_http(client, go))
    lp = plain.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in lp] == [("2", -0.25), ("3", -0.25), ("8", -0.25), ("", -0.25)]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "238"
    final = events[-1].response
    assert final.output_text == plain.output_text
    assert final.id == "resp_" + client.calls[1].completion_id.removeprefix("chatcmpl-")


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, "text.format"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["no.such.thing"]}, "include[0]"),
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"input": [{"role": "user", "content": "1="}, {"role": "wizard", "content": "x"}]}, "input[1]"),
    ({"model": "gpt-x"}, "model"),
])
def test_refused_requests_are_400s_naming_the_responses_parameter(extra, param):
    openai = pytest.importorskip("openai")
    client, rollout = client_for()

    async def go(sdk):
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.responses.create(**{"model": MODEL, "input": "1=", **extra})
        with pytest.raises(ChatRequestError) as f:
            await client.responses.create(**{"model": MODEL, "input": "1=", **extra})
        return e.value, f.value

    http, inproc = run(_over_http(client, go))
    assert http.body["param"] == param and inproc.param == param
    assert rollout.prompts == []  # nothing generated
