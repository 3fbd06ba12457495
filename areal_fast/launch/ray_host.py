"""The actor of the Ray launcher (``launch.ray_launcher``): :class:`ProcessHost` runs one program as
a child process on the node of its bundle and reports on it (exit code, health, log).

The child is forked from the actor's one thread, in a session of its own, and the kernel kills it
when the actor dies (PR_SET_PDEATHSIG), so a killed actor never leaves it running.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_fast.backends.keyfile import redact_command
from areal_fast.launch.base import PYTHON, open_private_log
from areal_fast.netutil import find_free_port

LOG_CHUNK = 1 << 20  # bytes pulled per process per round; a log never lags more than ~1 MiB/s


def _die_with_actor() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the kernel SIGKILLs the child when its actor dies, even by ray.kill (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - other OSes: stop() still cleans up on a normal teardown
        pass


class ProcessHost:
    """Actor body (``ray.remote(ProcessHost)``): runs one command on its node and reports on it.

    Every method returns quickly (the actor is single-threaded, and the child must be forked from
    the thread that lives as long as the actor, or PR_SET_PDEATHSIG would fire early)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.log_path: str | None = None
        self.proc: subprocess.Popen | None = None

    def info(self) -> dict:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self, host: str) -> int:
        return find_free_port(host)

    def start(self, name: str, cmd: list[str], env: dict, cwd: str | None) -> dict:
        cmd = [sys.executable if c == PYTHON else c for c in cmd]
        os.makedirs(self.log_dir, exist_ok=True)
        self.log_path = os.path.join(self.log_dir, f"{name}.log")
        with open_private_log(Path(self.log_path)) as f:
            f.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(redact_command(cmd))}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         cwd=cwd if cwd and os.path.isdir(cwd) else None,
                                         start_new_session=True, preexec_fn=_die_with_actor)
        return {"pid": self.proc.pid, "log_path": self.log_path}

    def poll(self, server_url: str | None = None, ready: bool = False) -> dict:
        """The exit code and, for a server, the one health check (``rollout.calls``): ``healthy``
        is its liveness (any answer counts: a server paused for a weight update may answer 503 for
        minutes), ``ready`` (asked with ``ready=True``) its /health probe answering 200."""
        from areal_fast.rollout.calls import health_now

        rc = self.proc.poll() if self.proc else None
        if not server_url or rc is not None:
            return {"returncode": rc, "healthy": None, "ready": None}
        if ready:
            h = health_now(server_url, liveness=False, probe_timeout_s=1.0)
            return {"returncode": rc, "healthy": h.alive, "ready": h.state == "ok"}
        return {"returncode": rc, "healthy": health_now(server_url, probe=False, timeout_s=1.0).alive, "ready": None}

    def read_log(self, offset: int, limit: int = LOG_CHUNK) -> tuple[bytes, int]:
        if not self.log_path:
            return b"", offset
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
        return data, offset + len(data)

    def discard_log(self) -> None:
        """Remove the node-local log (the driver has pulled it) and the run's folder once empty."""
        if self.log_path:
            remove_log(self.log_path)

    def stop(self, grace: float) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        return self.proc.poll()


def remove_log(path: str) -> None:
    try:
        os.remove(path)
        os.rmdir(os.path.dirname(path))  # fails while other processes of the run still log there
    except OSError:
        pass
