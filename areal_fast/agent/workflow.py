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
        tool_parser: hermes              # or qwen3_coder, json (areal_fast.agent.tool_parsers)
        reasoning_parser: null           # or think: <think> into reasoning_content (areal_fast.agent.reasoning)
        continuation: concat             # or template (areal_fast.agent.template)
        context_length: null             # the model's context; null: learned (areal_fast.agent.limits)
        on_agent_error: fail_episode     # or fail_run
        max_failed_fraction: 0.5         # of this process's episodes; more fails the run

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

**An exception in agent code** (a framework raising on a malformed tool call, an ``int()`` of what
the model wrote, an ``openai.BadRequestError`` the agent did not catch) fails that episode, not the
run: it is logged with its traceback and raised as ``EpisodeFailed``, which the controller counts
(``episodes_failed`` in the metrics) and its group trains on the other episodes (AReaL rejects
such a trajectory the same way). Two bounds keep a broken agent from running on silently:
``on_agent_error: fail_run`` restores strictness (the exception stops the run), and
``max_failed_fraction`` fails the run with a clear error once more than that fraction of this
process's episodes of the agent failed (counted from ``MIN_EPISODES_FOR_BOUND`` episodes on, so one
early failure does not end a run). ``check_args`` checks ``workflow_args`` when the config is loaded.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref

from areal_fast.agent.reasoning import reasoning_parser as _reasoning_parser
from areal_fast.agent.server import shared_server
from areal_fast.agent.session import DEFAULT_MODEL
from areal_fast.agent.template import CONTINUATIONS
from areal_fast.agent.tool_parsers import tool_parser as _tool_parser
from areal_fast.agent.trajectories import REWARD_MODES, assemble
from areal_fast.reward.result import escape_controls
from areal_fast.sample import Sample
from areal_fast.workflow.api import EpisodeFailed, load_workflow

log = logging.getLogger(__name__)
TRANSPORTS = ("inprocess", "http")
ON_AGENT_ERROR = ("fail_episode", "fail_run")
MIN_EPISODES_FOR_BOUND = 10
"""``max_failed_fraction`` is checked once this many episodes of the agent ended in the process."""
TRACEBACKS_LOGGED = 5
"""Failed episodes of an agent logged with their whole traceback; later ones in one line each."""
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


def _number_in(key: str, value, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"rollout.workflow_args.{key}: expected a number in [{lo}, {hi}], got {value!r}")


def _check(reward: str, discount: float, transport: str, on_agent_error: str = "fail_episode",
           max_failed_fraction: float = 0.5) -> None:
    if reward not in REWARD_MODES:
        raise ValueError(f"rollout.workflow_args.reward: expected one of {REWARD_MODES}, got {reward!r}")
    _number_in("discount", discount, 0.0, 1.0)
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.workflow_args.transport: expected one of {TRANSPORTS}, got {transport!r}")
    if on_agent_error not in ON_AGENT_ERROR:
        raise ValueError(f"rollout.workflow_args.on_agent_error: expected one of {ON_AGENT_ERROR}, got "
                         f"{on_agent_error!r}")
    _number_in("max_failed_fraction", max_failed_fraction, 0.0, 1.0)


def check_args(args: dict) -> None:
    """``rollout.workflow_args`` of :func:`openai_agent`, checked when the config is loaded
    (``areal_fast.config.check_names``): every key known, every value valid, the agent importable.
    ValueError names the key."""
    params = inspect.signature(openai_agent).parameters
    known = [k for k in params if k not in ("row", "engine")]
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"rollout.workflow_args.{unknown[0]}: not an argument of the agent workflow (known: {known})")
    if "agent" not in args:
        raise ValueError("rollout.workflow_args.agent: required ('package.module:function', the agent function)")
    a = {k: p.default for k, p in params.items() if k in known and p.default is not inspect.Parameter.empty}
    a.update(args)
    check_agent_args = getattr(load_agent(a["agent"]), "check_args", None)  # e.g. process.run_command's
    if check_agent_args is not None and isinstance(a["agent_args"] or {}, dict):
        check_agent_args(a["agent_args"] or {})
    _check(a["reward"], a["discount"], a["transport"], a["on_agent_error"], a["max_failed_fraction"])
    if a["agent_args"] is not None and not isinstance(a["agent_args"], dict):
        raise ValueError(f"rollout.workflow_args.agent_args: expected a mapping, got {a['agent_args']!r}")
    for key in ("model",):
        if not isinstance(a[key], str) or not a[key]:
            raise ValueError(f"rollout.workflow_args.{key}: expected a non-empty string, got {a[key]!r}")
    if a["call_marker"] is not None and (not isinstance(a["call_marker"], str) or not a["call_marker"]):
        raise ValueError(f"rollout.workflow_args.call_marker: expected null or a non-empty string, got "
                         f"{a['call_marker']!r}")
    for key, check in (("tool_parser", _tool_parser), ("reasoning_parser", _reasoning_parser)):
        try:
            check(a[key])
        except ValueError as e:
            raise ValueError(f"rollout.workflow_args.{e}") from None
    if a["continuation"] not in CONTINUATIONS:
        raise ValueError(f"rollout.workflow_args.continuation: expected one of {CONTINUATIONS}, got "
                         f"{a['continuation']!r}")
    ctx = a["context_length"]
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2):
        raise ValueError(f"rollout.workflow_args.context_length: expected null or an integer >= 2, got {ctx!r}")


