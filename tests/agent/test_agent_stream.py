"""``stream=True`` and ``logprobs=True`` on the agent chat API, with a scripted model: the openai SDK
parses our event stream over HTTP into the same answer as the plain call, the log-probs returned are
the recorded ones, the in-process client streams too, and what we cannot answer is a 400 naming the
field (before any stream starts)."""

from __future__ import annotations

import json
import sys

import pytest
from test_agent_session import EOS, MODEL, TOK, TOOLS, Scores, ScriptedRollout, ids, run

from areal_fast.agent.client import AgentClient
from areal_fast.agent.request import ChatRequestError
from areal_fast.agent.server import AgentServer
from areal_fast.sample import Sample
from areal_fast.workflow import EpisodeEngine

USER = [{"role": "user", "content": "7*34="}]


class DistinctLogprobs(ScriptedRollout):
    """The scripted model, each output token with its own log-prob (-1/8, -2/8, ...: exact in float32)."""

    async def generate(self, input_ids, sampling, rid):
        s = await super().generate(input_ids, sampling, rid)
        n = len(s.output_ids)
        return Sample(prompt_ids=list(s.prompt_ids), output_ids=list(s.output_ids),
                      output_logprobs=[-(k + 1) / 8 for k in range(n)], output_versions=list(s.output_versions),
                      finish_reason=s.finish_reason, rid=rid)


def client_for(outputs, **kw):
    eng = EpisodeEngine(DistinctLogprobs(outputs), Scores(), TOK, {"max_new_tokens": 12, "temperature": 1.0},
                        "ep1", training=True, chat_client=AgentClient.for_engine)
    return eng.openai(**kw)


def _logprob_rows(choice) -> list[tuple[str, float, list, list]]:
    return [(e.token, e.logprob, e.bytes, e.top_logprobs) for e in choice.logprobs.content]


def test_logprobs_are_the_recorded_ones_and_the_tokens_spell_the_content():
    client = client_for([ids("238") + [EOS]])
    r = run(client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=0))
    (call,) = client.calls
    rows = _logprob_rows(r.choices[0])
    assert [lp for _, lp, _, _ in rows] == list(call.sample.output_logprobs) == [-0.125, -0.25, -0.375, -0.5]
    assert "".join(t for t, _, _, _ in rows) == r.choices[0].message.content == "238"
    assert all(b == list(t.encode()) and top == [] for t, _, b, top in rows)
    plain = run(client_for([ids("238") + [EOS]]).chat.completions.create(model=MODEL, messages=USER))
    assert plain.choices[0].logprobs is None  # only when asked


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 1.5}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"chunk_size": 3}}, "stream_options.chunk_size"),
    ({"stream": True, "n": 2}, "n"),
])
def test_stream_and_logprobs_options_are_checked_naming_the_field(extra, param):
    client = client_for([ids("1") + [EOS]])
    with pytest.raises(ChatRequestError) as e:
        run(client.chat.completions.create(model=MODEL, messages=USER, **extra))
    assert e.value.param == param and param.split(".")[-1] in str(e.value)
    assert client.calls == []


