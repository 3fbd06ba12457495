"""Launch a real SGLang server with the flags RL needs (``shared/spec/sglang_http.md``, "Launch flags")."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

from areal_fast.rollout.engine.launch import EngineHandle, find_free_port


def sglang_command(model_path: str, port: int, *, host: str = "127.0.0.1", tp_size: int = 1,
                   mem_fraction_static: float = 0.8, dtype: str = "bfloat16", disable_radix_cache: bool = False,
                   enable_memory_saver: bool = False, load_format: str | None = None,
                   skip_server_warmup: bool = False, weight_version: str | None = None,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    """The ``python -m sglang.launch_server`` command line (tokenizer skipped: RL sends input_ids)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(tp_size), "--mem-fraction-static", str(mem_fraction_static),
           "--skip-tokenizer-init", "--dtype", dtype]
    if disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if load_format:
        cmd += ["--load-format", load_format]
    if skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if weight_version is not None:
        cmd += ["--weight-version", str(weight_version)]
    return cmd + list(extra_args)


def launch_sglang_server(model_path: str, port: int | None = None, *, host: str = "127.0.0.1",
                         env: dict[str, str] | None = None, log_path: str | None = None,
                         startup_timeout: float = 900.0, **flags) -> EngineHandle:
    """Start SGLang and wait for GET /health == 200; raise RuntimeError if sglang is not installed."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("sglang is not installed in this Python environment (pip install 'sglang[all]'); "
                           "use areal_fast.rollout.engine.launch_engine_subprocess for the embedded engine")
    port = port or find_free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"sglang_{port}_", suffix=".log")
        os.close(fd)
    cmd = sglang_command(model_path, port, host=host, **flags)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    handle = EngineHandle(url=f"http://{host}:{port}", host=host, port=port, process=proc, log_path=log_path)
    return handle.wait_healthy(startup_timeout, name="sglang")
