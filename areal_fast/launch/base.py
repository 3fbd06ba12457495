"""What every launcher shares: the one process handle, the launcher interface, and the server command.

A launcher places the processes of one run and watches them; ``launch.train.run_train`` drives it:

    with make_launcher(cfg, log_dir) as launcher:                 # LocalLauncher or RayLauncher
        servers = launcher.start_servers(cfg.rollout, model, seed=..., api_key=key)  # healthy on return
        # (the key reaches the servers in a private file under the launcher's secrets_dir, not argv)
        ranks = launcher.start_trainer_ranks(cfg.train, trainer_config_file, env)
        while any(r.alive() for r in ranks):
            launcher.check()                                      # ProcessDied names the dead process
    # every process is stopped here (SIGTERM, then SIGKILL after a grace period)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from areal_fast.launch.run_dir import open_private
from areal_fast.weights.config import API_KEY_ENV, HOST_ENV  # noqa: F401 - the names every launcher uses

PYTHON = "{python}"  # placeholder in a command: the interpreter of the machine that runs it
TRAINER_CONFIG_FILE = "trainer_config.yaml"  # in the output dir: what the trainer ranks read
SECRETS_DIR = ".secrets"  # in the output dir (mode 0700): the servers' API key file while they start


class ProcessDied(RuntimeError):
    """A launched process exited; the message names it, its exit code and its log tail."""


@dataclass(eq=False)
class LaunchedProcess:
    """One process of a run, on this machine (``popen`` set) or on a Ray node (the Ray launcher
    updates ``returncode`` / ``lost`` from its actor)."""

    name: str
    log_path: Path
    url: str | None = None  # servers: their base URL
    critical: bool = True  # a critical process that dies fails the run; a server is not critical
    pid: int | None = None
    node: str = "localhost"
    popen: Any = None  # subprocess.Popen of a local process
    actor: Any = None  # the Ray actor that runs a remote process
    returncode: int | None = None
    lost: str | None = None  # why a remote process is gone without an exit code (actor killed, node lost)
    reported: bool = False
    extra: dict = field(default_factory=dict)  # launcher-specific bookkeeping (log offsets, health times)

    def alive(self) -> bool:
        if self.popen is not None and self.returncode is None:
            self.returncode = self.popen.poll()
        elif self.popen is None and self.actor is None and self.pid and self.lost is None and not pid_alive(self.pid):
            self.lost = "the process is gone"  # adopted from an earlier run (rollout.keep_servers): no exit code
        return self.returncode is None and self.lost is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def death_message(self) -> str:
        how = f"is gone ({self.lost})" if self.lost else f"exited with code {self.returncode}"
        where = "" if self.node == "localhost" else f"node {self.node}, "
        return f"process '{self.name}' ({where}pid {self.pid}) {how}; log {self.log_path}:\n{self.log_tail()}"


class Launcher(Protocol):
    """Places the processes of one run (``LocalLauncher``, ``RayLauncher``)."""

    log_dir: Path

    def start_servers(self, rollout_cfg, model_path: str, *, seed: int, api_key: str | None
                      ) -> list[LaunchedProcess]: ...  # returns when every server answers /health

    def start_trainer_ranks(self, train_cfg, config_file: Path, env: dict[str, str]) -> list[LaunchedProcess]: ...

    def check(self) -> list[LaunchedProcess]: ...  # raises ProcessDied for a dead critical process

    def shutdown(self) -> None: ...


def pid_alive(pid: int) -> bool:
    """A process ``pid`` exists and is not a zombie (Linux /proc; elsewhere: signal 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def rank_command(config_file: Path, python: str = sys.executable) -> list[str]:
    """The command of one trainer rank: it reads everything from the resolved config file."""
    return [python, "-m", "areal_fast.launch.rank", str(config_file)]


def server_ready(url: str, timeout: float = 2.0) -> bool:
    """The start-up wait's question, the one health check's probe (``rollout.calls``): GET /health
    answers 200 within ``timeout``."""
    from areal_fast.rollout.calls import health_now

    return health_now(url, liveness=False, probe_timeout_s=timeout).state == "ok"


def server_alive(url: str, timeout: float = 2.0) -> bool:
    """The watchdog's question, the one health check's liveness half: the server's process answers
    HTTP (any status, a 401 or the 503 of a server paused for a weight update included), or is
    connected and busy; False for a refused, reset or timed-out connection."""
    from areal_fast.rollout.calls import health_now

    return health_now(url, probe=False, timeout_s=timeout).alive


def _split_tp(server_args: list[str]) -> tuple[int, list[str]]:
    """The tensor-parallel size named in SGLang arguments (--tp-size N, --tp N, --tp-size=N; else 1)
    and the other arguments."""
    tp, rest, skip = 1, [], False
    for i, a in enumerate(server_args):
        if skip:
            skip = False
            continue
        for flag in ("--tp-size", "--tp", "--tensor-parallel-size", "-tp"):
            if a == flag and i + 1 < len(server_args):
                tp, skip = int(server_args[i + 1]), True
                break
            if a.startswith(flag + "="):
                tp = int(a.split("=", 1)[1])
                break
        else:
            rest.append(a)
    return tp, rest


def tp_size(server_args: list[str]) -> int:
    return _split_tp(server_args)[0]


def gpus_per_server(rollout_cfg) -> int:
    """GPUs one launched server of ``rollout.engine`` takes: SGLang and vLLM their tensor-parallel size, the
    embedded engine one on a CUDA device and none on the CPU."""
    from areal_fast.rollout.server_command import ServerKind, launched_kind

    kind = launched_kind(rollout_cfg.engine)
    if kind is ServerKind.VLLM:  # tensor x pipeline x data parallel
        from areal_fast.backends.vllm.server_command import gpus_of

        tp, rest = _split_tp(list(rollout_cfg.server_args))
        return gpus_of(tp, rest)
    if kind is ServerKind.SGLANG:
        return tp_size(rollout_cfg.server_args)
    return int(rollout_cfg.device.startswith("cuda"))


def server_command(rollout_cfg, model_path: str, host: str, port: int, *, seed: int,
                   api_key_file: str | Path | None, python: str = sys.executable) -> list[str]:
    """The command of one inference server of the run (``rollout.engine``), through the one builder
    of server command lines; ``rollout.server_args`` are appended. The API key travels in
    ``api_key_file`` (``--config``, see :func:`server_key_file`), never on the command line."""
    from areal_fast.rollout.server_command import ServerKind, launched_kind
    from areal_fast.rollout.server_command import server_command as build

    r = rollout_cfg
    from areal_fast.rollout.config import ROUTED_EXPERTS_FLAG

    server_args = list(r.server_args)
    if r.return_routed_experts and ROUTED_EXPERTS_FLAG not in server_args:  # each engine records routing on it
        server_args.append(ROUTED_EXPERTS_FLAG)
    if api_key_file is not None and "--config" in r.server_args:
        raise ValueError("rollout.server_args: --config is taken by the launcher (it passes the run's API key "
                         "in a private file); give those options in rollout.server_args instead")
    if launched_kind(r.engine) is ServerKind.EMBEDDED:
        twin = []  # backend 'vllm': the engine serves vLLM's API of that release (docs/vllm.md)
        if r.backend == "vllm":
            from areal_fast.backends.vllm.server_command import embedded_vllm_args

            twin = embedded_vllm_args(r.vllm_version)
        return build("embedded", model_path, host, port, api_key_file=api_key_file, weight_version="0", seed=seed,
                     device=r.device, max_running_requests=max(256, r.max_concurrent * r.group_size),
                     extra_args=twin + server_args, python=python)
    tp, rest = _split_tp(server_args)
    python = r.server_python or python  # a real server may live in an environment of its own
    if launched_kind(r.engine) is ServerKind.VLLM:  # real vLLM (backends/vllm/server_command.py)
        from areal_fast.backends.vllm.compat import VLLMBehaviour
        from areal_fast.backends.vllm.server_command import vllm_server_command

        # the weight-transfer engine is on whenever the release has it: the run's weights.method is
        # not known here, and an unused transfer engine costs nothing until /init_weight_transfer_engine
        return vllm_server_command(model_path, host, port, version=r.vllm_version, tp_size=tp,
                                   api_key_file=api_key_file, seed=seed,
                                   max_num_seqs=max(256, r.max_concurrent * r.group_size),
                                   weight_transfer=VLLMBehaviour.of(r.vllm_version).has_weight_transfer,
                                   extra_args=rest, python=python)
    return build("sglang", model_path, host, port, tp_size=tp, api_key_file=api_key_file, weight_version="0",
                 seed=seed, extra_args=rest, python=python)


@contextlib.contextmanager
def server_key_file(secrets_dir_fn, api_key: str | None):
    """The run's API key in a new private file (0700 directory from ``secrets_dir_fn()``, 0600 file),
    for :func:`server_command`; None without a key. The servers read it once, at start-up: the
    file is removed when the block ends (the launchers end it once every server is healthy, or one
    failed), so a key file lives only while servers start."""
    if not api_key:
        yield None
        return
    from areal_fast.rollout.server_command import write_api_key_file

    path = write_api_key_file(secrets_dir_fn(), api_key)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def open_private_log(path: Path):
    """``path`` opened for appending, readable by this user only (0600): a server may print its
    arguments, the API key included (SGLang logs ``server_args=...`` at start-up). A symlink planted
    at ``path`` is refused, not followed (``run_dir.open_private``)."""
    return os.fdopen(open_private(path), "ab")


class PrivateFileHandler(logging.FileHandler):
    """``logging.FileHandler`` whose file is opened as :func:`open_private_log` opens a server's log
    (0600, a planted symlink refused)."""

    def _open(self):
        return os.fdopen(open_private(self.baseFilename), self.mode, encoding=self.encoding, errors=self.errors)


def server_env(rollout_cfg) -> dict[str, str]:
    """The environment entries of one launched server (vLLM's: its dev-mode endpoints on)."""
    threads = str(rollout_cfg.threads_per_server)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    if getattr(rollout_cfg, "engine", None) == "vllm":
        from areal_fast.backends.vllm.server_command import vllm_server_env

        env.update(vllm_server_env())
    env.update(getattr(rollout_cfg, "server_env", None) or {})
    return env
