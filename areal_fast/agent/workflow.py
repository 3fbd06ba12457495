"""An agent written with the OpenAI SDK, run as a workflow (:func:`openai_agent`).

::

    rollout:
      workflow: areal_fast.agent.workflow:openai_agent
      workflow_args:
        agent: mypkg.agents:solve        # async def solve(row, client, **agent_args) -> reward
        agent_args: {}                   # keyword arguments of every call of the agent
        transport: inprocess             # or http: the agent gets openai.AsyncOpenAI(base_url=...)
        reward: final                    # or per_turn (areal_fast.agent.trajectories)
        discount: 1.0
        model: areal-fast                # the model name the agent must ask for
        call_marker: null                # the tiny template's tool calls (areal_fast.agent.template)

The controller runs it like any workflow: ``group_size`` episodes per task, each one call. The
agent gets ``client``: the episode's in-process client (``engine.openai()``, which behaves as
``openai.AsyncOpenAI``) or, with ``transport: http``, a real ``openai.AsyncOpenAI`` pointed at this
process's agent endpoint (``areal_fast.agent.server``) with a key of the episode's own (never the
run's key, which the inference servers require). Either way every call is recorded, and the
episode's trajectories are assembled from the calls.

What the agent returns is its episode's reward:

- a number: the final reward;
- a string: its final answer, scored by the configured reward (``reward.name``; ``eval.reward``
  in evaluation), which gives the final reward;
- a pair ``(answer, fields)``: the answer scored against the row's task updated with ``fields``
  (e.g. the answer of a problem the agent made from the row);
- a dict ``{completion_id: reward}``: per-call rewards (``ChatCompletion.id``), no final reward;
- None: only the rewards set with ``client.set_reward`` (in-process client) count.
"""

from __future__ import annotations

import asyncio
import weakref

from areal_fast.agent.server import shared_server
from areal_fast.agent.session import DEFAULT_MODEL
from areal_fast.agent.trajectories import REWARD_MODES, assemble
from areal_fast.sample import Sample
from areal_fast.workflow.api import load_workflow

TRANSPORTS = ("inprocess", "http")
SDK_TIMEOUT_S = 3600.0
_agents: dict[str, object] = {}
_sdk: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_agent(name: str):
    """The agent function ``'package.module:function'`` (async), imported once per process."""
    fn = _agents.get(name)
    if fn is None:
        try:
            fn = _agents[name] = load_workflow(name)
        except ValueError as e:
            raise ValueError(f"rollout.workflow_args.agent: {str(e).replace('workflow', 'agent')}") from None
    return fn


def _check(reward: str, discount: float, transport: str) -> None:
    if reward not in REWARD_MODES:
        raise ValueError(f"rollout.workflow_args.reward: expected one of {REWARD_MODES}, got {reward!r}")
    if isinstance(discount, bool) or not isinstance(discount, int | float) or not 0.0 <= discount <= 1.0:
        raise ValueError(f"rollout.workflow_args.discount: expected a number in [0, 1], got {discount!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.workflow_args.transport: expected one of {TRANSPORTS}, got {transport!r}")


def _sdk_client(openai, server):
    """One ``openai.AsyncOpenAI`` per event loop; each episode gets a copy with its own base_url and
    key (``with_options``), which shares the first one's connection pool. A new client per episode
    costs a new HTTP client and TLS context: 256 of them at once blocked the event loop past the
    SDK's 5 s connect timeout in the tiny agent example. Loopback calls wait as long as a paused
    generation may (the rollout client's own timeout applies behind them)."""
    clients = _sdk.setdefault(asyncio.get_running_loop(), {})
    sdk = clients.get(server.url)
    if sdk is None:
        # no key here: each episode's copy carries its own (AgentServer.open)
        sdk = clients[server.url] = openai.AsyncOpenAI(base_url=server.url, api_key="per-episode", max_retries=0,
                                                       timeout=openai.Timeout(SDK_TIMEOUT_S, connect=60.0))
    return sdk


async def _final_reward(out, row, engine, client) -> float | None:
    if out is None:
        return None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], dict):
        return float((await engine.reward({**row.task, **out[1]}, out[0])).value)
    if isinstance(out, str):
        return float((await engine.reward(row.task, out)).value)
    if isinstance(out, dict):
        for cid, value in out.items():
            client.set_reward(cid, value)
        return None
    if isinstance(out, bool) or not isinstance(out, int | float):
        raise TypeError(f"agent returned {type(out).__name__}: expected a number, a string (the final answer), "
                        "(answer, task fields), a dict {completion_id: reward} or None")
    return float(out)


async def openai_agent(row, engine, agent: str, agent_args: dict | None = None, transport: str = "inprocess",
                       reward: str = "final", discount: float = 1.0, model: str = DEFAULT_MODEL,
                       call_marker: str | None = None) -> list[Sample]:
    """One episode of the agent ``agent`` (see the module docstring)."""
    _check(reward, discount, transport)
    fn = load_agent(agent)
    client = engine.openai(model=model, call_marker=call_marker)
    if transport == "inprocess":
        out = await fn(row, client, **(agent_args or {}))
    else:
        import openai  # the http transport needs the SDK (pip install openai)

        server = await shared_server()
        base_url = server.open(client)  # and the episode's key, client.api_key
        try:
            sdk = _sdk_client(openai, server).with_options(base_url=base_url, api_key=client.api_key)
            out = await fn(row, sdk, **(agent_args or {}))
        finally:
            server.close_episode(base_url)
    final = await _final_reward(out, row, engine, client)
    trajectories = assemble(client.calls, reward=reward, discount=discount, final_reward=final)
    for t in trajectories:
        t.info.update(client.info)
    return trajectories
