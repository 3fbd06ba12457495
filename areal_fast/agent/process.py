"""An agent that runs as its own process, in any language, given only its episode's ``base_url``
and key (:func:`run_command`), and agents that run elsewhere (:func:`wait_for_reward`).

::

    rollout:
      workflow: areal_fast.agent.workflow:openai_agent
      workflow_args:
        transport: http                                  # the process talks HTTP
        agent: areal_fast.agent.process:run_command
        agent_args:
          command: [node, my_agent.js]                   # argv, run once per episode
          timeout_s: 600                                 # then the process is killed: a failed episode

Each episode starts the command with, in its environment (on top of this process's own):

- ``OPENAI_BASE_URL``: the episode's ``base_url`` (``http://127.0.0.1:P/episodes/<token>/v1``), which
  the openai SDKs (Python, JavaScript, ...) read by themselves;
- ``OPENAI_API_KEY``: the episode's own key (never the run's), which the SDKs read too;
- ``AREAL_FAST_REWARD_URL``: ``<base_url>/reward``;
- ``AREAL_FAST_ROW``: the row as JSON, ``{"text": ..., "task": {...}}`` (its task fields hold the
  problem and, for the reward, its answer).

The run's own secrets are not passed on: every ``AREAL_FAST_*KEY`` variable of this process (the
inference servers' key, the metrics endpoint's) is removed from the agent's environment, as are
``OPENAI_*`` variables other than the two above (a real provider's key must not reach it either).

The process makes its calls (chat completions or the Responses API), then ends its episode with
its reward: ``POST $AREAL_FAST_REWARD_URL`` with ``{"reward": <number>}`` and the key as a bearer
token. The episode is trained on when the process exits; a process that exits without setting a
reward, exits non-zero or runs past ``timeout_s`` raises here (the agent workflow makes that a
failed episode). Its standard output is discarded; the tail of its standard error is in the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex

from areal_fast.agent.server import shared_server

STDERR_TAIL = 2000  # characters of the process's standard error kept for the error message


def _argv(command) -> list[str]:
    if isinstance(command, str):
        argv = shlex.split(command)
    elif isinstance(command, list | tuple) and all(isinstance(a, str) for a in command):
        argv = list(command)
    else:
        argv = []
    if not argv:
        raise ValueError(f"rollout.workflow_args.agent_args.command: expected a non-empty argv list or command line, "
                         f"got {command!r}")
    return argv


def _endpoint(client) -> tuple[str, str]:
    base_url, key = getattr(client, "base_url", None), getattr(client, "api_key", None)
    if not base_url or not key:
        raise ValueError("an agent that runs elsewhere needs the episode's base_url: set rollout.workflow_args."
                         "transport: http")
    return str(base_url).rstrip("/"), key


def _inherited(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without the run's secrets (see the module docstring)."""
    return {k: v for k, v in env.items()
            if not (k.startswith("AREAL_FAST_") and k.endswith("KEY")) and not k.startswith("OPENAI_")}


def episode_env(row, base_url: str, key: str) -> dict[str, str]:
    """What an agent process finds in its environment (see the module docstring)."""
    return {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "AREAL_FAST_REWARD_URL": f"{base_url}/reward",
            "AREAL_FAST_ROW": json.dumps({"text": getattr(row, "text", None), "task": dict(getattr(row, "task", {}))})}


async def run_command(row, client, command, timeout_s: float = 600.0, env: dict | None = None) -> None:
    """One episode of an agent process (see the module docstring); ``env``: more variables."""
    argv = _argv(command)
    base_url, key = _endpoint(client)
    server = await shared_server()
    session = server.client_of(base_url).session
    proc = await asyncio.create_subprocess_exec(
        *argv, env={**_inherited(dict(os.environ)), **(env or {}), **episode_env(row, base_url, key)},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"agent process {argv} ran past timeout_s={timeout_s} (killed)") from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    tail = err.decode(errors="replace")[-STDERR_TAIL:] if err else ""
    if proc.returncode != 0:
        raise RuntimeError(f"agent process {argv} exited with {proc.returncode}; its standard error ends: {tail}")
    if session.final_reward is None:
        raise RuntimeError(f"agent process {argv} exited without setting its reward (POST {base_url}/reward "
                           f"with {{\"reward\": <number>}}); its standard error ends: {tail}")
    return None  # the reward set over HTTP is the episode's (agent/workflow.py)


async def wait_for_reward(client, timeout_s: float = 600.0) -> float:
    """For an agent function that hands its episode to a system running elsewhere
    (``str(client.base_url)``, ``client.api_key``): wait until that system sets the reward over HTTP;
    return None from the agent function afterwards. TimeoutError after ``timeout_s``."""
    base_url, _ = _endpoint(client)
    server = await shared_server()
    try:
        return await asyncio.wait_for(server.wait_ended(base_url), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"no reward set at {base_url}/reward within {timeout_s} s") from None