def _accumulate(chunks) -> dict:
    """The answer a streaming consumer rebuilds from the chunks (as the SDK's stream helpers do)."""
    out = {"content": "", "tool_calls": {}, "finish": None, "usage": None, "roles": [], "logprobs": []}
    for c in chunks:
        assert c.object == "chat.completion.chunk"
        if not c.choices:
            out["usage"] = c.usage
            continue
        (ch,) = c.choices
        d = ch.delta
        out["roles"] += [d.role] if d.role else []
        out["content"] += d.content or ""
        for tc in d.tool_calls or ():
            acc = out["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = tc.id or acc["id"]
            acc["name"] += (tc.function.name or "") if tc.function else ""
            acc["arguments"] += (tc.function.arguments or "") if tc.function else ""
        if ch.logprobs is not None:
            out["logprobs"] += [e.logprob for e in ch.logprobs.content]
        if ch.finish_reason:
            assert out["finish"] is None and d.content is None and not d.tool_calls
            out["finish"] = ch.finish_reason
    return out


def _same_answer(acc: dict, plain, call) -> None:
    """``acc`` (the streamed answer of the recorded ``call``) says what ``plain`` (the same output unstreamed) says."""
    msg = plain.choices[0].message
    assert acc["roles"] == ["assistant"] and acc["finish"] == plain.choices[0].finish_reason
    assert acc["content"] == (msg.content or "")
    calls = [t for _, t in sorted(acc["tool_calls"].items())]
    assert [(t["name"], t["arguments"]) for t in calls] == [(c.function.name, c.function.arguments)
                                                            for c in msg.tool_calls or ()]
    assert [t["id"] for t in calls] == [c.id for c in call.tool_calls]  # each completion's own call ids


@pytest.mark.parametrize("output, tools", [("238", None), ("43*7", TOOLS)])
def test_sdk_parses_the_http_stream_into_the_plain_answer(output, tools):
    openai = pytest.importorskip("openai")
    client = client_for([ids(output) + [EOS]] * 4, call_marker="*")
    extra = {"tools": tools} if tools else {}

    async def go():
        async with AgentServer() as server:
            sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
            plain = await sdk.chat.completions.create(model=MODEL, messages=USER, **extra)
            stream = await sdk.chat.completions.create(model=MODEL, messages=USER, stream=True, logprobs=True,
                                                       **extra)
            chunks = [c async for c in stream]
            usage = [c async for c in await sdk.chat.completions.create(
                model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}, **extra)]
            helper = None
            if hasattr(sdk.chat.completions, "stream"):  # the SDK's own accumulation of a stream (openai >= 1.40)
                async with sdk.chat.completions.stream(model=MODEL, messages=USER, **extra) as events:
                    helper = await events.get_final_completion()
            await sdk.close()
            return plain, chunks, usage, helper

    plain, chunks, usage, helper = run(go())
    if helper is not None:
        got, want = helper.choices[0], plain.choices[0]
        assert (got.finish_reason, got.message.content or "") == (want.finish_reason, want.message.content or "")
        assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or ()] == [
            (c.function.name, c.function.arguments) for c in want.message.tool_calls or ()]
    assert all(type(c).__name__ == "ChatCompletionChunk" for c in chunks)
    acc = _accumulate(chunks)
    _same_answer(acc, plain, client.calls[1])
    assert acc["usage"] is None and acc["logprobs"] == list(client.calls[1].sample.output_logprobs)
    assert len({(c.id, c.created) for c in chunks}) == 1 and chunks[0].id == client.calls[1].completion_id
    acc = _accumulate(usage)
    _same_answer(acc, plain, client.calls[2])
    assert usage[-1].choices == [] and acc["usage"] == plain.usage
    assert all(c.usage is None for c in usage[:-1]) and acc["logprobs"] == []
    if tools:
        (tc,) = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
        assert tc.index == 0 and tc.type == "function"


def test_http_stream_is_server_sent_events_ending_with_done_and_bad_input_stays_a_400():
    aiohttp = pytest.importorskip("aiohttp")
    client = client_for([ids("9") + [EOS]])

    async def go():
        async with AgentServer() as server, aiohttp.ClientSession() as http:
            url = server.open(client) + "/chat/completions"
            auth = {"Authorization": f"Bearer {client.api_key}"}
            body = {"model": MODEL, "messages": USER, "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(url, json=body, headers=auth) as r:
                ok = (r.status, r.headers["Content-Type"], await r.text())
            async with http.post(url, json={**body, "logprobs": True, "top_logprobs": 3}, headers=auth) as r:
                bad = (r.status, r.headers["Content-Type"], await r.json())
            return ok, bad

    (status, ctype, text), bad = run(go())
    assert status == 200 and ctype.startswith("text/event-stream")
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert bad[0] == 400 and bad[1].startswith("application/json") and bad[2]["error"]["param"] == "top_logprobs"
    assert len(client.calls) == 1


@pytest.mark.parametrize("flavour", ["sdk_types", "no_openai"])
def test_inprocess_client_streams_chunks_like_the_sdk_async_stream(flavour, monkeypatch):
    if flavour == "sdk_types":
        pytest.importorskip("openai")
    else:
        for name in ("openai", "openai.types", "openai.types.chat"):  # any import of them raises ImportError
            monkeypatch.setitem(sys.modules, name, None)
    client = client_for([ids("43*7") + [EOS], ids("43*7") + [EOS]], call_marker="*")

    async def go():
        plain = await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        stream = await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True,
                                                      stream_options={"include_usage": True}, logprobs=True)
        async with stream:
            chunks = [c async for c in stream]
        return plain, chunks

    plain, chunks = run(go())
    assert {type(c).__name__ for c in chunks} == {"ChatCompletionChunk" if flavour == "sdk_types" else "Record"}
    acc = _accumulate(chunks)
    _same_answer(acc, plain, client.calls[1])
    assert acc["finish"] == "tool_calls" and acc["usage"].total_tokens == plain.usage.total_tokens
    assert acc["logprobs"] == list(client.calls[1].sample.output_logprobs)
