"""Local launcher: start inference servers (and other helper processes) as subprocesses, each with
its own log file, wait for their health, watch them, and shut everything down on exit or Ctrl-C.

    with LocalLauncher(log_dir) as L:
        urls = L.start_servers(cfg.rollout, model_path)      # waits for GET /health == 200
        ...                                                  # L.check() raises if a process died
    # every process is stopped here (SIGTERM, then SIGKILL after a grace period)

A server that dies is reported with the tail of its log; whether the run can go on is the
caller's decision (`on_death`): the controller drops a dead server from the pool while at least
one is left, and fails fast (with the log tail in the message) when none is.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from areal_fast.netutil import find_free_port

log = logging.getLogger(__name__)
_POLL_S = 0.1
_GRACE_S = 10.0


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL this child when the launching process dies, even by kill -9 (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - other OSes: shutdown() still cleans up on a normal exit
        pass


_die_with_parent = die_with_parent  # the name areal_fast.launch.ray_launcher imports


class ProcessDied(RuntimeError):
    """A launched process exited; the message names it, its exit code and its log tail."""




def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Managed:
    """One launched process."""

    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen
    url: str | None = None
    critical: bool = True
    reported: bool = field(default=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def death_message(self) -> str:
        return (f"process '{self.name}' (pid {self.proc.pid}) exited with code {self.proc.returncode}; "
                f"log {self.log_path}:\n{self.log_tail()}")


class LocalLauncher:
    """Owns the subprocesses of one run."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Managed] = []
        self._closed = False
        atexit.register(self.shutdown)

    # ------------------------------------------------------------ starting
    def start(self, name: str, cmd: list[str], env: dict | None = None, url: str | None = None,
              critical: bool = True) -> Managed:
        """Start ``cmd`` with stdout+stderr to ``<log_dir>/<name>.log`` in its own process group."""
        log_path = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **(env or {})}
        with open(log_path, "ab") as f:
            f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, preexec_fn=die_with_parent)
        m = Managed(name=name, cmd=cmd, log_path=log_path, proc=proc, url=url, critical=critical)
        self.procs.append(m)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return m

    def wait_healthy(self, procs: list[Managed], timeout: float, path: str = "/health") -> None:
        """Block until every process answers 200 on ``path``; fail fast when one exits."""
        deadline = time.monotonic() + timeout
        pending = [p for p in procs if p.url]
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise ProcessDied(f"{p.death_message()}\n(it died while starting up)")
                if http_ok(p.url + path):
                    pending.remove(p)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {names}; see logs in {self.log_dir}")
            time.sleep(_POLL_S)

    def start_servers(self, rollout_cfg, model_path: str, seed: int = 0) -> list[Managed]:
        """Launch ``rollout.n_servers`` inference servers on free loopback ports and wait for health."""
        out = []
        for i in range(rollout_cfg.n_servers):
            port = find_free_port()
            if rollout_cfg.engine == "embedded":
                cmd = [sys.executable, "-m", "areal_fast.rollout.engine", "--model", model_path,
                       "--host", "127.0.0.1", "--port", str(port), "--device", rollout_cfg.device,
                       "--seed", str(seed + i), "--weight-version", "0",
                       "--max-running-requests", str(max(256, rollout_cfg.max_concurrent * rollout_cfg.group_size)),
                       *rollout_cfg.server_args]
            else:
                cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                       "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
                       "--weight-version", "0", *rollout_cfg.server_args]
            threads = str(rollout_cfg.threads_per_server)
            env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
            if rollout_cfg.gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(rollout_cfg.gpus[i])
            out.append(self.start(f"server{i}", cmd, env=env, url=f"http://127.0.0.1:{port}", critical=False))
        self.wait_healthy(out, rollout_cfg.health_timeout)
        return out

    # ------------------------------------------------------------ watching
    def dead(self) -> list[Managed]:
        """Processes that exited since the last call (each reported once)."""
        out = []
        for p in self.procs:
            if not p.reported and not p.alive():
                p.reported = True
                out.append(p)
        return out

    def check(self) -> list[Managed]:
        """Raise ProcessDied for a dead critical process; return newly dead non-critical ones."""
        dead = self.dead()
        for p in dead:
            if p.critical:
                raise ProcessDied(p.death_message())
            log.warning("%s", p.death_message())
        return dead

    # ------------------------------------------------------------ stopping
    def shutdown(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period."""
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            if p.alive():
                try:
                    os.killpg(p.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + _GRACE_S
        for p in self.procs:
            try:
                p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.proc.wait()
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
