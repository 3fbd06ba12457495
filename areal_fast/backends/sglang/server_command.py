"""The command line of one SGLang server, or of the embedded engine (SGLang's twin), and the start of a
real SGLang server. The run's one dispatcher over the backends is ``backends/server_command.py``.

Both kinds take SGLang's own flag names for what they share, so a command reads the same either
way and SGLang's argument parser accepts every SGLang command we build (a contract test parses it
with ``ServerArgs.add_cli_args`` / ``ServerArgs.from_cli_args``):

    --model-path P --host H --port N --tp-size T --skip-tokenizer-init
    [--config KEYFILE.yaml | --api-key K] [--weight-version V] [--load-format F] [--dtype D]
    [--random-seed S] [--max-running-requests M]

Embedded only: ``--device``, ``--sglang-version`` (which SGLang release it behaves as).
SGLang only: ``--mem-fraction-static``, ``--disable-radix-cache``, ``--enable-memory-saver``,
``--skip-server-warmup``.

The API key should not be on the command line: ``/proc/<pid>/cmdline`` is readable by every local
user. ``backends.keyfile.write_api_key_file`` writes it into a YAML file only this user can
read, which both kinds take with ``--config FILE`` (SGLang's own option: a YAML mapping of long
option names, merged under the command line); ``api_key_file=`` puts that option in the command
instead of ``--api-key``.

``launch_sglang_server`` starts a real SGLang with such a command; the embedded engine is started
by ``areal_fast.embedded.launch_engine_subprocess``, which builds its command here too. Both
return an ``EngineHandle`` (``areal_fast.rollout.server_handle``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from areal_fast.backends.keyfile import write_api_key_file
from areal_fast.netutil import find_free_port
from areal_fast.rollout.server_handle import EngineHandle

KINDS = ("embedded", "sglang")  # the kinds this module builds commands for
ENGINE_MODULE = "areal_fast.embedded"
SGLANG_MODULE = "sglang.launch_server"


def sglang_server_command(
    kind: str,
    model_path: str,
    host: str,
    port: int,
    *,
    tp_size: int = 1,
    api_key: str | None = None,
    api_key_file: str | os.PathLike | None = None,
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
    ``api_key_file`` (from :func:`write_api_key_file`) passes the key as ``--config FILE``, so the key
    itself is not in the command; ``api_key`` puts it on the command line (visible to local users).
    """
    if kind not in KINDS:
        raise ValueError(f"server kind must be one of {KINDS}, got {kind!r}")
    if not model_path:
        raise ValueError("sglang_server_command: model_path is empty")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"sglang_server_command: port must be an int in 1..65535, got {port!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"sglang_server_command: tp_size must be an int >= 1, got {tp_size!r}")
    if api_key and api_key_file:
        raise ValueError("sglang_server_command: give api_key or api_key_file, not both")
    if api_key_file is not None and "--config" in extra_args:
        raise ValueError("sglang_server_command: the API key file is passed as --config, and a server takes one "
                         "--config file; put the options of the other file in the extra arguments instead")
    sglang_only = {"mem_fraction_static": mem_fraction_static is not None,
                   "disable_radix_cache": disable_radix_cache, "enable_memory_saver": enable_memory_saver,
                   "skip_server_warmup": skip_server_warmup}
    embedded_only = {"device": device is not None, "sglang_version": sglang_version is not None}
    if kind == "embedded":
        bad = [k for k, used in sglang_only.items() if used]
        if bad:
            raise ValueError(f"sglang_server_command: {bad[0]} is an SGLang option; the embedded engine has no "
                             "such flag")
        if tp_size != 1:
            raise ValueError(f"sglang_server_command: the embedded engine runs one device (tp_size 1), got "
                             f"tp_size={tp_size}")
        cmd = [python, "-m", ENGINE_MODULE]
    else:
        bad = [k for k, used in embedded_only.items() if used]
        if bad:
            raise ValueError(f"sglang_server_command: {bad[0]} is an embedded-engine option; SGLang has no such flag")
        cmd = [python, "-m", SGLANG_MODULE]
    cmd += ["--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp_size)]
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if api_key_file is not None:
        cmd += ["--config", os.fspath(api_key_file)]
    elif api_key:
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
    """Start real SGLang (``sglang_server_command("sglang", ...)``) and wait for GET /health == 200.

    Raises RuntimeError if sglang is not importable here (nothing is started then). An ``api_key``
    reaches the server in a private key file (:func:`write_api_key_file`, in a private temporary
    directory), removed once the server is healthy or has failed to start.
    """
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("sglang is not installed in this Python environment (pip install 'sglang[all]'); "
                           "use areal_fast.embedded.launch_engine_subprocess for the embedded engine")
    port = port or find_free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"sglang_{port}_", suffix=".log")
        os.close(fd)
    api_key = flags.pop("api_key", None)
    key_dir = tempfile.mkdtemp(prefix="areal_fast_key_") if api_key else None  # mkdtemp: mode 0700
    try:
        key_file = write_api_key_file(key_dir, api_key) if api_key else None
        cmd = sglang_server_command("sglang", model_path, host, port, api_key_file=key_file, **flags)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        handle = EngineHandle(url=f"http://{host}:{port}", host=host, port=port, process=proc, log_path=log_path,
                              api_key=api_key)
        return handle.wait_healthy(startup_timeout, name="sglang")
    finally:
        if key_dir is not None:  # read by the server at start-up, before /health can answer
            shutil.rmtree(key_dir, ignore_errors=True)
