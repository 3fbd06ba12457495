"""What goes wrong in an agent's episode reaches it the way the OpenAI API says: what the inference
server refuses (a prompt past the context, ``max_tokens`` past it, a stop string on a checkpoint
without a tokenizer) is a 400 naming the parameter, over HTTP through the openai SDK and in process,
against the embedded engine; an exception in agent code is a failed episode (counted, logged with
its traceback, bounded); the in-process client takes the SDK's own keywords as ``AsyncOpenAI`` does;
the tiny template refuses a call it could not attribute to one tool."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from pathlib import Path

import pytest
from _shared import tiny_model, wait_until
from test_agent_session import EOS, MODEL, TOK, TOOLS, Scores, ScriptedRollout, episode, ids, run

from areal_fast.agent.client import AgentClient
from areal_fast.agent.request import ChatRequestError
from areal_fast.agent.server import AgentServer
from areal_fast.workflow import EpisodeEngine, EpisodeFailed
from areal_fast.workflow.api import load_workflow

CONTEXT = 32  # the tiny checkpoint's max_position_embeddings: the engine's context
KEY = "errors-engine-key"


# ------------------------------------------------------------------ the engine's refusals are 400s
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("openai")
    from areal_fast.embedded import start_engine_in_thread

    path = tiny_model(tmp_path_factory, vocab_size=16, eos_token_id=TOK.eos_token_id, max_position_embeddings=CONTEXT)
    eng = start_engine_in_thread(path, api_key=KEY)  # no tokenizer in the checkpoint: no stop strings there
    yield eng, path
    eng.stop()


async def _both(engine_url, sampling, body):
    """``body(sdk, client)``: an openai.AsyncOpenAI on one episode's endpoint and its in-process client."""
    import openai

    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.rollout.port import ClientRollout

    async with SGLangRolloutClient([engine_url], api_key=KEY) as rc:
        eng = EpisodeEngine(ClientRollout(rc), None, TOK, sampling, "errors-ep", training=False,
                            chat_client=AgentClient.for_engine)
        client = eng.openai()
        async with AgentServer() as server:
            sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
            try:
                return await body(sdk, client)
            finally:
                await sdk.close()


def test_engine_refusals_are_400s_naming_the_parameter_over_http_and_in_process(engine):
    import openai

    eng, _ = engine
    long = [{"role": "user", "content": "1" * (CONTEXT + 3)}]  # the prompt alone is past the context
    short = [{"role": "user", "content": "12+3="}]  # 6 tokens with <bos>

    async def body(sdk, client):
        for kw, param in (({"messages": long}, "messages"), ({"messages": short, "max_tokens": CONTEXT}, "max_tokens")):
            with pytest.raises(openai.BadRequestError) as e:
                await sdk.chat.completions.create(model=MODEL, **kw)
            assert e.value.param == param and "context" in e.value.message
            with pytest.raises(ChatRequestError) as e2:
                await client.chat.completions.create(model=MODEL, **kw)
            assert e2.value.param == param and e2.value.status_code == 400
        # no max_tokens: the run's max_new_tokens (64) is cut to what is left of the context
        r = await sdk.chat.completions.create(model=MODEL, messages=short)
        return r, list(client.calls)

    r, calls = asyncio.run(asyncio.wait_for(_both(eng.url, {"max_new_tokens": 64, "temperature": 0.0,
                                                            "ignore_eos": True}, body), 120))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == CONTEXT - 6
    assert len(calls) == 1  # the refused ones were never recorded


def test_a_stop_string_works_on_a_checkpoint_without_a_tokenizer(engine):
    from areal_fast.data.tiny_models import hf_greedy, load_hf

    eng, path = engine
    prompt = [TOK.bos_token_id] + ids("7*34=")
    greedy = TOK.decode(hf_greedy(load_hf(path), prompt, 12))
    stop = greedy[3:5]  # two characters the model writes: two tokens, which the engine cannot match as text

    async def body(sdk, client):
        r = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "7*34="}], stop=stop)
        return r, client.calls[0]

    r, call = asyncio.run(asyncio.wait_for(_both(eng.url, {"max_new_tokens": 12, "temperature": 0.0,
                                                           "ignore_eos": True}, body), 120))
    cut = greedy.index(stop)
    assert r.choices[0].message.content == greedy[:cut] and r.choices[0].finish_reason == "stop"
    assert TOK.decode(call.sample.output_ids) == greedy[:cut + len(stop)]  # tokens up to the stop's last kept


