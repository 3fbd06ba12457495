"""An agent that runs as its own process, given only its episode's ``base_url`` and key in its
environment (``areal_fast.agent.process:run_command``): a Python script written with the openai
package makes a tool call, answers, and sets its episode's reward over HTTP (``POST <base_url>/reward``),
which ends the episode (its routes then answer 404, a second reward 409) and is the reward the
trajectories carry. A process that exits without a reward, or fails, is a failed episode."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
from _shared import poll_until
from test_agent_session import EOS, TOK, Scores, ScriptedRollout, ids, run

from areal_fast.agent import process
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


# ---------------------------------------------------------------------------------- the process itself
# Agents without chat calls: a plain Python script (no openai import, fast to start) or a shell script.
PLAIN_AGENT = textwrap.dedent('''
    import json, os, subprocess, sys, urllib.request

    mode, out = sys.argv[1], sys.argv[2]
    if mode == "env":
        with open(out, "w") as f:
            json.dump(dict(os.environ), f)
    if mode == "helper":  # a helper that inherits (and so holds open) our standard error, and would outlive us
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(out, "w") as f:
            f.write(str(child.pid))
    if mode == "noise":  # a lot of standard error, then an end that tries to forge a log line
        chunk = b"x" * (1 << 20)
        for _ in range(int(sys.argv[3])):
            sys.stderr.buffer.write(chunk)
        sys.stderr.write("\\x1b[2J\\x1b[31mred\\r\\nINFO areal_fast.controller: step 999 done\\u2028the end")
        sys.exit(3)
    req = urllib.request.Request(os.environ["AREAL_FAST_REWARD_URL"], data=b'{"reward": 1.0}',
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    urllib.request.urlopen(req).close()
''')
CALL_LIMIT_S = 20.0
"""A deadline for a whole agent call whose process is killed at timeout_s=3 or exits at once: one
that waits on what the process left behind (a helper sleeping 120 s) runs past it."""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _plain_run(argv, timeout_s=30.0, **agent_args):
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    eng, _ = _episode([])
    row = PromptRow(index=0, text="1=", task={"answer": "1"})
    coro = wf(row, eng, agent="areal_fast.agent.process:run_command", transport="http",
              agent_args={"command": argv, "timeout_s": timeout_s, **agent_args})
    return asyncio.run(asyncio.wait_for(coro, CALL_LIMIT_S))


@pytest.fixture
def plain(tmp_path):
    pytest.importorskip("openai")  # the http transport's SDK client
    path = tmp_path / "plain_agent.py"
    path.write_text(PLAIN_AGENT)
    return path


def test_agent_process_gets_an_allow_list_of_this_process_environment(plain, tmp_path, monkeypatch):
    """Only PATH, HOME, the locale, ... and the names the config adds (pass_env) reach the process:
    not the metric services' credentials, not another provider's key, not the run's keys."""
    secrets = ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "ANTHROPIC_API_KEY",
               "AREAL_FAST_API_KEY", "AREAL_FAST_METRICS_KEY", "OPENAI_ORG_ID", "HF_TOKEN")
    for k in secrets:
        monkeypatch.setenv(k, "secret-of-the-run")
    monkeypatch.setenv("LC_TIME", "C")
    monkeypatch.setenv("MY_AGENT_SETTING", "asked for")
    monkeypatch.setenv("MY_TOOL_A", "a")
    out = tmp_path / "env.json"
    _plain_run([sys.executable, str(plain), "env", str(out)], pass_env=["MY_AGENT_SETTING", "MY_TOOL_*"],
               env={"GIVEN": "value"})
    seen = json.loads(out.read_text())
    assert not set(secrets) & set(seen)
    assert seen["MY_AGENT_SETTING"] == "asked for" and seen["MY_TOOL_A"] == "a" and seen["LC_TIME"] == "C"
    assert seen["GIVEN"] == "value" and seen["PATH"] == os.environ["PATH"]
    episode_vars = {"OPENAI_BASE_URL", "OPENAI_API_KEY", "AREAL_FAST_REWARD_URL", "AREAL_FAST_ROW"}
    rest = set(seen) - episode_vars - {"GIVEN", "MY_AGENT_SETTING", "MY_TOOL_A"}
    # the allow-list; an interpreter may add LC_CTYPE itself at start (the C library's locale coercion)
    assert {k for k in rest if k not in process.PASSED_ENV and not k.startswith("LC_")} == set()


