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
          env: {}                                        # more variables, with their values
          pass_env: []                                   # more names of this process's variables to pass on

Each episode starts the command with, in its environment:

- ``OPENAI_BASE_URL``: the episode's ``base_url`` (``http://127.0.0.1:P/episodes/<token>/v1``), which
  the openai SDKs (Python, JavaScript, ...) read by themselves;
- ``OPENAI_API_KEY``: the episode's own key (never the run's), which the SDKs read too;
- ``AREAL_FAST_REWARD_URL``: ``<base_url>/reward``;
- ``AREAL_FAST_ROW``: the row as JSON, ``{"text": ..., "task": {...}}`` (its task fields hold the
  problem and, for the reward, its answer);
- of this process's own variables only those :data:`PASSED_ENV` names (the program search path,
  the home and temporary folders, the user, the locale and time zone) and those ``pass_env``
  names (a trailing ``*`` takes every name with that prefix);
- ``env``: variables given with their values in the config.

Everything else of this process's environment stays here: an allow-list, so that the run's keys
(``AREAL_FAST_*KEY``), the metric services' credentials (``WANDB_API_KEY``,
``MLFLOW_TRACKING_TOKEN``, ...) and any provider's key reach an agent only when the config names
them. ``pass_env`` may not name the run's own keys (``AREAL_FAST_*KEY``): those never reach agent code.

The process makes its calls (chat completions or the Responses API), then ends its episode with
its reward: ``POST $AREAL_FAST_REWARD_URL`` with ``{"reward": <number>}`` and the key as a bearer
token. The episode is trained on when the process exits; a process that exits without setting a
reward, exits non-zero or runs past ``timeout_s`` raises here (the agent workflow makes that a
failed episode).

The process is started in a session of its own, so it and everything it starts form one process
group: when it exits, or runs past ``timeout_s``, the whole group is killed (SIGKILL), so no helper
it left behind keeps running with the episode's key and row, and a helper that holds its standard
error open does not hold the episode. A descendant that leaves the group (a new session: a daemon)
escapes this; run agents in a container or a cgroup of their own to contain those too. Its standard
output is discarded; of its standard error only the last :data:`STDERR_TAIL` characters are kept
(read as it is written, so a process that writes gigabytes costs this process a few kilobytes), with
control characters and line breaks escaped (``areal_fast.reward.result.escape_controls``), and go
into the error: what a process writes cannot colour the controller's terminal or forge lines of its log.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex

from areal_fast.agent.server import shared_server
from areal_fast.configutil import finite_number
from areal_fast.procutil import die_with_parent, kill_group
from areal_fast.reward.result import escape_controls

