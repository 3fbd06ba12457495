"""Helpers shared by several test files (imported as a plain module: tests/ is on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib

from areal_fast.rollout.engine import start_engine_in_thread

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
