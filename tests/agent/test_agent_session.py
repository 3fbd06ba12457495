"""The agent chat API's logic with a scripted model (no engine): prompts built from the exact earlier
tokens, an edited history re-tokenized from the first changed message (a break), tool calls in the
tiny template's format, the trajectories and their rewards, and refused requests. The openai SDK
drives the HTTP form here too (``pytest.importorskip``); ``test_agent_engine.py`` runs the embedded
engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_fast.agent.client import AgentClient
from areal_fast.agent.request import ChatRequestError
from areal_fast.agent.server import AgentServer
from areal_fast.agent.trajectories import assemble
from areal_fast.data.tokenizer import CharTokenizer
from areal_fast.sample import Sample
from areal_fast.workflow import EpisodeEngine
from areal_fast.workflow.api import load_workflow

TOK = CharTokenizer("0123456789*+=")
EOS, BOS = TOK.eos_token_id, TOK.bos_token_id
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MODEL = "areal-fast"


class ScriptedRollout:
    """The model writes the next scripted output (token ids), log-prob -0.25 each, at ``version``."""

    def __init__(self, outputs: list[list[int]], key: str | None = None):
        self.outputs, self.version, self.api_key = list(outputs), 3, key
        self.prompts: list[list[int]] = []
        self.sampling: list[dict] = []

    async def generate(self, input_ids, sampling, rid):
        self.prompts.append(list(input_ids))
        self.sampling.append(dict(sampling))
        out = self.outputs.pop(0)
        n = min(len(out), sampling.get("max_new_tokens", 99))
        out = out[:n]
        return Sample(prompt_ids=list(input_ids), output_ids=out, output_logprobs=[-0.25] * n,
                      output_versions=[self.version] * n, finish_reason="stop" if out[-1:] == [EOS] else "length",
                      rid=rid)


class Scores:
    def __init__(self):
        self.seen = []

    async def score(self, task, completion):
        self.seen.append((dict(task), completion))
        return type("R", (), {"value": float(completion == str(task.get("answer"))), "status": "ok"})()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def episode(outputs, *, training=True, key=None, reward=None):
    rollout = ScriptedRollout(outputs, key)
    eng = EpisodeEngine(rollout, reward or Scores(), TOK, {"max_new_tokens": 12, "temperature": 1.0}, "ep1",
                        training=training, chat_client=AgentClient.for_engine)
    return eng, rollout


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_tool_call_parsed_and_next_turn_reuses_the_exact_tokens():
    # the first output holds a <bos> and a <pad> inside: decoding drops them, so a re-encode of the
    # text would differ; the second prompt must carry the very tokens
    first = ids("43") + [BOS, 0] + ids("*7") + [EOS]
    eng, rollout = episode([first, ids("238") + [EOS]])
    client = eng.openai(call_marker="*")

    async def go():
        msgs = [{"role": "user", "content": "7*34="}]
        r1 = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        call = r1.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "43*7"})
        assert r1.choices[0].finish_reason == "tool_calls" and r1.choices[0].message.content is None
        msgs += [r1.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "238"}]
        r2 = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        return r1, r2

    r1, r2 = run(go())
    assert r2.choices[0].message.content == "238" and r2.choices[0].finish_reason == "stop"
    p1 = [BOS] + ids("7*34=")
    assert rollout.prompts == [p1, p1 + first + ids("238")]
    c1, c2 = client.calls
    assert (c1.completion_id, c2.parent, c2.diverged_at) == (r1.id, r1.id, None)
    assert c1.sample.output_versions.tolist() == [3] * len(first)
    assert c2.message_ends == [len(p1), len(p1) + len(first), len(p1) + len(first) + 3]


def test_cut_turn_is_closed_by_the_template_before_the_next_message():
    eng, rollout = episode([ids("12345"), ids("6") + [EOS]])
    client = eng.openai()

    async def go():
        msgs = [{"role": "user", "content": "1="}]
        r1 = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
        assert r1.choices[0].finish_reason == "length" and rollout.sampling[0]["max_new_tokens"] == 3
        msgs += [r1.choices[0].message, {"role": "user", "content": "2="}]
        await client.chat.completions.create(model=MODEL, messages=msgs)

    run(go())
    assert rollout.prompts[1] == [BOS] + ids("1=") + ids("123") + [EOS] + [BOS] + ids("2=")


def test_edited_history_is_retokenized_from_the_first_changed_message_and_breaks_the_trajectory():
    eng, rollout = episode([ids("11") + [EOS], ids("22") + [EOS], ids("33") + [EOS]])
    client = eng.openai()

    async def go():
        m = [{"role": "user", "content": "5="}]
        r1 = await client.chat.completions.create(model=MODEL, messages=m)
        m2 = m + [r1.choices[0].message, {"role": "user", "content": "6="}]
        await client.chat.completions.create(model=MODEL, messages=m2)
        # the agent rewrites the model's first answer ("11" -> "19"), then asks again
        edited = m + [{"role": "assistant", "content": "19"}, {"role": "user", "content": "6="}]
        await client.chat.completions.create(model=MODEL, messages=edited)

    run(go())
    c1, c2, c3 = client.calls
    assert c3.parent is None and c3.diverged_at == 1
    head = [BOS] + ids("5=")
    assert rollout.prompts[2] == head + ids("19") + [EOS] + [BOS] + ids("6=")  # the user message's tokens kept
    trajs = assemble(client.calls, reward="final", final_reward=1.0)
    assert len(trajs) == 2 and all(t.info["history_breaks"] == 1.0 for t in trajs)
    t1, t2 = trajs
    assert t1.loss_mask.tolist() == [1] * 3 + [0] * 3 + [1] * 3 and t1.reward == 0.0  # abandoned branch
    assert t2.prompt_ids.tolist() == rollout.prompts[2] and t2.reward == 1.0


def test_trajectories_final_and_per_turn_rewards_with_discount():
    eng, _ = episode([ids("1") + [EOS], ids("2") + [EOS], ids("3") + [EOS]])
    client = eng.openai()

    async def go():
        m = [{"role": "user", "content": "0="}]
        for k in range(3):
            r = await client.chat.completions.create(model=MODEL, messages=m)
            m = m + [r.choices[0].message, {"role": "user", "content": f"{k}="}]
        return r

    last = run(go())
    client.set_reward(client.calls[0].completion_id, 0.5)
    (t,) = assemble(client.calls, reward="final", discount=0.5, final_reward=1.0)
    assert t.reward == pytest.approx(0.5 + 0.25 * 1.0)
    assert t.n_turns == 3 and t.turn_rewards == [0.5, 0.0, 1.0]
    assert [v for v, m in zip(t.output_versions, t.loss_mask) if not m] == [-1] * (len(t.loss_mask) - 6)
    per = assemble(client.calls, reward="per_turn", discount=0.5, final_reward=1.0)
    assert [p.reward for p in per] == pytest.approx([0.75, 0.5, 1.0])
    assert [p.rid for p in per][-1] == last.id and all(p.loss_mask.tolist() == [1, 1] for p in per)
    with pytest.raises(KeyError, match="chatcmpl-nope"):
        client.set_reward("chatcmpl-nope", 1.0)


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4o"}, "model"),
    ({"n": 2}, "n"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"extra_thing": 1}, "extra_thing"),
    ({"messages": [{"role": "robot", "content": "1"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages[0].content"),
    ({"temperature": 0.3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_refused_requests_name_the_parameter(body, param):
    eng, rollout = episode([ids("1") + [EOS]])
    client = eng.openai()
    with pytest.raises(ChatRequestError) as e:
        run(client.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "1="}],
                                               **body}))
    assert e.value.param == param and e.value.status_code == 400
    assert client.calls == []


def test_stop_string_cuts_the_output_and_single_token_stops_go_to_the_engine():
    eng, rollout = episode([ids("12+45") + [EOS], ids("77") + [EOS]])
    client = eng.openai()

    async def go():
        r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1="}],
                                                 stop=["2+"])
        assert r.choices[0].message.content == "1" and r.choices[0].finish_reason == "stop"
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2="}], stop="+")

    run(go())
    assert client.calls[0].sample.output_ids.tolist() == ids("12+")  # the tokens after the stop dropped
    assert rollout.sampling[1]["stop_token_ids"] == ids("+")


async def _agent(row, client):
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row.text}],
                                             tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    return json.loads(call.function.arguments)["expression"][::-1], {"answer": "7*34"}


@pytest.mark.parametrize("transport", ["inprocess", "http"])
def test_openai_agent_workflow_records_and_scores_over_both_transports(transport):
    if transport == "http":
        pytest.importorskip("openai")
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    scores = Scores()
    eng, rollout = episode([ids("43*7") + [EOS]], key="run-key", reward=scores)
    row = type("Row", (), {"text": "7*34=", "task": {"answer": "x"}})()
    trajs = run(wf(row, eng, agent=f"{__name__}:_agent", transport=transport, call_marker="*"))
    (t,) = trajs
    assert t.reward == 1.0 and scores.seen == [({"answer": "7*34"}, "7*34")]
    assert t.prompt_ids.tolist() == [BOS] + ids("7*34=") and t.loss_mask.tolist() == [1] * 5
    assert t.info == {"calls": 1.0, "tool_calls": 1.0, "history_breaks": 0.0}


def test_http_form_needs_the_key_and_answers_bad_input_with_400():
    openai = pytest.importorskip("openai")
    eng, rollout = episode([ids("9") + [EOS]])
    client = eng.openai()

    async def go():
        async with AgentServer() as server:
            assert server.url.startswith("http://127.0.0.1:")
            base = server.open(client)
            msgs = [{"role": "user", "content": "1="}]
            for key in ("wrong", ""):
                bad = openai.AsyncOpenAI(base_url=base, api_key=key or "x", max_retries=0,
                                         default_headers={} if key else {"Authorization": ""})
                with pytest.raises(openai.AuthenticationError):
                    await bad.chat.completions.create(model=MODEL, messages=msgs)
                await bad.close()
            sdk = openai.AsyncOpenAI(base_url=base, api_key=client.api_key, max_retries=0)
            for extra, what in (({"model": "gpt-4o"}, "not served"), ({"n": 2}, "n=1"),
                                ({"stream": True, "top_logprobs": 5}, "top_logprobs")):
                with pytest.raises(openai.BadRequestError, match=what):
                    await sdk.chat.completions.create(**{"model": MODEL, "messages": msgs, **extra})
            r = await sdk.chat.completions.create(model=MODEL, messages=msgs)
            assert r.choices[0].message.content == "9" and (await sdk.models.list()).data[0].id == MODEL
            server.close_episode(base)
            with pytest.raises(openai.NotFoundError):
                await sdk.chat.completions.create(model=MODEL, messages=msgs)
            await sdk.close()

    run(go())
    assert len(client.calls) == 1


_handed: list = []


async def _key_agent(row, client):
    _handed.append(client.api_key)
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row.text}])
    return float(r.choices[0].message.content == "7")


def test_http_agent_gets_a_key_of_its_episode_never_the_run_key():
    pytest.importorskip("openai")
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    row = type("Row", (), {"text": "3+4=", "task": {}})()
    _handed.clear()
    for _ in range(2):
        eng, _ = episode([ids("7") + [EOS]], key="run-key")
        (t,) = run(wf(row, eng, agent=f"{__name__}:_key_agent", transport="http"))
        assert t.reward == 1.0
    assert len(_handed) == 2 and "run-key" not in _handed and _handed[0] != _handed[1]
    assert all(len(k) == 64 for k in _handed)  # secrets.token_hex(32)


def test_an_episode_key_opens_only_its_own_episode():
    aiohttp = pytest.importorskip("aiohttp")
    a, b = episode([])[0].openai(), episode([])[0].openai()

    async def go():
        async with AgentServer() as server, aiohttp.ClientSession() as http:
            base_a, base_b = server.open(a), server.open(b)

            async def status(base, key):
                async with http.get(base + "/models", headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status

            got = {"a": await status(base_a, a.api_key), "b": await status(base_b, b.api_key),
                   "a on b": await status(base_b, a.api_key), "b on a": await status(base_a, b.api_key)}
            server.close_episode(base_a)
            got["a after its end"] = await status(base_a, a.api_key)
            got["a on b after its end"] = await status(base_b, a.api_key)
            return got

    assert run(go()) == {"a": 200, "b": 200, "a on b": 401, "b on a": 401, "a after its end": 404,
                         "a on b after its end": 401}
    assert a.api_key != b.api_key


def test_agent_endpoint_closes_idle_connections_and_serves_a_key_holder_at_the_cap():
    """The listeners' guard (``areal_fast.http.conn_guard``, shown on the engine in
    ``tests/rollout/test_conn_guard.py``) on the agent endpoint: connections without a request are
    closed after the head timeout, and at the cap of unauthenticated ones (counted beyond one per open
    episode: ``test_agent_burst.py``) the oldest gives way."""
    aiohttp = pytest.importorskip("aiohttp")
    from areal_fast.http.conn_guard import ConnLimits

    cap, within_s = 4, 15.0
    client = episode([])[0].openai()

    async def closed(reader, wait_s):
        try:
            while await asyncio.wait_for(reader.read(65536), wait_s):
                pass
            return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    async def go():
        limits = ConnLimits(head_timeout_s=3.0, keepalive_s=60, max_unauthenticated=cap)
        async with AgentServer(conn_limits=limits) as server, aiohttp.ClientSession() as http:
            base = server.open(client)
            idle = [await asyncio.open_connection(server.host, server.port) for _ in range(cap + 1 + 20)]
            evicted = [await closed(r, within_s) for r, _ in idle[:20]]
            async with http.get(base + "/models", headers={"Authorization": f"Bearer {client.api_key}"}) as r:
                served = r.status
            timed_out = [await closed(r, within_s) for r, _ in idle[20:]]
            for _, w in idle:
                w.close()
            return evicted, served, timed_out

    evicted, served, timed_out = run(go())
    assert all(evicted) and served == 200 and all(timed_out)


# ------------------------------------------------------------------ stop strings: the cut in O(n log n)
def _reference_cut(decode, ids, stops):
    """The first prefix whose text holds a stop (what ``_cut_at_stop`` computed by decoding every prefix)."""
    if not any(s in decode(ids) for s in stops):
        return None
    return next(k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k]) for s in stops))


def _sample(out_ids):
    n = len(out_ids)
    return Sample(prompt_ids=[BOS], output_ids=out_ids, output_logprobs=[-0.5] * n, output_versions=[3] * n)


def test_stop_cut_is_the_first_prefix_that_holds_a_stop():
    import random
    from types import SimpleNamespace

    from areal_fast.agent.session import _cut_at_stop

    rng = random.Random(7)
    template = SimpleNamespace(tok=TOK)
    for _ in range(300):
        text = "".join(rng.choice("12+=*") for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice("12+=*") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3)))
        out = ids(text)
        want = _reference_cut(TOK.decode, out, stops)
        s = _sample(out)
        assert _cut_at_stop(template, s, stops) is (want is not None), (text, stops)
        k = len(out) if want is None else want
        assert s.output_ids.tolist() == out[:k], (text, stops)
        assert len(s.output_logprobs) == len(s.output_versions) == len(s.loss_mask) == k


def test_stop_cut_decodes_n_log_n_tokens_not_every_prefix():
    from types import SimpleNamespace

    from areal_fast.agent.session import _cut_at_stop

    n = 4000
    budget = 40 * n  # decoding every prefix is ~n*n/2 = 8,000,000 tokens here

    class Counting(CharTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            assert Counting.decoded <= budget, "the stop cut decodes far more than O(n log n) tokens"
            return super().decode(ids, skip_special_tokens)

    tok = Counting(TOK.chars)
    out = ids("1" * n + "2+" + "3" * 50)
    s = _sample(out)
    assert _cut_at_stop(SimpleNamespace(tok=tok), s, ("2+",))
    assert s.output_ids.tolist() == out[: n + 2]


def test_a_reward_that_races_the_end_of_its_episode_is_a_404_not_a_500():
    """The episode ends (``close_episode``) while a reward's body is on its way: a 404, as for any
    request to an episode that is over."""
    aiohttp = pytest.importorskip("aiohttp")
    from _shared import wait_until

    client = episode([])[0].openai()

    async def go():
        async with AgentServer() as server, aiohttp.ClientSession() as http:
            base = server.open(client)
            entered, release = asyncio.Event(), asyncio.Event()
            read_body = server._json

            async def held(request):  # the body arrives only once the episode has ended
                entered.set()
                await release.wait()
                return await read_body(request)

            server._json = held
            post = asyncio.ensure_future(http.post(base + "/reward", json={"reward": 1.0},
                                                   headers={"Authorization": f"Bearer {client.api_key}"}))
            await wait_until(entered.is_set, "the reward request to reach its handler")
            server.close_episode(base)
            release.set()
            async with await post as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 404 and body["error"]["code"] == "episode_not_found"
    assert client.session.final_reward is None


def test_numbers_and_bodies_python_cannot_print_or_decode_are_400s():
    """A body nested past the JSON decoder's limit, a reward of 400 digits (too large for a float),
    and in the in-process client an integer Python will not print (over 4,300 digits) as a role:
    each a 400 naming the culprit, not an exception of the server (a 500)."""
    aiohttp = pytest.importorskip("aiohttp")
    client = episode([])[0].openai()
    headers = {"Authorization": "", "Content-Type": "application/json"}

    async def go():
        got = {}
        async with AgentServer() as server, aiohttp.ClientSession() as http:
            base = server.open(client)
            headers["Authorization"] = f"Bearer {client.api_key}"
            for name, path, body in (("deep", "/chat/completions", "[" * 5000 + "]" * 5000),
                                     ("digits", "/chat/completions", f'{{"model": "{MODEL}", "messages": '
                                      f'[{{"role": {"7" * 5000}, "content": "x"}}]}}'),
                                     ("responses digits", "/responses", f'{{"model": "{MODEL}", "input": '
                                      f'[{{"role": {"7" * 5000}, "content": "x"}}]}}'),
                                     ("reward", "/reward", f'{{"reward": {"9" * 400}}}')):
                async with http.post(base + path, data=body, headers=headers) as r:
                    got[name] = (r.status, (await r.json())["error"])
        for kind in ("chat", "responses"):
            try:
                if kind == "chat":
                    await client.chat.completions.create(model=MODEL, messages=[{"role": 10**5000, "content": "x"}])
                else:
                    await client.responses.create(model=MODEL, input=[{"role": 10**5000, "content": "x"}])
            except ChatRequestError as e:
                got[kind] = (e.status_code, {"param": e.param, "message": str(e)})
        return got

    got = run(go())
    assert got["deep"][0] == 400 and "not JSON" in got["deep"][1]["message"]
    for name in ("digits", "responses digits"):  # Python's JSON decoder refuses integers of > 4,300 digits
        assert got[name][0] == 400 and "not JSON" in got[name][1]["message"]
    assert got["reward"][0] == 400 and got["reward"][1]["param"] == "reward"
    assert len(got["reward"][1]["message"]) < 400  # the value is shown cut, not whole
    assert got["chat"] == (400, {"param": "messages[0]", "message": got["chat"][1]["message"]})
    assert got["responses"][0] == 400 and got["responses"][1]["param"] == "input[0]"
    assert "<int of 16610 bits>" in got["chat"][1]["message"] + got["responses"][1]["message"]