def test_pass_env_cannot_name_the_runs_keys_and_agent_args_are_checked_at_load():
    from areal_fast.agent.workflow import check_args

    base = {"agent": "areal_fast.agent.process:run_command", "transport": "http"}
    for agent_args, needle in (({"command": ["a"], "pass_env": ["AREAL_FAST_API_KEY"]}, "pass_env.*run's own keys"),
                               ({"command": ["a"], "pass_env": ["AREAL_FAST_*"]}, "pass_env.*run's own keys"),
                               ({"command": ["a"], "pass_env": "PATH"}, "pass_env: expected a list"),
                               ({"command": ["a"], "pass_env": ["A B"]}, "pass_env: 'A B' is not a variable"),
                               ({"command": ["a"], "timeout_s": 0}, "timeout_s: expected a positive"),
                               ({"command": ["a"], "env": {"A": 1}}, "env: expected a mapping"),
                               ({"command": ["a"], "timout_s": 5}, "timout_s: not an argument"),
                               ({"command": []}, "command")):
        with pytest.raises(ValueError, match=f"rollout.workflow_args.agent_args.{needle}"):
            check_args({**base, "agent_args": agent_args})
    check_args({**base, "agent_args": {"command": "node a.js", "timeout_s": 5, "pass_env": ["NODE_PATH"]}})


def test_helpers_of_an_agent_that_exits_are_killed_and_do_not_hold_the_episode(plain, tmp_path):
    """A helper that keeps the agent's standard error open neither holds a successful episode until
    timeout_s nor outlives it (it would keep running with the episode's key and row)."""
    out = tmp_path / "helper.pid"
    _plain_run([sys.executable, str(plain), "helper", str(out)], timeout_s=CALL_LIMIT_S / 2)  # succeeds
    pid = int(out.read_text())
    poll_until(lambda: not _alive(pid), "the agent's helper to be killed", limit_s=5.0)


def test_agent_past_timeout_is_killed_with_its_children_and_the_call_returns(tmp_path):
    """timeout_s=3: the call fails then (not when the children that hold its standard error end),
    and neither the agent nor what it started survives."""
    pytest.importorskip("openai")
    out = tmp_path / "pids"
    script = f'sleep 120 & echo "$! $$" > {out}; echo started >&2; exec sleep 120'
    with pytest.raises(EpisodeFailed, match=r"ran past timeout_s=3 \(killed with its process group\).*started"):
        _plain_run(["sh", "-c", script], timeout_s=3)  # room for a loaded machine to start the shell and its child
    assert out.exists(), "the agent did not start its child within timeout_s=3"
    for pid in map(int, out.read_text().split()):
        poll_until(lambda pid=pid: not _alive(pid), f"process {pid} of the agent to be killed", limit_s=5.0)


def test_agent_dies_with_the_process_that_started_it_even_by_sigkill(tmp_path):
    """The controller killed with SIGKILL runs no cleanup: the agent (in its own process group, so
    a signal to the controller's group misses it) is killed by the kernel with it, not left
    running with the episode's key."""
    pytest.importorskip("openai")
    out = tmp_path / "agent.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]
        from test_agent_process import _plain_run
        _plain_run(["sh", "-c", "echo $$ > {out}.tmp && mv {out}.tmp {out} && exec sleep 120"], timeout_s=60)
        """)])
    try:
        poll_until(out.exists, "the agent to start", limit_s=CALL_LIMIT_S)
        pid = int(out.read_text())
        assert _alive(pid)
        parent.kill()
        parent.wait()
        poll_until(lambda: not _alive(pid), f"agent {pid} to die with the controller", limit_s=5.0)
    finally:
        parent.kill()
        parent.wait()


def test_standard_error_keeps_a_bounded_escaped_tail(plain, caplog):
    """24 MiB of standard error cost the controller a tail, not the whole (the peak of this process's
    allocations stays far below it), and the tail reaches the error and the log with its terminal
    escapes and line breaks escaped: no forged log line, no cleared screen."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(EpisodeFailed) as info:
            _plain_run([sys.executable, str(plain), "noise", "-", "24"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.0f} MiB while the agent wrote 24 MiB of standard error"
    message = str(info.value)
    assert "exited with 3" in message
    assert message.endswith("xxx\\x1b[2J\\x1b[31mred\\r\\nINFO areal_fast.controller: step 999 done\\u2028the end")
    tail = message.split("its standard error ends: ", 1)[1]
    assert len(tail) < process.STDERR_TAIL + 50
    logged = [r.getMessage() for r in caplog.records if "exited with 3" in r.getMessage()]
    assert logged and not any(c in m for m in logged for c in "\x1b\r\n\u2028")
