"""Local launcher: inference servers and trainer ranks as subprocesses of this machine, each with its
own log file; health checks, watching, and shutdown of everything on exit or Ctrl-C.

    with LocalLauncher(log_dir) as L:
        servers = L.start_servers(cfg.rollout, model_path, seed=0, api_key=key)  # GET /health == 200
        ranks = L.start_trainer_ranks(cfg.train, config_file, env)               # torchrun, N ranks
        ...                                                  # L.check() raises if a critical process died
    # every process is stopped here (SIGTERM, then SIGKILL after a grace period)

A server that dies is reported with the tail of its log; whether the run can go on is the
caller's decision: the controller drops a dead server from the pool while at least one is left.
Every child gets PR_SET_PDEATHSIG, so a launcher killed with SIGKILL leaves no orphans.

The API key never goes on a server's command line (every local user can read ``/proc/<pid>/cmdline``):
``start_servers`` writes it into a private file of ``secrets_dir`` (``<output_dir>/.secrets`` for a
run; a private temporary directory, removed at shutdown, by default), passes ``--config FILE`` and
removes the file once the servers are healthy. Log files are readable by this user only.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_fast.backends.keyfile import redact_command
from areal_fast.elastic.liveness import server_ready
from areal_fast.elastic.port_owner import PortTaken, check_listener, nobody_listens, on_this_machine
from areal_fast.launch.base import (
    LaunchedProcess,
    ProcessDied,
    open_private_log,
    rank_command,
    server_command,
    server_env,
    server_key_file,
)
from areal_fast.netutil import find_free_port, url_host
from areal_fast.procutil import die_with_parent

log = logging.getLogger(__name__)
_POLL_S = 0.1
_GRACE_S = 10.0

__all__ = ["LocalLauncher", "ProcessDied", "LaunchedProcess"]


class LocalLauncher:
    """Owns the subprocesses of one run (the ``Launcher`` of ``launch.base`` on this machine)."""

    def __init__(self, log_dir: str | Path, host: str = "127.0.0.1", secrets_dir: str | Path | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.secrets_dir = Path(secrets_dir) if secrets_dir is not None else None
        self._own_secrets_dir: str | None = None  # a temporary one made here, removed at shutdown
        self.procs: list[LaunchedProcess] = []
        self._closed = False
        atexit.register(self.shutdown)

    # ------------------------------------------------------------ starting
    def start(self, name: str, cmd: list[str], env: dict | None = None, url: str | None = None,
              critical: bool = True, detach: bool = False) -> LaunchedProcess:
        """Start ``cmd`` with stdout+stderr to ``<log_dir>/<name>.log`` in its own process group.
        ``env`` is added to this process's environment (secrets travel here, never in ``cmd``).
        ``detach``: the process may outlive this one (no PR_SET_PDEATHSIG: ``rollout.keep_servers``)."""
        log_path = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **(env or {})}
        with open_private_log(log_path) as f:
            f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(redact_command(cmd))}\n".encode())
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, preexec_fn=None if detach else die_with_parent)
        p = LaunchedProcess(name=name, log_path=log_path, url=url, critical=critical, pid=proc.pid, popen=proc)
        self.procs.append(p)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return p

    def wait_healthy(self, procs: list[LaunchedProcess], timeout: float) -> None:
        """Block until every process answers 200 on /health (``elastic.liveness.server_ready``) from a listening
        socket of its own (``port_owner.check_listener``, for a process this machine can look up: another's
        socket on its port is PortTaken at once, and nobody listening is asked again until the deadline, then
        PortTaken; either way it is stopped); fail fast when one exits."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        pending = [p for p in procs if p.url]
        unheard: set[str] = set()  # names whose /health answered while nobody listened on the port
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise ProcessDied(f"{p.death_message()}\n(it died while starting up)")
                if server_ready(p.url):  # /health carries no key; then the port must be p's own
                    try:
                        own = check_listener(p.name, p.url, p.pid, local=on_this_machine(p))
                    except PortTaken:
                        self.stop_process(p)
                        raise
                    if own:
                        pending.remove(p)
                        unheard.discard(p.name)
                    else:
                        unheard.add(p.name)
            if not pending:
                return
            if time.monotonic() > deadline:
                for p in pending:
                    if p.name in unheard:  # what answered was not listening when checked: never taken
                        self.stop_process(p)
                        raise nobody_listens(p.name, p.url, p.pid, time.monotonic() - t0)
                names = ", ".join(p.name for p in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {names}; see logs in {self.log_dir}")
            time.sleep(_POLL_S)

    def start_servers(self, rollout_cfg, model_path: str, *, seed: int = 0, api_key: str | None = None
                      ) -> list[LaunchedProcess]:
        """``rollout.n_servers`` inference servers on free ports of ``host``; waits for their health.
        ``api_key`` reaches them in a private key file, removed once they are healthy (or one failed)."""
        with server_key_file(self.private_dir, api_key) as key_file:
            out = [self.start_server(rollout_cfg, model_path, i, f"server{i}", seed=seed + i, key_file=key_file)
                   for i in range(rollout_cfg.n_servers)]
            self.wait_healthy(out, rollout_cfg.health_timeout)  # every server has read the key file
            return out

    def start_server(self, rollout_cfg, model_path: str, slot: int, name: str, *, seed: int,
                     key_file: Path | None) -> LaunchedProcess:
        """One server of the run in ``slot`` (its GPU: ``rollout.gpus[slot]``) on a free port, not
        waiting for its health (``elastic.supervisor`` starts replacements with it)."""
        port = find_free_port(self.host)
        cmd = server_command(rollout_cfg, model_path, self.host, port, seed=seed, api_key_file=key_file)
        env = server_env(rollout_cfg)
        if rollout_cfg.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(rollout_cfg.gpus[slot])
        url = f"http://{url_host(self.host)}:{port}"
        p = self.start(name, cmd, env=env, url=url, critical=False, detach=rollout_cfg.keep_servers)
        p.extra["slot"] = slot
        return p

    def adopt(self, p: LaunchedProcess) -> None:
        """Watch and stop a server that an earlier run of this output directory started and left
        running (``rollout.keep_servers``): a process of this user, not a child of this one."""
        self.procs.append(p)

    def release(self, procs: list[LaunchedProcess]) -> None:
        """Leave ``procs`` running at shutdown (``rollout.keep_servers`` after a failed run)."""
        self.procs = [p for p in self.procs if p not in procs]

    def stop_process(self, p: LaunchedProcess, grace: float = _GRACE_S) -> None:
        """SIGTERM ``p``'s process group, SIGKILL it after ``grace`` seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not p.alive():
                break
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + grace
            while p.alive() and time.monotonic() < deadline:
                time.sleep(_POLL_S)

    def begin_stop(self, p: LaunchedProcess) -> None:
        """SIGTERM ``p``'s process group and return at once: the caller (``elastic.supervisor``) watches it
        exit and SIGKILLs it past its grace period, without waiting here."""
        if p.alive():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def private_dir(self) -> Path:
        if self.secrets_dir is None:
            self._own_secrets_dir = tempfile.mkdtemp(prefix="areal_fast_secrets_")  # mode 0700
            self.secrets_dir = Path(self._own_secrets_dir)
        return self.secrets_dir

    def start_trainer_ranks(self, train_cfg, config_file: Path, env: dict[str, str]) -> list[LaunchedProcess]:
        """``train.world_size`` ranks under one ``torchrun --standalone`` (its own rendezvous port)."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(train_cfg.world_size), *rank_command(config_file)[1:]]
        e = {"OMP_NUM_THREADS": str(train_cfg.threads), **env}
        if train_cfg.gpus:
            e["CUDA_VISIBLE_DEVICES"] = ",".join(train_cfg.gpus)
        return [self.start("trainer", cmd, env=e)]

    # ------------------------------------------------------------ watching
    def dead(self) -> list[LaunchedProcess]:
        """Processes that exited since the last call (each reported once)."""
        out = []
        for p in self.procs:
            if not p.reported and not p.alive():
                p.reported = True
                out.append(p)
        return out

    def check(self) -> list[LaunchedProcess]:
        """Raise ProcessDied for a critical process that failed; return the others that ended since
        the last call (dead servers are logged as warnings)."""
        dead = self.dead()
        for p in dead:
            if p.critical and p.returncode != 0:
                raise ProcessDied(p.death_message())
            if not p.critical:
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
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        if self._own_secrets_dir is not None:
            shutil.rmtree(self._own_secrets_dir, ignore_errors=True)
        deadline = time.monotonic() + _GRACE_S
        for p in self.procs:
            if p.popen is None:  # adopted: not our child
                self.stop_process(p, max(0.0, deadline - time.monotonic()))
                continue
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.popen.wait()
            p.alive()  # records the exit code
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

