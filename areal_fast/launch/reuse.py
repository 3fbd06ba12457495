"""Servers that outlive a run (``rollout.keep_servers``), and their reuse when the run resumes.

As slime keeps its SGLang servers across a trainer restart, a run with ``keep_servers`` starts its
servers detached (no PR_SET_PDEATHSIG), leaves them running when it fails (an exception, or the
launcher killed with SIGKILL), and keeps their API key in ``<output_dir>/.secrets/servers.key``
(0600, in the 0700 directory) while they live. The resume (``experiment.resume=true``, same output
directory) reads ``servers/members.json`` and judges each server (:func:`judge`):

- it must answer with the kept key (a server that accepts the run's 256-bit key is one this run
  started), and ``members.json`` must name the model the run starts from;
- its current weight version (``/model_info``) is compared with the checkpoint the run resumes
  from: the same version is reused as it is; another version is reused only when the checkpoint's
  version is > 0, because the controller then sends the checkpoint's weights to every server
  before the first request (``Controller.run``); at version 0 nothing is sent, so such a server is
  stopped and a fresh one started.

A server the crashed launcher was still starting (``members.json``'s ``starting``: a relaunch in
progress when it was killed) is judged the same way if it answers /health 200 by now, and stopped
otherwise: nothing else would ever stop it. A server judged unfit, and every kept server (members
and starting ones) of a run that starts afresh, is stopped (by pid, after checking that the pid is
still an inference server). A run that ends well stops its servers
and removes the key. Local launcher only: a Ray run restarts its servers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from areal_fast.diskutil import open_private
from areal_fast.elastic.liveness import server_ready
from areal_fast.elastic.members import (
    MEMBERS_FILE,
    POOL_FILE,
    Member,
    read_json,
    read_members,
    read_starting,
    servers_dir,
)
from areal_fast.launch.base import SECRETS_DIR, LaunchedProcess, pid_alive
from areal_fast.weights.membership import group_name_of

log = logging.getLogger(__name__)
KEY_FILE = "servers.key"
# in a kept server's command line: the embedded engine, SGLang, vLLM's API server
_SERVER_MARKERS = ("areal_fast.embedded", "sglang", "vllm.entrypoints")


def key_path(out: Path) -> Path:
    return Path(out) / SECRETS_DIR / KEY_FILE


def save_key(out: Path, key: str | None) -> None:
    """Keep the servers' key while they may outlive the run (0600 file in the 0700 secrets dir)."""
    if not key:
        return
    d = Path(out) / SECRETS_DIR
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    fd = open_private(key_path(out), os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(key)


def kept_key(out: Path) -> str | None:
    try:
        return key_path(out).read_text().strip() or None
    except OSError:
        return None


def remove_key(out: Path) -> None:
    key_path(out).unlink(missing_ok=True)


def judge(answers: bool, weight_version: str | None, kept_model: str | None, model: str,
          ckpt_version: int) -> tuple[bool, str]:
    """May a kept server be reused by a run resuming from ``ckpt_version`` with ``model``? (module
    docstring). Returns (reuse, why)."""
    if not answers:
        return False, "it does not answer with the run's key"
    if kept_model != model:
        return False, f"it serves {kept_model!r}, the run starts from {model!r}"
    from areal_fast.rollout.answer import version_to_int

    if weight_version is not None and version_to_int(weight_version) == ckpt_version:  # vLLM's initial: "default"
        return True, f"at version {weight_version}, the checkpoint's"
    if ckpt_version > 0:
        return True, (f"at version {weight_version}, not the checkpoint's {ckpt_version}: the first weight "
                      f"update brings it there before any request")
    return False, f"it holds version {weight_version} but the run starts again from version 0"


def probe(url: str, key: str | None, rollout_cfg=None) -> tuple[bool, str | None]:
    """(answers with ``key``, its current weight version) of the server at ``url``, asked in its
    backend's API (``rollout_cfg.api``; SGLang's without one)."""
    from areal_fast.backends.registry import client_class, make_client

    def client():
        if rollout_cfg is None:
            return client_class("sglang")([url], api_key=key, request_timeout_s=10.0)
        return make_client(rollout_cfg, [url], api_key=key, request_timeout_s=10.0)

    async def ask():
        async with client() as c:
            return (await c.weight_versions())[0]

    try:
        return True, asyncio.run(ask())
    except Exception as e:  # noqa: BLE001 - any failure: not reusable
        log.info("kept server %s: %s", url, e)
        return False, None


def is_kept_server(pid: int | None) -> bool:
    """``pid`` is alive and still an inference server (a pid may be recycled)."""
    if not pid or not pid_alive(pid):
        return False
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(m in cmd for m in _SERVER_MARKERS)


def stop_kept(members: list[Member], why: str) -> None:
    for m in members:
        if is_kept_server(m.pid):
            log.warning("stopping kept server %s (%s, pid %d): %s", m.name, m.url, m.pid, why)
            try:
                os.killpg(m.pid, signal.SIGTERM)  # started with start_new_session: its group is its pid
            except (ProcessLookupError, PermissionError):
                pass


def _port_not_own(m: Member) -> str | None:
    """Why the kept server's port is not its own (``port_owner``): another process listens there, or
    nobody does (what answered /health closed its socket); None when its process holds it (or it
    cannot be told here)."""
    from urllib.parse import urlsplit

    from areal_fast.elastic.port_owner import GONE, NOBODY, OTHER, listener_state

    port = urlsplit(m.url).port
    state = listener_state(m.pid, port) if port is not None else None
    if state == OTHER:
        return f"its port {port} is listened on by another process"
    if state in (NOBODY, GONE):
        return f"nobody listens on its port {port}"
    return None


def kept_model(out: Path) -> str | None:
    d = read_json(servers_dir(out) / MEMBERS_FILE)
    return d.get("model") if isinstance(d, dict) else None


def release_groups(url: str, key: str | None, names: list[str], backend: str = "sglang") -> None:
    """Destroy the weight-update groups ``names`` that the crashed run left on a kept server (best
    effort: a name it does not hold is refused, which is fine). Its groups must go: SGLang and the
    embedded engine refuse a second group of one name, and the new run's first group takes the
    configured name again."""
    from areal_fast.weights.errors import WeightSyncError
    from areal_fast.weights.sync import SyncCalls

    calls = SyncCalls(timeout_s=30.0, api_key=key)
    try:
        if backend == "vllm":  # one transfer engine per server, no names: shut it (the next init makes a new one)
            try:
                calls.call(url, "/shutdown_weight_transfer_engine", None)
            except WeightSyncError:
                pass
            return
        for name in names:
            try:
                calls.call(url, "/destroy_weights_update_group", {"group_name": name})
                log.info("kept server %s: the crashed run's weight group %r destroyed", url, name)
            except WeightSyncError:
                pass
    finally:
        calls.close()


def kept_processes(out: Path) -> list[Member]:
    """Every server of ``out``'s members file whose process still runs: members and starting ones."""
    return [m for m in [*(read_members(out) or []), *read_starting(out)] if is_kept_server(m.pid)]


def started_since(out: Path, say=print) -> list[Member]:
    """The servers the crashed launcher was starting: the ones healthy by now, to be judged as members;
    the others are stopped (their launcher is gone: nothing would ever stop them)."""
    up = []
    for m in read_starting(out):
        if not is_kept_server(m.pid):
            continue
        why = _port_not_own(m) if server_ready(m.url) else "does not answer /health"
        if why is None:
            say(f"kept server {m.name} ({m.url}, pid {m.pid}) was starting when the run stopped and is up now")
            up.append(m)
        else:
            say(f"kept server {m.name} ({m.url}, pid {m.pid}) was starting when the run stopped and {why}: "
                "stopped")
            stop_kept([m], "still starting when the run stopped")
    return up


def reuse_kept_servers(out: Path, model: str, ckpt_version: int, say=print,
                       group_name: str = "weight_update_group", rollout_cfg=None
                       ) -> tuple[list[LaunchedProcess], str | None]:
    """The kept servers of the previous run of ``out`` fit for reuse (as processes to adopt, the
    crashed run's weight groups destroyed) and their key; the others are stopped. ([], None) when
    there are none."""
    members = [m for m in (read_members(out) or []) if is_kept_server(m.pid)]
    members += started_since(out, say)
    key = kept_key(out)
    if not members:
        return [], None
    keep, drop, model_of = [], [], kept_model(out)
    for m in members:
        if why := _port_not_own(m):
            say(f"kept server {m.name} ({m.url}, pid {m.pid}): not reused: {why} (the run's key is not sent there)")
            drop.append(m)
            continue
        answers, version = probe(m.url, key, rollout_cfg)
        ok, why = judge(answers, version, model_of, model, ckpt_version)
        say(f"kept server {m.name} ({m.url}, pid {m.pid}): {'reused' if ok else 'not reused'}: {why}")
        (keep if ok else drop).append(m)
    stop_kept(drop, "not fit for reuse")
    last = (read_json(servers_dir(out) / POOL_FILE) or {}).get("generation") or 0
    for m in keep:  # up to one generation past the last one rank 0 published (it may have re-formed since)
        release_groups(m.url, key, [group_name_of(group_name, g) for g in range(int(last) + 2)],
                       getattr(rollout_cfg, "api", "sglang"))
    procs = [LaunchedProcess(name=m.name, log_path=Path(m.log), url=m.url, critical=False, pid=m.pid, node=m.node,
                             extra={"slot": m.slot}) for m in keep]
    return procs, key if keep else None
