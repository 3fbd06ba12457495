"""A handle on a running inference server (the embedded engine or SGLang): its address, its process
or in-thread stop function, its log, and the start-up wait for GET /health.

Both launchers return one: ``areal_fast.embedded.launch`` (the embedded engine, as a subprocess
or in a thread) and ``areal_fast.backends.sglang.server_command.launch_sglang_server`` (real SGLang). It sits
below both so that neither launcher imports the other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

__all__ = ["EngineHandle"]

_POLL_S = 0.1  # between /health polls during start-up


def _healthy(url: str) -> bool:
    """The one health check's probe (``rollout.calls``): GET /health answers 200 within 2 s."""
    # imported here: kept lazy from when rollout.calls reached the engine's launcher (and this) through
    # SGLang's version table, then in the engine package (now backends/sglang/compat.py)
    from areal_fast.rollout.calls import health_now

    return health_now(url, liveness=False, probe_timeout_s=2.0).state == "ok"


@dataclass
class EngineHandle:
    """A running server: ``url`` ("http://host:port"), ``stop()``; ``kill()`` for subprocesses."""

    url: str
    host: str
    port: int
    process: subprocess.Popen | None = None
    log_path: str | None = None
    server: object = field(default=None, repr=False)  # the EngineServer, for in-thread engines only
    api_key: str | None = field(default=None, repr=False)
    _stop_fn: object = field(default=None, repr=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); idempotent."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        elif self._stop_fn is not None:
            fn, self._stop_fn = self._stop_fn, None
            fn()

    def wait_healthy(self, timeout: float = 180.0, name: str = "engine") -> EngineHandle:
        """Poll GET /health until 200; RuntimeError (with the log tail) if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {self.process.returncode} during start-up:\n"
                                   f"{self.log_tail()}")
            if _healthy(self.url):
                return self
            time.sleep(_POLL_S)
        self.stop()
        raise RuntimeError(f"{name} not healthy after {timeout}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL a subprocess engine (simulates a crashed server)."""
        if self.process is None:
            raise RuntimeError("kill() needs a subprocess engine; use stop() for an in-thread one")
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
