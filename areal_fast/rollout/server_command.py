"""The one builder of inference-server command lines: the embedded engine and real SGLang.

Both kinds take SGLang's own flag names for what they share, so a command reads the same either
way and SGLang's argument parser accepts every SGLang command we build (a contract test parses it
with ``ServerArgs.add_cli_args`` / ``ServerArgs.from_cli_args``):

    --model-path P --host H --port N --tp-size T --skip-tokenizer-init
    [--api-key K] [--weight-version V] [--load-format F] [--dtype D] [--random-seed S]
    [--max-running-requests M]

Embedded only: ``--device``, ``--sglang-version`` (which SGLang release it behaves as).
SGLang only: ``--mem-fraction-static``, ``--disable-radix-cache``, ``--enable-memory-saver``,
``--skip-server-warmup``.

``launch_sglang_server`` starts a real SGLang with such a command; the embedded engine is started
by ``areal_fast.rollout.engine.launch_engine_subprocess``, which builds its command here too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from areal_fast.netutil import find_free_port

KINDS = ("embedded", "sglang")
ENGINE_MODULE = "areal_fast.rollout.engine"
SGLANG_MODULE = "sglang.launch_server"


def server_command(
    kind: str,
    model_path: str,
    host: str,
    port: int,
    *,
    tp_size: int = 1,
    api_key: str | None = None,
    weight_version: str | None = None,
    load_format: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    max_running_requests: int | None = None,
    skip_tokenizer_init: bool = True,
    device: str | None = None,
    sglang_version: str | None = None,
    mem_fraction_static: float | None = None,
    disable_radix_cache: bool = False,
    enable_memory_saver: bool = False,
    skip_server_warmup: bool = False,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The command line of one inference server of ``kind`` ("embedded" or "sglang").

    ``skip_tokenizer_init`` is on by default: RL sends token ids and reads token ids back.
    ``python`` is the interpreter to run (the Ray launcher passes a placeholder it resolves on
    the node). Options that the other kind does not have raise ValueError naming the option.
    """
    if kind not in KINDS:
        raise ValueError(f"server kind must be one of {KINDS}, got {kind!r}")
    if not model_path:
        raise ValueError("server_command: model_path is empty")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"server_command: port must be an int in 1..65535, got {port!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"server_command: tp_size must be an int >= 1, got {tp_size!r}")
    sglang_only = {"mem_fraction_static": mem_fraction_static is not None,
                   "disable_radix_cache": disable_radix_cache, "enable_memory_saver": enable_memory_saver,
                   "skip_server_warmup": skip_server_warmup}
    embedded_only = {"device": device is not None, "sglang_version": sglang_version is not None}
    if kind == "embedded":
        bad = [k for k, used in sglang_only.items() if used]
        if bad:
            raise ValueError(f"server_command: {bad[0]} is an SGLang option; the embedded engine has no such flag")
        if tp_size != 1:
            raise ValueError(f"server_command: the embedded engine runs one device (tp_size 1), got tp_size={tp_size}")
        cmd = [python, "-m", ENGINE_MODULE]
    else:
        bad = [k for k, used in embedded_only.items() if used]
        if bad:
            raise ValueError(f"server_command: {bad[0]} is an embedded-engine option; SGLang has no such flag")
        cmd = [python, "-m", SGLANG_MODULE]
    cmd += ["--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp_size)]
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if api_key:
        cmd += ["--api-key", api_key]
    if weight_version is not None:
        cmd += ["--weight-version", str(weight_version)]
    if load_format is not None:
        cmd += ["--load-format", load_format]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if seed is not None:
        cmd += ["--random-seed", str(seed)]
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if device is not None:
        cmd += ["--device", device]
    if sglang_version is not None:
        cmd += ["--sglang-version", sglang_version]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if skip_server_warmup:
        cmd.append("--skip-server-warmup")
    return cmd + list(extra_args)


def launch_sglang_server(model_path: str, port: int | None = None, *, host: str = "127.0.0.1",
                         env: dict[str, str] | None = None, log_path: str | None = None,
                         startup_timeout: float = 900.0, **flags):
    """Start real SGLang (``server_command("sglang", ...)``) and wait for GET /health == 200.

    Raises RuntimeError if sglang is not importable here (nothing is started then).
    """
    from areal_fast.rollout.engine.launch import EngineHandle

    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("sglang is not installed in this Python environment (pip install 'sglang[all]'); "
                           "use areal_fast.rollout.engine.launch_engine_subprocess for the embedded engine")
    port = port or find_free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"sglang_{port}_", suffix=".log")
        os.close(fd)
    cmd = server_command("sglang", model_path, host, port, **flags)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    handle = EngineHandle(url=f"http://{host}:{port}", host=host, port=port, process=proc, log_path=log_path,
                          api_key=flags.get("api_key"))
    return handle.wait_healthy(startup_timeout, name="sglang")