STDERR_TAIL = 2000
"""Characters of the process's standard error kept (its end) for the error message."""
_TAIL_BYTES = 4 * STDERR_TAIL  # UTF-8 writes a character in at most 4 bytes
_READ_CHUNK = 64 << 10
DRAIN_S = 1.0
"""After the process group is killed: how long its standard error may take to reach its end (only a
descendant that left the group can hold it open longer; its tail is then what came so far)."""
PASSED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR")
"""This process's variables an agent process gets without asking (a trailing ``*``: a prefix)."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")


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


def _is_run_key(name: str) -> bool:
    return name.startswith("AREAL_FAST_") and name.endswith("KEY")


def _pass_env(names) -> tuple[str, ...]:
    if names is None:
        return ()
    if isinstance(names, str) or not isinstance(names, list | tuple):
        raise ValueError(f"rollout.workflow_args.agent_args.pass_env: expected a list of variable names, got "
                         f"{names!r}")
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"rollout.workflow_args.agent_args.pass_env: {name!r} is not a variable name (letters, "
                             "digits and _, optionally ending with * for a prefix)")
        if _is_run_key(name.rstrip("*")) or name == "AREAL_FAST_*":
            raise ValueError(f"rollout.workflow_args.agent_args.pass_env: {name!r} names the run's own keys "
                             "(AREAL_FAST_*KEY), which never reach agent code")
    return tuple(names)


def _timeout(timeout_s) -> float:
    if not finite_number(timeout_s) or timeout_s <= 0:
        raise ValueError(f"rollout.workflow_args.agent_args.timeout_s: expected a positive number of seconds, got "
                         f"{timeout_s!r}")
    return float(timeout_s)


def _env_values(env) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"rollout.workflow_args.agent_args.env: expected a mapping of names to strings, got {env!r}")
    return dict(env)


def check_args(args: dict) -> None:
    """``agent_args`` of :func:`run_command`, checked when the config is loaded (ValueError naming
    the key): ``command``, ``timeout_s``, ``env``, ``pass_env``."""
    known = ("command", "timeout_s", "env", "pass_env")
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"rollout.workflow_args.agent_args.{unknown[0]}: not an argument of run_command "
                         f"(known: {list(known)})")
    _argv(args.get("command"))
    _timeout(args.get("timeout_s", 600.0))
    _env_values(args.get("env"))
    _pass_env(args.get("pass_env"))


def _endpoint(client) -> tuple[str, str]:
    base_url, key = getattr(client, "base_url", None), getattr(client, "api_key", None)
    if not base_url or not key:
        raise ValueError("an agent that runs elsewhere needs the episode's base_url: set rollout.workflow_args."
                         "transport: http")
    return str(base_url).rstrip("/"), key


def passed_env(env: dict[str, str], pass_env: tuple[str, ...] = ()) -> dict[str, str]:
    """The variables of ``env`` (this process's environment) an agent process gets: those
    :data:`PASSED_ENV` and ``pass_env`` name, never the run's keys (see the module docstring)."""
    names = PASSED_ENV + tuple(pass_env)
    exact = {n for n in names if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
    return {k: v for k, v in env.items() if (k in exact or k.startswith(prefixes)) and not _is_run_key(k)}


def episode_env(row, base_url: str, key: str) -> dict[str, str]:
    """The episode's own variables of an agent process (see the module docstring)."""
    return {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "AREAL_FAST_REWARD_URL": f"{base_url}/reward",
            "AREAL_FAST_ROW": json.dumps({"text": getattr(row, "text", None), "task": dict(getattr(row, "task", {}))})}


async def _read_tail(reader: asyncio.StreamReader, tail: bytearray) -> None:
    """Read ``reader`` to its end, keeping only its last :data:`_TAIL_BYTES` bytes in ``tail``."""
    while chunk := await reader.read(_READ_CHUNK):
        tail += chunk
        del tail[:-_TAIL_BYTES]


async def _stderr_pipe() -> tuple[int, asyncio.StreamReader, asyncio.BaseTransport]:
    """A pipe for the process's standard error: its write end (for the child) and a reader of the
    other end whose transport this process closes itself (a descendant may hold the write end)."""
    r, w = os.pipe()
    reader = asyncio.StreamReader(limit=_READ_CHUNK)
    try:
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", buffering=0))
    except BaseException:
        os.close(w)
        raise
    return w, reader, transport


async def run_command(row, client, command, timeout_s: float = 600.0, env: dict | None = None,
                      pass_env: list[str] | None = None) -> None:
    """One episode of an agent process (see the module docstring); ``env``: more variables with
    their values; ``pass_env``: more names of this process's variables to pass on."""
    argv = _argv(command)
    timeout_s = _timeout(timeout_s)
    extra, names = _env_values(env), _pass_env(pass_env)
    base_url, key = _endpoint(client)
    server = await shared_server()
    session = server.client_of(base_url).session
    w, reader, transport = await _stderr_pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env={**passed_env(dict(os.environ), names), **extra, **episode_env(row, base_url, key)},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=w,
            start_new_session=True,  # its own session and process group (pgid = its pid)
            preexec_fn=die_with_parent)  # and killed with this process, even by SIGKILL (its group is its own)
    except BaseException:
        transport.close()
        raise
    finally:
        os.close(w)  # the child has its copy; this end must not keep the pipe open here
    tail = bytearray()
    reading = asyncio.ensure_future(_read_tail(reader, tail))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        kill_group(proc.pid)  # at exit too: what it started dies with it
        if proc.returncode is None:
            await proc.wait()
        await asyncio.wait({reading}, timeout=DRAIN_S)
        if reading.done():
            reading.exception()  # a failed read: what came so far is the tail
        reading.cancel()
        transport.close()
    shown = escape_controls(tail.decode(errors="replace")[-STDERR_TAIL:])
    if timed_out:
        raise TimeoutError(f"agent process {argv} ran past timeout_s={timeout_s:g} (killed with its process group); "
                           f"its standard error ends: {shown}")
    if proc.returncode != 0:
        raise RuntimeError(f"agent process {argv} exited with {proc.returncode}; its standard error ends: {shown}")
    if session.final_reward is None:
        raise RuntimeError(f"agent process {argv} exited without setting its reward (POST {base_url}/reward "
                           f"with {{\"reward\": <number>}}); its standard error ends: {shown}")
    return None  # the reward set over HTTP is the episode's (agent/workflow.py)


run_command.check_args = check_args  # the agent workflow's check_args checks agent_args with it


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