class Refusing(ScriptedRollout):
    """A server that answers every request with a 4xx of its own."""

    async def generate(self, input_ids, sampling, rid):
        from areal_fast.rollout.calls import RequestError

        raise RequestError("http://server/generate", 400, {"error": {"message": "input_ids [99] outside the "
                                                                                 "vocabulary [0, 16)"}})


def test_any_other_engine_4xx_is_a_400_over_http():
    openai = pytest.importorskip("openai")
    eng = EpisodeEngine(Refusing([]), Scores(), TOK, {"max_new_tokens": 4, "temperature": 1.0}, "ep", training=True,
                        chat_client=AgentClient.for_engine)
    client = eng.openai()

    async def go():
        async with AgentServer() as server:
            sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1="}])
            await sdk.close()
            return e.value

    err = run(go())
    assert err.param == "messages" and "outside the vocabulary" in err.message


# ------------------------------------------------------------------ agent exceptions: failed episodes
async def _malformed(row, client):
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row.text}])
    return float(int(r.choices[0].message.content))  # the model wrote "4*": int() raises, as framework code does


ROW = type("Row", (), {"text": "2+2=", "task": {"answer": "4"}})()


def _episode(agent: str, k: int = 0, **args):
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    eng, _ = episode([ids("4*") + [EOS]])
    eng.episode_id = f"ep{k}"
    return wf(ROW, eng, agent=f"{__name__}:{agent}", **args)


@pytest.mark.parametrize("transport", ["inprocess", "http"])
def test_an_exception_in_agent_code_is_a_failed_episode_logged_with_its_traceback(transport, caplog):
    if transport == "http":
        pytest.importorskip("openai")
    caplog.set_level(logging.WARNING, logger="areal_fast.agent.workflow")
    with pytest.raises(EpisodeFailed, match="ValueError"):
        run(_episode("_malformed", transport=transport))
    (rec,) = [r for r in caplog.records if "raised in episode ep0" in r.getMessage()]
    assert rec.exc_info and "int(r.choices[0].message.content)" in caplog.text  # the agent's line, in the traceback
    with pytest.raises(ValueError, match="invalid literal"):  # the strict option: the run stops with it
        run(_episode("_malformed", transport=transport, on_agent_error="fail_run"))


async def _quoting(row, client):
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row.text}])
    raise ValueError(f"bad answer {r.choices[0].message.content}\n\x1b[2JINFO areal_fast.controller: step 9 done")


def test_an_agent_exception_quoting_model_text_is_one_log_line(caplog):
    """An exception's message (which may quote what the model wrote) is logged with its control
    characters escaped: no forged log line, no terminal escape."""
    caplog.set_level(logging.WARNING, logger="areal_fast.agent.workflow")
    with pytest.raises(EpisodeFailed) as info:
        run(_episode("_quoting", k=1))
    (rec,) = [r for r in caplog.records if "raised in episode ep1" in r.getMessage()]
    assert "bad answer 4*\\n\\x1b[2JINFO" in rec.getMessage() and "\n" not in rec.getMessage()
    assert "\x1b" not in str(info.value)


def test_more_failed_episodes_than_the_bound_fail_the_run():
    from areal_fast.agent.workflow import MIN_EPISODES_FOR_BOUND, tally

    assert MIN_EPISODES_FOR_BOUND == 10
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    fails = [True] * 3 + [False] * 6 + [True] * 3  # 3 of 3 early on; 6 of 12 at the end: at the bound

    async def one(fail: bool):
        eng, _ = episode([ids("4*" if fail else "4") + [EOS]])
        return await wf(ROW, eng, agent=f"{__name__}:_malformed", max_failed_fraction=0.5)

    async def go():
        outcomes = []
        for fail in fails:
            try:
                await one(fail)
                outcomes.append("ok")
            except EpisodeFailed:
                outcomes.append("failed")
        t = tally(f"{__name__}:_malformed")
        counts = (t.episodes, t.failed)
        with pytest.raises(RuntimeError, match=r"7 of 13 episodes failed.*max_failed_fraction=0.5"):
            await one(True)
        return outcomes, counts

    outcomes, counts = run(go())
    assert outcomes == ["failed" if f else "ok" for f in fails] and counts == (12, 6)


def test_agent_workflow_args_are_checked_when_the_config_is_loaded():
    from areal_fast.config import ConfigError, check_names, load_config

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_openai_agent.yaml"
    check_names(load_config(example, ["rollout.workflow_args.on_agent_error=fail_run",
                                      "rollout.workflow_args.max_failed_fraction=0.2"]))
    for override, needle in (("on_agent_error=ignore", "on_agent_error"), ("max_failed_fraction=1.5", "max_failed"),
                             ("tool_parser=xml", "tool_parser"), ("continuation=redo", "continuation"),
                             ("reasoning_parser=r1", "reasoning_parser"), ("context_length=0", "context_length"),
                             ("retries=3", "rollout.workflow_args.retries")):
        with pytest.raises(ConfigError, match=needle):
            check_names(load_config(example, [f"rollout.workflow_args.{override}"]))