class _Tally:
    """Episodes of one agent in this process (per event loop): how many ended, how many failed."""

    def __init__(self):
        self.episodes = 0
        self.failed = 0


_tallies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tally(agent: str) -> _Tally:
    """The episode counts of ``agent`` on this event loop."""
    return _tallies.setdefault(asyncio.get_running_loop(), {}).setdefault(agent, _Tally())


def _agent_failed(agent: str, episode_id: str, e: Exception, max_failed_fraction: float) -> EpisodeFailed:
    """Count and log a failed episode; the EpisodeFailed to raise, or RuntimeError past the bound."""
    t = tally(agent)
    t.episodes += 1
    t.failed += 1
    what = escape_controls(f"{type(e).__name__}: {e}")  # agent code's text (a model's output): one log line
    if t.failed <= TRACEBACKS_LOGGED:
        log.warning("agent %s raised in episode %s (a failed episode, %d of %d so far): %s", agent, episode_id,
                    t.failed, t.episodes, what, exc_info=e)
    else:
        log.warning("agent %s raised in episode %s (%d of %d failed so far): %s", agent, episode_id, t.failed,
                    t.episodes, what)
    if t.episodes >= MIN_EPISODES_FOR_BOUND and t.failed > max_failed_fraction * t.episodes:
        return RuntimeError(f"agent {agent}: {t.failed} of {t.episodes} episodes failed, more than "
                            f"rollout.workflow_args.max_failed_fraction={max_failed_fraction}; the last one raised "
                            f"{what} (set on_agent_error: fail_run to stop at the first, with its traceback)")
    return EpisodeFailed(f"agent {agent} raised {what}")


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
                       call_marker: str | None = None, tool_parser: str = "hermes",
                       reasoning_parser: str | None = None, continuation: str = "concat",
                       context_length: int | None = None, on_agent_error: str = "fail_episode",
                       max_failed_fraction: float = 0.5) -> list[Sample]:
    """One episode of the agent ``agent`` (see the module docstring)."""
    _check(reward, discount, transport, on_agent_error, max_failed_fraction)
    fn = load_agent(agent)
    client = engine.openai(model=model, call_marker=call_marker, tool_parser=tool_parser,
                           reasoning_parser=reasoning_parser, continuation=continuation, context_length=context_length)
    server = base_url = None
    agent_client = client
    if transport == "http":
        import openai  # the http transport needs the SDK (pip install openai)

        server = await shared_server()
        base_url = server.open(client)  # and the episode's key, client.api_key
        agent_client = _sdk_client(openai, server).with_options(base_url=base_url, api_key=client.api_key)
    try:
        out = await fn(row, agent_client, **(agent_args or {}))
    except Exception as e:  # agent code: a failed episode (CancelledError is not an Exception: shutdown goes on)
        if on_agent_error == "fail_run":
            raise
        raise _agent_failed(agent, getattr(engine, "episode_id", "?"), e, max_failed_fraction) from e
    finally:
        if server is not None:
            server.close_episode(base_url)
    tally(agent).episodes += 1
    final = await _final_reward(out, row, engine, client)
    if client.session.final_reward is not None:  # set over HTTP, POST <base_url>/reward (agent/server.py)
        if final is not None:
            raise ValueError(f"agent {agent} returned a final reward and also set one over HTTP: give one of them")
        final = client.session.final_reward
    trajectories = assemble(client.calls, reward=reward, discount=discount, final_reward=final)
    for t in trajectories:
        t.info.update(client.info)
    return trajectories


openai_agent.check_args = check_args  # areal_fast.config.check_names checks workflow_args with it
