"""The one builder of inference-server command lines: the embedded engine and real SGLang.

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
user. ``write_api_key_file`` writes it into a YAML file only this user can read, which both kinds
take with ``--config FILE`` (SGLang's own option: a YAML mapping of long option names, merged under
the command line); ``api_key_file=`` puts that option in the command instead of ``--api-key``.
``redact_command`` hides a key that is on a command line anyway, for log lines.

``launch_sglang_server`` starts a real SGLang with such a command; the embedded engine is started
by ``areal_fast.rollout.engine.launch_engine_subprocess``, which builds its command here too. Both
return an ``EngineHandle`` (``areal_fast.rollout.server_handle``).
"""

from __future__ import annotations

import enum
import importlib.util
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from areal_fast.netutil import find_free_port
from areal_fast.rollout.server_handle import EngineHandle

KINDS = ("embedded", "sglang")  # the kinds this module builds commands for
ENGINE_MODULE = "areal_fast.rollout.engine"
SGLANG_MODULE = "sglang.launch_server"


class ServerKind(str, enum.Enum):
    """Where the inference servers of a run come from (decided once, by :func:`server_kind`)."""

    EXTERNAL = "external"  # rollout.servers: running already, started by someone else with their own key
    EMBEDDED = "embedded"  # launched by the run: python -m areal_fast.rollout.engine
    SGLANG = "sglang"  # launched by the run: python -m sglang.launch_server
    VLLM = "vllm"  # launched by the run: python -m vllm.entrypoints.openai.api_server (backends/vllm/server_command.py)

    @property
    def launched(self) -> bool:
        """The run starts these servers (and gives them a fresh API key)."""
        return self is not ServerKind.EXTERNAL


def server_kind(rollout_cfg) -> ServerKind:
    """The servers of a run with this ``rollout`` config section: the ones named in ``rollout.servers``
    (external), else ``rollout.n_servers`` launched servers of ``rollout.engine``."""
    if rollout_cfg.servers:
        return ServerKind.EXTERNAL
    return launched_kind(rollout_cfg.engine)


def launched_kind(engine: str) -> ServerKind:
    """The kind of server a launcher starts for ``rollout.engine`` ('embedded', 'sglang' or 'vllm')."""
    if engine not in KINDS + ("vllm",):
        raise ValueError(f"rollout.engine must be one of {KINDS + ('vllm',)}, got {engine!r}")
    return ServerKind(engine)


def server_command(
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
        raise ValueError("server_command: model_path is empty")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"server_command: port must be an int in 1..65535, got {port!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"server_command: tp_size must be an int >= 1, got {tp_size!r}")
    if api_key and api_key_file:
        raise ValueError("server_command: give api_key or api_key_file, not both")
    if api_key_file is not None and "--config" in extra_args:
        raise ValueError("server_command: the API key file is passed as --config, and a server takes one "
                         "--config file; put the options of the other file in the extra arguments instead")
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


def write_api_key_file(directory: str | os.PathLike, api_key: str) -> Path:
    """Write ``api-key: KEY`` into a new YAML file in ``directory`` that only this user can read.

    ``directory`` is created with mode 0700 (an existing one must be a real directory owned by this
    user, and is set to 0700); the file gets a fresh name and is created with O_EXCL and mode 0600,
    so nothing another user prepared (a file, a symlink) is ever written through. Returns its path,
    for ``server_command(..., api_key_file=path)``. A server reads the file once, at start-up: the
    caller may remove it as soon as the server answers /health.
    """
    import yaml

    if not api_key or not isinstance(api_key, str):
        raise ValueError(f"write_api_key_file: the API key must be a non-empty string, got {type(api_key).__name__}")
    if api_key.startswith("-") or any(c.isspace() for c in api_key):
        raise ValueError("write_api_key_file: the API key must not start with '-' nor contain white space "
                         "(a server's argument parser would misread it)")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"API key directory {str(d)!r} is not a directory owned by this user (uid "
                              f"{os.getuid()}); refusing to write the key there")
    os.chmod(d, 0o700)
    path = d / f"server-key-{os.getpid()}-{secrets.token_hex(4)}.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump({"api-key": api_key}))  # safe_dump quotes what YAML would read as a number
    return path


def redact_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` for a log line, with the value of ``--api-key`` (``--api-key K`` or ``--api-key=K``) hidden."""
    out = []
    for i, c in enumerate(cmd):
        if i and cmd[i - 1] == "--api-key":
            out.append("***")
        elif c.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(c)
    return out


def launch_sglang_server(model_path: str, port: int | None = None, *, host: str = "127.0.0.1",
                         env: dict[str, str] | None = None, log_path: str | None = None,
                         startup_timeout: float = 900.0, **flags):
    """Start real SGLang (``server_command("sglang", ...)``) and wait for GET /health == 200.

    Raises RuntimeError if sglang is not importable here (nothing is started then). An ``api_key``
    reaches the server in a private key file (:func:`write_api_key_file`, in a private temporary
    directory), removed once the server is healthy or has failed to start.
    """
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("sglang is not installed in this Python environment (pip install 'sglang[all]'); "
                           "use areal_fast.rollout.engine.launch_engine_subprocess for the embedded engine")
    port = port or find_free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"sglang_{port}_", suffix=".log")
        os.close(fd)
    api_key = flags.pop("api_key", None)
    key_dir = tempfile.mkdtemp(prefix="areal_fast_key_") if api_key else None  # mkdtemp: mode 0700
    try:
        key_file = write_api_key_file(key_dir, api_key) if api_key else None
        cmd = server_command("sglang", model_path, host, port, api_key_file=key_file, **flags)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        handle = EngineHandle(url=f"http://{host}:{port}", host=host, port=port, process=proc, log_path=log_path,
                              api_key=api_key)
        return handle.wait_healthy(startup_timeout, name="sglang")
    finally:
        if key_dir is not None:  # read by the server at start-up, before /health can answer
            shutil.rmtree(key_dir, ignore_errors=True)
