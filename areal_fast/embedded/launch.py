"""Start the embedded engine as a subprocess or inside this process; both return an ``EngineHandle``
(``areal_fast.rollout.server_handle``, shared with the SGLang launcher)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import threading

from areal_fast.backends.sglang.compat import DEFAULT_SGLANG_VERSION
from areal_fast.backends.sglang.server_command import sglang_server_command
from areal_fast.netutil import find_free_port
from areal_fast.rollout.server_handle import EngineHandle

__all__ = ["EngineHandle", "find_free_port", "launch_engine_subprocess", "start_engine_in_thread"]


def launch_engine_subprocess(
    model_path: str,
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "auto",
    seed: int = 0,
    max_running_requests: int = 256,
    weight_version: str = "default",
    api_key: str | None = None,
    sglang_version: str | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    startup_timeout: float = 180.0,
    extra_args: tuple[str, ...] = (),
    wait: bool = True,
) -> EngineHandle:
    """Run ``python -m areal_fast.embedded`` and wait until GET /health answers 200.

    Raises RuntimeError with the server log's tail if the process exits or does not become healthy.
    ``wait=False`` returns at once; call ``handle.wait_healthy()`` later (start several in parallel).
    """
    port = port or find_free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"areal_engine_{port}_", suffix=".log")
        os.close(fd)
    cmd = sglang_server_command("embedded", model_path, host, port, device=device, dtype=dtype, seed=seed,
                         max_running_requests=max_running_requests, weight_version=weight_version,
                         sglang_version=sglang_version, skip_tokenizer_init=False, extra_args=extra_args)
    full_env = {**os.environ, **(env or {})}
    # the key in the child's environment (private to this user), not on its command line (readable by all)
    full_env.pop("AREAL_FAST_API_KEY", None)
    if api_key:
        full_env["AREAL_FAST_API_KEY"] = api_key
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    handle = EngineHandle(url=f"http://{host}:{port}", host=host, port=port, process=proc, log_path=log_path,
                          api_key=api_key)
    if wait:
        handle.wait_healthy(startup_timeout)
    return handle


def start_engine_in_thread(
    model_path: str,
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "auto",
    seed: int = 0,
    max_running_requests: int = 256,
    weight_version: str = "default",
    api_key: str | None = None,
    sglang_version: str | None = None,
    **server_options,
) -> EngineHandle:
    """Serve the engine from a background thread of this process (its own event loop); port 0 = any.

    ``server_options`` go to ``EngineServer`` (e.g. ``health_check_timeout_s``, ``dist_timeout_s``,
    ``conn_limits``).
    """
    from areal_fast.embedded.server import EngineServer
    from areal_fast.http.conn_guard import start_site

    server = EngineServer(model_path, device=device, dtype=dtype, seed=seed,
                          max_running_requests=max_running_requests, weight_version=weight_version,
                          host=host, port=port, api_key=api_key,
                          sglang_version=sglang_version or DEFAULT_SGLANG_VERSION, **server_options)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def _start():
        runner = await start_site(server.build_app(), host, port, server.conn_limits)
        box["runner"] = runner
        box["port"] = runner.addresses[0][1]
        server.port = box["port"]

    def _run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_start())
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            box["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=_run, name=f"engine-http-{port}", daemon=True)
    thread.start()
    ready.wait()
    if "error" in box:
        server.scheduler.stop()
        raise RuntimeError(f"engine failed to start on {host}:{port}: {box['error']}")

    def _stop():
        fut = asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop)
        try:
            fut.result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            server.scheduler.stop()

    p = box["port"]
    return EngineHandle(url=f"http://{host}:{p}", host=host, port=p, server=server, _stop_fn=_stop, api_key=api_key)
