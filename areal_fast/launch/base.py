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

from areal_fast.backends.server_command import (  # noqa: F401 - the names every launcher uses
    gpus_per_server,
    server_command,
    server_env,
    tp_size,
)
from areal_fast.diskutil import open_private
from areal_fast.weights.config import API_KEY_ENV, HOST_ENV  # noqa: F401 - the names every launcher uses

PYTHON = "{python}"  # placeholder in a command: the interpreter of the machine that runs it
TRAINER_CONFIG_FILE = "trainer_config.yaml"  # in the output dir: what the trainer ranks read
SECRETS_DIR = ".secrets"  # in the output dir (mode 0700): the servers' API key file while they start
STEPS_DIR = "slurm"  # in the output dir: each Slurm step's spec, the address it writes, the rendezvous (launch.slurm)
SBATCH_OUTPUT = "slurm-%j.out"  # in the output dir: what sbatch writes the batch script's output to (%j: job id)


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


@contextlib.contextmanager
def server_key_file(secrets_dir_fn, api_key: str | None):
    """The run's API key in a new private file (0700 directory from ``secrets_dir_fn()``, 0600 file),
    for :func:`server_command`; None without a key. The servers read it once, at start-up: the
    file is removed when the block ends (the launchers end it once every server is healthy, or one
    failed), so a key file lives only while servers start."""
    if not api_key:
        yield None
        return
    from areal_fast.backends.keyfile import write_api_key_file

    path = write_api_key_file(secrets_dir_fn(), api_key)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def open_private_log(path: Path):
    """``path`` opened for appending, readable by this user only (0600): a server may print its
    arguments, the API key included (SGLang logs ``server_args=...`` at start-up). A symlink planted
    at ``path`` is refused, not followed (``diskutil.open_private``)."""
    return os.fdopen(open_private(path), "ab")


class PrivateFileHandler(logging.FileHandler):
    """``logging.FileHandler`` whose file is opened as :func:`open_private_log` opens a server's log
    (0600, a planted symlink refused)."""

    def _open(self):
        return os.fdopen(open_private(self.baseFilename), self.mode, encoding=self.encoding, errors=self.errors)
