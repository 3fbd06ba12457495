"""Helpers shared by several test files (imported as a plain module: tests/ is on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from areal_fast.data.tiny_models import build_tiny_qwen2, perturbed_state_dict, save_state_dict
from areal_fast.embedded import start_engine_in_thread

# The twin's health-probe timeout (SGLang waits 20 s); 1 s so a paused twin answers 503 quickly.
TWIN_HEALTH_TIMEOUT_S = 1.0


async def wait_until(cond, what: str, limit_s: float = 60.0) -> None:
    """Poll a condition whose cause the test controls (e.g. generation making progress) until it holds;
    fails naming ``what`` when ``limit_s`` passes first. ``cond`` may be a coroutine function (a
    condition read over HTTP). A test waits for a state this way, never by sleeping a guessed time."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if loop.time() > end:
            raise AssertionError(f"waited {limit_s}s for {what}")
        await asyncio.sleep(0.005)


def poll_until(cond, what: str, limit_s: float = 60.0, every_s: float = 0.01) -> None:
    """:func:`wait_until` for code without an event loop (threads, processes, files)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"waited {limit_s}s for {what}")
        time.sleep(every_s)


async def stays_pending(task: asyncio.Future, window_s: float, what: str) -> None:
    """For a claim that something does NOT happen (a held request is not answered): waits on ``task``
    for ``window_s`` and fails if it ended, naming ``what``. The window is the only timer a test uses,
    and only once the state it checks is reached (the request is sent, the server is paused): size it
    from what the wrong behaviour would take (an answer of a few tokens), so that it would show."""
    done, _ = await asyncio.wait({task}, timeout=window_s)
    if done:
        raise AssertionError(f"{what}: it ended within {window_s:.2f}s ({task.exception() or task.result()!r})")


def in_watched_thread(fn, limit_s: float) -> dict:
    """``fn()`` in a daemon thread: ``{"value": ...}`` or ``{"error": ...}``; fails the test (instead of
    hanging it) when ``fn`` still runs after ``limit_s``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"still running after {limit_s}s: a wait without a deadline"
    return box


async def until_running(engine, n_tokens: int, count: int = 1, task: asyncio.Task | None = None,
                        limit_s: float = 60.0) -> None:
    """Wait until ``count`` requests on an in-thread engine hold >= ``n_tokens`` output tokens each
    (read from its scheduler); fails when ``limit_s`` passes first, or when ``task`` (the request's
    caller) ends first."""
    sched = engine.server.scheduler

    def running() -> bool:
        if task is not None and task.done():
            raise AssertionError(f"the request ended before {count} request(s) held {n_tokens} tokens")
        return sum(len(r.output_ids) >= n_tokens for r in list(sched._rows)) >= count

    await wait_until(running, f"{count} request(s) holding {n_tokens} tokens", limit_s)


def engine_twins(model_dir: str):
    """Body of a module fixture: yields ``get(version, **options)``, an in-thread embedded engine
    behaving as that SGLang release (one per distinct version/options), all stopped at the end."""
    made: dict[str, object] = {}

    def get(version: str, **options):
        key = version + repr(sorted(options.items()))
        if key not in made:
            made[key] = start_engine_in_thread(model_dir, sglang_version=version,
                                               health_check_timeout_s=TWIN_HEALTH_TIMEOUT_S, **options)
        return made[key]

    yield get
    for h in made.values():
        h.stop()


@contextlib.asynccontextmanager
async def serve_app(app):
    """Serve an aiohttp ``app`` on a free 127.0.0.1 port; yields its base URL, cleans up after."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def tiny_model(tmp_path_factory, name: str = "tiny", vocab_size: int = 256, **build) -> str:
    """A tiny random Qwen2 checkpoint in a fresh temporary directory (``build_tiny_qwen2``'s options)."""
    return build_tiny_qwen2(str(tmp_path_factory.mktemp(name)), vocab_size=vocab_size, **build)


def perturbed_checkpoint(base: str, seed: int, out_dir) -> tuple[str, dict]:
    """``base`` with fresh weights (``perturbed_state_dict`` with ``seed``) saved in ``out_dir``:
    (the checkpoint's path, its state dict)."""
    sd = perturbed_state_dict(base, seed=seed)
    return save_state_dict(sd, base, str(out_dir)), sd


def tiny_checkpoints(tmp_path_factory, seeds: dict[int, int], vocab_size: int = 256,
                     **build) -> tuple[dict[int, str], dict[int, dict]]:
    """Version 0: a tiny model; version ``v``: its weights perturbed with seed ``seeds[v]``.
    Returns (checkpoint path by version, state dict by perturbed version)."""
    paths = {0: tiny_model(tmp_path_factory, vocab_size=vocab_size, **build)}
    sds = {}
    for v, seed in seeds.items():
        paths[v], sds[v] = perturbed_checkpoint(paths[0], seed, tmp_path_factory.mktemp(f"v{v}"))
    return paths, sds


def disk_update(urls: list[str], path: str, version: str, api_key: str | None = None) -> None:
    """POST /update_weights_from_disk ``{model_path, weight_version}`` to each server; each must succeed."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = json.dumps({"model_path": path, "weight_version": version}).encode()
    for url in urls:
        req = urllib.request.Request(url + "/update_weights_from_disk", headers=headers, data=body)
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["success"] is True


def run_ranks(script: str, n: int, *args, result=None, timeout_s: float = 480):
    """Run ``script`` (a test file that is also its own torchrun worker) on ``n`` ranks of this machine with
    ``args``, one OMP thread a rank; a failed run fails the test with its output's tails. ``--standalone``:
    torchrun's own store binds a free port itself (a port picked here and bound later by the child can be
    taken in between by any other process of the suite). Returns what the worker saved in ``result``
    (``torch.save``d, read back whole), or None without one."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), script,
           *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if result is None:
        return None
    import torch

    return torch.load(result, weights_only=False)


# ----------------------------------------------------------------------------- raw connections to our listeners
# (http.conn_guard's limits, shown on the embedded engine and the Prometheus endpoint)
CLOSE_WITHIN_S = 15.0  # a connection the server must close is closed by then (the tests' timeouts are 0.5 s)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=CLOSE_WITHIN_S)


def closed_by_server(s: socket.socket, wait_s: float) -> bool:
    """True when the server closes ``s`` within ``wait_s`` (end of stream or reset), False when it
    is still open then. Whatever the server sends before closing is read and dropped."""
    s.settimeout(wait_s)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def request(s: socket.socket, path: str, key: str | None = None) -> int:
    """One keep-alive GET on ``s`` (with ``Authorization: Bearer <key>`` when given); the answer's
    status (its body is read)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    return request_answer(s, path)


def request_answer(s: socket.socket, path: str = "the request") -> int:
    """The status of the next answer on ``s`` (its body is read)."""
    s.settimeout(CLOSE_WITHIN_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection instead of answering {path}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split(b" ", 2)[1])
