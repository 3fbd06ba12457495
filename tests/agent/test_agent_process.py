"""An agent that runs as its own process, given only its episode's ``base_url`` and key in its
environment (``areal_fast.agent.process:run_command``): a Python script written with the openai
package makes a tool call, answers, and sets its episode's reward over HTTP (``POST <base_url>/reward``),
which ends the episode (its routes then answer 404, a second reward 409) and is the reward the
trajectories carry. A process that exits without a reward, or fails, is a failed episode."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest
from test_agent_session import EOS, TOK, Scores, ScriptedRollout, ids, run

from areal_fast.agent.client import AgentClient
from areal_fast.data.datasets import PromptRow
from areal_fast.workflow import EpisodeEngine, EpisodeFailed
from areal_fast.workflow.api import load_workflow

AGENT = textwrap.dedent('''
    import json, os, sys, urllib.error, urllib.request
    import openai

    row = json.loads(os.environ["AREAL_FAST_ROW"])
    leaked = [k for k in ("AREAL_FAST_API_KEY", "AREAL_FAST_METRICS_KEY", "OPENAI_ORG_ID") if k in os.environ]
    if leaked:
        sys.exit(f"the run's secrets reached the agent: {leaked}")
    client = openai.OpenAI(max_retries=0)                      # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    messages = [{"role": "user", "content": row["text"]}]
    r = client.chat.completions.create(model="areal-fast", messages=messages, tools=tools)
    call = r.choices[0].message.tool_calls[0]
    expression = json.loads(call.function.arguments)["expression"][::-1]
    messages += [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))}]
    answer = client.chat.completions.create(model="areal-fast", messages=messages).choices[0].message.content
    mode = sys.argv[1]
    if mode == "no_reward":
        sys.exit(0)
    if mode == "crash":
        sys.exit("the agent gave up")

    def post_reward(value):
        req = urllib.request.Request(os.environ["AREAL_FAST_REWARD_URL"], data=json.dumps({"reward": value}).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    assert post_reward(float(answer == row["task"]["answer"])) == 200
    assert post_reward(0.5) == 409                             # set once
    try:                                                       # the episode is over
        client.chat.completions.create(model="areal-fast", messages=messages)
        sys.exit("a call after the reward was answered")
    except openai.NotFoundError:
        pass
''')


def _episode(outputs):
    rollout = ScriptedRollout(outputs)
    eng = EpisodeEngine(rollout, Scores(), TOK, {"max_new_tokens": 12, "temperature": 1.0}, "proc-ep", training=True,
                        chat_client=AgentClient.for_engine)
    return eng, rollout


@pytest.fixture
def script(tmp_path):
    pytest.importorskip("openai")
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return path


def _run(script, mode: str, outputs):
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    eng, rollout = _episode(outputs)
    row = PromptRow(index=0, text="7*34=", task={"answer": "238"})
    out = run(wf(row, eng, agent="areal_fast.agent.process:run_command", transport="http", call_marker="*",
                 agent_args={"command": [sys.executable, str(script), mode], "timeout_s": 60}))
    return out, rollout


def test_process_agent_calls_then_sets_its_reward_over_http_which_ends_the_episode(script, monkeypatch):
    """... and the process sees its episode's key only: the run's keys in this process's environment
    (the servers', the metrics endpoint's) and other OPENAI_ variables are not passed on."""
    for k in ("AREAL_FAST_API_KEY", "AREAL_FAST_METRICS_KEY", "OPENAI_ORG_ID"):
        monkeypatch.setenv(k, "secret-of-the-run")
    (traj,), rollout = _run(script, "ok", [ids("43*7") + [EOS], ids("238") + [EOS]])
    assert traj.reward == 1.0 and traj.turn_rewards == [0.0, 1.0]
    # one trajectory: both model turns trained, the tool's result between them is context
    assert traj.loss_mask.tolist() == [1] * 5 + [0] * 3 + [1] * 4
    assert rollout.prompts[1] == rollout.prompts[0] + ids("43*7") + [EOS] + ids("238")
    assert traj.info["calls"] == 2.0 and traj.info["tool_calls"] == 1.0


@pytest.mark.parametrize("mode,needle", [("no_reward", "exited without setting its reward"),
                                         ("crash", "exited with 1; its standard error ends: the agent gave up")])
def test_process_that_sets_no_reward_or_fails_is_a_failed_episode(script, mode, needle):
    with pytest.raises(EpisodeFailed, match=needle):
        _run(script, mode, [ids("43*7") + [EOS], ids("238") + [EOS]])


def test_process_agent_needs_the_http_transport_and_a_command():
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    row = PromptRow(index=0, text="1=", task={"answer": "1"})
    for args, needle in (({"command": ["true"]}, "transport: http"), ({"command": []}, "command")):
        eng, _ = _episode([])
        with pytest.raises(EpisodeFailed, match=needle):
            run(wf(row, eng, agent="areal_fast.agent.process:run_command", agent_args=args,
                   transport="http" if not args["command"] else "inprocess"))


async def _remote_system(base_url: str, key: str) -> None:
    """Another system: only the base_url and the key, its own openai client and HTTP calls."""
    import aiohttp
    import openai

    sdk = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    r = await sdk.responses.create(model="areal-fast", input="5=")
    await sdk.close()
    async with aiohttp.ClientSession() as http:
        async with http.post(base_url + "/reward", json={"reward": float(r.output_text == "5")},
                             headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200


async def handing_off_agent(row, client):
    """An agent function that hands its episode to a system running elsewhere and waits for its reward."""
    from areal_fast.agent.process import wait_for_reward

    # the SDK's base_url ends with a slash: joined with "/reward" it would be another path
    remote = asyncio.ensure_future(_remote_system(str(client.base_url).rstrip("/"), client.api_key))
    reward = await wait_for_reward(client, timeout_s=30)
    await remote
    assert reward == 1.0


def test_an_agent_elsewhere_gets_base_url_and_key_and_its_http_reward_is_the_episodes():
    pytest.importorskip("openai")
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    eng, _ = _episode([ids("5") + [EOS]])
    (traj,) = run(wf(PromptRow(index=0, text="5=", task={}), eng, agent=f"{__name__}:handing_off_agent",
                     transport="http"))
    assert traj.reward == 1.0 and traj.loss_mask.tolist() == [1, 1]
