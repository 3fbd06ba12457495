"""Helpers shared by several test files (imported as a plain module: tests/ is on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request

from areal_fast.rollout.engine import start_engine_in_thread
from areal_fast.rollout.testing import build_tiny_qwen2, perturbed_state_dict, save_state_dict

# The twin's health-probe timeout (SGLang waits 20 s); 1 s so a paused twin answers 503 quickly.
TWIN_HEALTH_TIMEOUT_S = 1.0


async def wait_until(cond, what: str, limit_s: float = 60.0) -> None:
    """Poll a condition whose cause the test controls (e.g. generation making progress)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"waited {limit_s}s for {what}")
        await asyncio.sleep(0.005)


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