# ------------------------------------------------------------------ the SDK's own keywords in process
def _sdk_defaults() -> dict:
    """Every keyword of the real ``AsyncCompletions.create`` at its default (NOT_GIVEN, omit, None)."""
    openai = pytest.importorskip("openai")
    from openai.resources.chat.completions import AsyncCompletions

    params = inspect.signature(AsyncCompletions.create).parameters
    out = {k: p.default for k, p in params.items() if k != "self" and p.default is not inspect.Parameter.empty}
    assert {"extra_headers", "extra_query", "extra_body", "timeout"} <= set(out)
    kinds = {type(v) for v in out.values()}
    assert openai.NotGiven in kinds and openai.Omit in kinds
    return out


def test_in_process_client_takes_the_sdk_keywords_as_async_openai_does():
    import openai

    defaults = _sdk_defaults()
    eng, rollout = episode([ids("12345") + [EOS]] * 3)
    client = eng.openai()
    user = [{"role": "user", "content": "1="}]

    async def go():
        r = await client.chat.completions.create(**{**defaults, "model": MODEL, "messages": user})
        assert r.choices[0].message.content == "12345"
        r = await client.chat.completions.create(model=MODEL, messages=user, max_tokens=openai.NOT_GIVEN,
                                                 extra_body={"max_tokens": 2}, extra_headers={"X-Trace": "1"},
                                                 extra_query={"q": "1"}, timeout=30.0)
        assert r.usage.completion_tokens == 2 and rollout.sampling[1]["max_new_tokens"] == 2
        with pytest.raises(ChatRequestError) as e:  # extra_body's keys are request parameters: checked as such
            await client.chat.completions.create(model=MODEL, messages=user, extra_body={"top_k": 5})
        assert e.value.param == "top_k"

    run(go())


class Slow(ScriptedRollout):
    async def generate(self, input_ids, sampling, rid):
        await asyncio.sleep(0.3)
        return await super().generate(input_ids, sampling, rid)


def test_in_process_timeout_raises_the_sdk_timeout_error_and_the_turn_is_still_recorded():
    openai = pytest.importorskip("openai")
    eng = EpisodeEngine(Slow([ids("1") + [EOS]]), Scores(), TOK, {"max_new_tokens": 4, "temperature": 1.0}, "ep",
                        training=True, chat_client=AgentClient.for_engine)
    client = eng.openai()

    async def go():
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1="}],
                                                 timeout=0.05)
        # as over HTTP, where the server finishes the turn of a client that left
        await wait_until(lambda: len(client.calls) >= 1, "the turn of the client that timed out to be recorded", 30)
        return len(client.calls)

    assert run(go()) == 1


# ------------------------------------------------------------------ the tiny template and several tools
TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}}}}]


def test_tiny_template_refuses_a_call_among_several_tools_and_takes_a_named_one():
    openai = pytest.importorskip("openai")
    eng, rollout = episode([ids("43*7") + [EOS]])
    client = eng.openai(call_marker="*")
    user = [{"role": "user", "content": "7*34="}]

    async def go():
        with pytest.raises(ChatRequestError) as e:
            await client.chat.completions.create(model=MODEL, messages=user, tools=TWO_TOOLS)
        assert e.value.param == "tools" and "tool_choice" in str(e.value)
        async with AgentServer() as server:
            sdk = openai.AsyncOpenAI(base_url=server.open(client), api_key=client.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError) as e2:
                await sdk.chat.completions.create(model=MODEL, messages=user, tools=TWO_TOOLS)
            assert e2.value.param == "tools"
            r = await sdk.chat.completions.create(model=MODEL, messages=user, tools=TWO_TOOLS, tool_choice={
                "type": "function", "function": {"name": "calculator"}})
            await sdk.close()
            return r

    r = run(go())
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "43*7"}
    assert len(rollout.prompts) == 1  # the refused requests generated nothing


def test_agents_doc_does_not_call_streaming_and_logprobs_unsupported():
    text = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    unsupported = text.split("## Not supported", 1)[1].split("\n## ", 1)[0].lower()
    assert "stream" not in unsupported and "returned log-probs" not in unsupported
    assert "**`stream=true`**" in text.lower() and "**`logprobs=true`**" in text.lower()  # documented, above
