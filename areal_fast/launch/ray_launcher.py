"""Ray launcher: the same run as ``areal-fast train`` on a Ray cluster of one machine or many.

::

    driver (this process)
      |-- ray.init(address)  ................... or a local single-node Ray when no address is given
      |-- placement group "servers":  n_servers x {CPU: c, GPU: tp}    (SPREAD: one server per node first)
      |     `-- ProcessHost actor per bundle --> python -m areal_fast.rollout.engine | sglang.launch_server
      |-- placement group "trainers": world_size x {CPU: c, GPU: 1}    (PACK: ranks on as few nodes as possible)
      |     `-- ProcessHost actor per bundle --> python -m areal_fast.launch.ray_launcher rank CONFIG ...
      |           env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (what torchrun would set);
      |           rank 0 runs the controller against rollout.servers=[the servers' addresses]
      `-- watch loop (0.5 s): actor liveness and exit codes, server health, per-process logs pulled
          into <output_dir>/logs/<name>.log, the progress bar from <output_dir>/metrics.jsonl

Every program runs as a child process of a small actor (:class:`ProcessHost`) on the node of its
bundle, not inside the actor: the programs are exactly those the local launcher starts (no Ray
inside the trainer or the engine), the actor holds the resource reservation (Ray sets
CUDA_VISIBLE_DEVICES for it and the child inherits it), and a killed actor takes its child with
it (PR_SET_PDEATHSIG, as in the local launcher).

Failures are handled as in the local launcher: a dead server (process exit, killed actor, lost
node) is reported and the controller's client fails over to the others; when the last one is
gone the run fails fast with :class:`ProcessDied` naming it and its log tail. A trainer rank that
dies fails the run the same way. Teardown (always, also on Ctrl-C): SIGTERM to every process
group, SIGKILL after a grace period, ``ray.kill`` of every actor, placement groups removed, and
``ray.shutdown`` when this launcher started Ray.

Requirements for several nodes: the same Python environment with areal_fast on every node, and
``experiment.output_dir`` and the model on a filesystem every node sees (checkpoints are written
by all ranks). See ``docs/multinode.md``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from areal_fast.launch.local import ProcessDied, find_free_port, http_ok

log = logging.getLogger(__name__)
PYTHON = "{python}"  # placeholder in a command: the interpreter of the node that runs it
_LOG_CHUNK = 1 << 20  # bytes pulled per process per round; a log never lags more than ~1 MiB/s
_UNHEALTHY_WARN_S = 60.0  # a busy CPU engine answers /health within ~1 s; a minute means it is stuck
_FOLLOWER_EXIT_S = 30.0  # ranks > 0 leave right after rank 0's 'stop'; longer means they hang


@dataclass(kw_only=True, slots=True)
class RayConfig:
    """Where and how the Ray launcher places the run (``launcher: ray``)."""

    address: str | None = None
    """Cluster to join: 'auto', 'HOST:6379' or 'ray://HOST:10001'. None = the RAY_ADDRESS environment
    variable, or a local single-node Ray started (and stopped) by the launcher."""
    num_cpus: int | None = None
    """CPUs of a local Ray started by the launcher (None = all)."""
    server_strategy: str = "SPREAD"
    """Placement strategy of the server bundles: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    trainer_strategy: str = "PACK"
    """Placement strategy of the trainer-rank bundles (PACK keeps NCCL traffic inside nodes)."""
    cpus_per_server: float | None = None
    """Logical CPUs per server bundle (None = rollout.threads_per_server)."""
    gpus_per_server: int | None = None
    """GPUs per server bundle (None = the --tp-size of server_args for SGLang, 1 for a CUDA embedded
    engine, 0 otherwise)."""
    cpus_per_rank: float | None = None
    """Logical CPUs per trainer-rank bundle (None = train.threads)."""
    host: str | None = None
    """Address servers bind and ranks meet on (None = 127.0.0.1 on a one-node cluster, else each
    node's IP)."""
    placement_timeout: float = 300.0
    """Seconds to wait for the placement groups (and autoscaled nodes) before failing."""
    grace: float = 10.0
    """Seconds between SIGTERM and SIGKILL at teardown."""

    def __post_init__(self):
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        for key in ("server_strategy", "trainer_strategy"):
            if getattr(self, key) not in strategies:
                raise ValueError(f"{key}: must be one of {strategies}, got {getattr(self, key)!r}")
        for key in ("cpus_per_server", "cpus_per_rank"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ValueError(f"{key}: must be > 0 or null, got {v!r}")
        if self.gpus_per_server is not None and self.gpus_per_server < 0:
            raise ValueError(f"gpus_per_server: must be >= 0 or null, got {self.gpus_per_server!r}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus: must be >= 1 or null, got {self.num_cpus!r}")
        if not self.placement_timeout > 0 or self.grace < 0:
            raise ValueError("placement_timeout must be > 0 and grace >= 0")


# ----------------------------------------------------------------------------- the actor


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
        with open(self.log_path, "ab") as f:
            f.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         cwd=cwd if cwd and os.path.isdir(cwd) else None,
                                         start_new_session=True, preexec_fn=_die_with_actor)
        return {"pid": self.proc.pid, "log_path": self.log_path}

    def poll(self, health_url: str | None = None) -> dict:
        rc = self.proc.poll() if self.proc else None
        healthy = http_ok(health_url, timeout=1.0) if health_url and rc is None else None
        return {"returncode": rc, "healthy": healthy}

    def read_log(self, offset: int, limit: int = _LOG_CHUNK) -> tuple[bytes, int]:
        if not self.log_path:
            return b"", offset
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
        return data, offset + len(data)

    def discard_log(self) -> None:
        """Remove the node-local log (the driver has pulled it) and the run's folder once empty."""
        if self.log_path:
            _remove_log(self.log_path)

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


def _remove_log(path: str) -> None:
    try:
        os.remove(path)
        os.rmdir(os.path.dirname(path))  # fails while other processes of the run still log there
    except OSError:
        pass


# ----------------------------------------------------------------------------- the driver side


@dataclass(eq=False)
class RayProcess:
    """One program run by a ProcessHost actor, as the driver sees it."""

    name: str
    actor: object
    node_ip: str
    log_path: Path  # on the driver, filled by pulling
    url: str | None = None
    critical: bool = True
    returncode: int | None = None
    lost: str | None = None  # why the actor is gone (killed, node lost), if it is
    pid: int | None = None
    remote_log: str | None = None
    offset: int = 0
    reported: bool = False
    last_healthy: float = field(default_factory=time.monotonic)
    warned_unhealthy: bool = False

    def alive(self) -> bool:
        return self.returncode is None and self.lost is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def death_message(self) -> str:
        how = f"its actor died ({self.lost})" if self.lost else f"exited with code {self.returncode}"
        return f"process '{self.name}' (node {self.node_ip}, pid {self.pid}) {how}; log {self.log_path}:\n" \
               f"{self.log_tail()}"


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the Ray launcher needs Ray: pip install 'areal_fast[ray]'") from e
    return ray


def _resources(cpus: float, gpus: int) -> dict:
    return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}


def tp_size(server_args: list[str]) -> int:
    """Tensor-parallel size named in SGLang arguments (--tp-size N, --tp N, --tp-size=N), else 1."""
    for i, a in enumerate(server_args):
        for flag in ("--tp-size", "--tp", "--tensor-parallel-size"):
            if a == flag and i + 1 < len(server_args):
                return int(server_args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1


def server_command(rollout_cfg, model_path: str, host: str, port: int, seed: int) -> list[str]:
    """The command the local launcher runs for one server, with the node's Python."""
    r = rollout_cfg
    if r.engine == "embedded":
        return [PYTHON, "-m", "areal_fast.rollout.engine", "--model", model_path, "--host", host,
                "--port", str(port), "--device", r.device, "--seed", str(seed), "--weight-version", "0",
                "--max-running-requests", str(max(256, r.max_concurrent * r.group_size)), *r.server_args]
    return [PYTHON, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
            "--skip-tokenizer-init", "--weight-version", "0", *r.server_args]


class RayLauncher:
    """Owns the actors and placement groups of one run; the Ray counterpart of ``LocalLauncher``.

    ``ray.init`` must have been called (see :func:`ray_session`)."""

    def __init__(self, log_dir: str | Path, cfg: RayConfig | None = None, *, log_pull_s: float = 1.0):
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("RayLauncher needs a connected Ray: call ray.init() or use ray_session()")
        self.cfg = cfg or RayConfig()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.node_log_dir = os.path.join(tempfile.gettempdir(), "areal_fast_ray", self.run_id)
        self.procs: list[RayProcess] = []
        self.actors: list = []  # every actor created, started or not (all are killed at teardown)
        self.groups: list = []
        self.single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        self._closed = False
        self._lock = threading.Lock()
        self._stop_pump = threading.Event()
        self._pump = threading.Thread(target=self._pump_logs, args=(log_pull_s,), daemon=True,
                                      name="ray-log-pump")
        self._pump.start()

    # ------------------------------------------------------------ placing
    def host_for(self, node_ip: str) -> str:
        return self.cfg.host or ("127.0.0.1" if self.single_node else node_ip)

    def _placement_group(self, bundles: list[dict], strategy: str, what: str):
        ray = _ray()
        from ray.util.placement_group import placement_group

        pg = placement_group(bundles, strategy=strategy, name=f"areal-{self.run_id}-{what}")
        self.groups.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=self.cfg.placement_timeout)
        if not ready:
            raise TimeoutError(f"placement group '{what}' ({len(bundles)} x {bundles[0]}, {strategy}) not placed "
                               f"after {self.cfg.placement_timeout:.0f}s; cluster has {ray.cluster_resources()}, "
                               f"free {ray.available_resources()}")
        return pg

    def _hosts(self, pg, bundles: list[dict], prefix: str) -> list[tuple[object, dict]]:
        """One ProcessHost actor per bundle of ``pg``; returns (actor, info) pairs in bundle order."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(ProcessHost)
        actors = []
        for i, b in enumerate(bundles):
            actors.append(cls.options(
                name=f"areal-{self.run_id}-{prefix}{i}", num_cpus=b["CPU"], num_gpus=b.get("GPU", 0),
                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=False),
            ).remote(self.node_log_dir))
            self.actors.append(actors[-1])
        infos = ray.get([a.info.remote() for a in actors], timeout=self.cfg.placement_timeout)
        return list(zip(actors, infos, strict=True))

    def _run(self, actor, info: dict, name: str, cmd: list[str], env: dict, url: str | None,
             critical: bool) -> RayProcess:
        ray = _ray()
        started = ray.get(actor.start.remote(name, cmd, {k: str(v) for k, v in env.items()}, os.getcwd()))
        p = RayProcess(name=name, actor=actor, node_ip=info["node_ip"], log_path=self.log_dir / f"{name}.log",
                       url=url, critical=critical, pid=started["pid"], remote_log=started["log_path"])
        with self._lock:
            self.procs.append(p)
        log.info("started %s on %s (pid %d), log %s", name, p.node_ip, p.pid, p.log_path)
        return p

    def start_servers(self, rollout_cfg, model_path: str, seed: int = 0) -> list[RayProcess]:
        """``rollout.n_servers`` servers, one per bundle of a placement group; waits for health."""
        ray = _ray()
        r = rollout_cfg
        gpus = self.cfg.gpus_per_server
        if gpus is None:
            gpus = tp_size(r.server_args) if r.engine == "sglang" else int(r.device.startswith("cuda"))
        if gpus and ray.cluster_resources().get("GPU", 0) < gpus:
            raise ValueError(f"rollout: {r.engine} servers need {gpus} GPU(s) each but the Ray cluster has "
                             f"{ray.cluster_resources().get('GPU', 0):g} (set rollout.device=cpu for CPU servers)")
        cpus = self.cfg.cpus_per_server or float(r.threads_per_server)
        bundles = [_resources(cpus, gpus)] * r.n_servers
        pg = self._placement_group(bundles, self.cfg.server_strategy, "servers")
        out = []
        threads = str(r.threads_per_server)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        for i, (actor, info) in enumerate(self._hosts(pg, bundles, "server")):
            host = self.host_for(info["node_ip"])
            port = ray.get(actor.free_port.remote(host))
            out.append(self._run(actor, info, f"server{i}", server_command(r, model_path, host, port, seed + i),
                                 {**env, "AREAL_FAST_HOST": host}, f"http://{host}:{port}", critical=False))
        self.wait_healthy(out, r.health_timeout)
        return out

    def start_trainer_ranks(self, cmd: list[str], world_size: int, *, env: dict | None = None, cpus: float = 1.0,
                            gpus: int = 0) -> list[RayProcess]:
        """``world_size`` copies of ``cmd`` with the torch.distributed rendezvous torchrun would give.

        Ranks are numbered node by node (the node of bundle 0 first), so LOCAL_RANK counts ranks on
        one node; with GPUs, CUDA_VISIBLE_DEVICES lists that node's rank GPUs in LOCAL_RANK order.
        World size 1 gets no rendezvous variables (the trainer then runs without a process group
        launcher, as in the local launcher)."""
        ray = _ray()
        bundles = [_resources(cpus, gpus)] * world_size
        pg = self._placement_group(bundles, self.cfg.trainer_strategy, "trainers")
        hosts = self._hosts(pg, bundles, "rank")
        nodes = list(dict.fromkeys(info["node_id"] for _, info in hosts))
        hosts.sort(key=lambda h: nodes.index(h[1]["node_id"]))  # stable: bundle order within a node
        master = self.host_for(hosts[0][1]["node_ip"])
        port = ray.get(hosts[0][0].free_port.remote(master))
        out = []
        for rank, (actor, info) in enumerate(hosts):
            same = [h for h in hosts if h[1]["node_id"] == info["node_id"]]
            e = {**(env or {}), "AREAL_FAST_HOST": self.host_for(info["node_ip"])}
            if world_size > 1:
                e.update(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=same.index((actor, info)),
                         LOCAL_WORLD_SIZE=len(same), GROUP_RANK=nodes.index(info["node_id"]),
                         MASTER_ADDR=master, MASTER_PORT=port)
            if gpus:
                e["CUDA_VISIBLE_DEVICES"] = ",".join(g for h in same for g in h[1]["gpu_ids"])
            out.append(self._run(actor, info, f"trainer{rank}", cmd, e, None, critical=True))
        return out

    # ------------------------------------------------------------ watching
    def refresh(self, health: bool = False, timeout: float = 5.0) -> None:
        """Update exit codes (and health, for servers) of the live processes from their actors."""
        ray = _ray()
        live = [p for p in self.procs if p.alive()]
        refs = {p.actor.poll.remote(p.url + "/health" if health and p.url else None): p for p in live}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref in ready:
            p = refs[ref]
            try:
                st = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # transient (network, node under load): ask again
                continue
            except ray.exceptions.RayActorError as e:
                p.lost = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                self._pull_local(p)  # the actor cannot hand out its log any more; same node: read it here
                continue
            if st["returncode"] is not None:
                self.pull_logs([p])
                p.returncode = st["returncode"]
            if st["healthy"]:
                p.last_healthy = time.monotonic()

    def wait_healthy(self, procs: list[RayProcess], timeout: float) -> None:
        """Block until every process with a url answers 200 on /health; fail fast when one dies."""
        deadline = time.monotonic() + timeout
        pending = [p for p in procs if p.url]
        for p in pending:
            p.last_healthy = 0.0
        while pending:
            t0 = time.monotonic()
            self.refresh(health=True)
            for p in list(pending):
                if not p.alive():
                    raise ProcessDied(f"{p.death_message()}\n(it died while starting up)")
                if p.last_healthy >= t0:
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {', '.join(p.name for p in pending)}; "
                                   f"see logs in {self.log_dir}")
            time.sleep(0.2)

    def dead(self) -> list[RayProcess]:
        """Processes that ended since the last call (each reported once; exit code 0 included)."""
        out = [p for p in self.procs if not p.reported and not p.alive()]
        for p in out:
            p.reported = True
        return out

    def check(self, health: bool = False) -> list[RayProcess]:
        """Refresh; raise ProcessDied when a critical process failed or the last server is gone.

        Returns the processes that ended since the last call (finished critical ones with code 0,
        and dead servers, which are logged as warnings)."""
        self.refresh(health=health)
        dead = self.dead()
        for p in dead:
            if p.critical and (p.lost or p.returncode != 0):
                raise ProcessDied(p.death_message())
            if not p.critical:
                log.warning("%s", p.death_message())
        servers = [p for p in self.procs if p.url]
        now = time.monotonic()
        for p in servers:
            if health and p.alive() and not p.warned_unhealthy and now - p.last_healthy > _UNHEALTHY_WARN_S:
                p.warned_unhealthy = True
                log.warning("server %s (%s) has not answered /health for %.0f s", p.name, p.url, now - p.last_healthy)
        if servers and any(p.url for p in dead) and not any(p.alive() for p in servers):
            last = [p for p in dead if p.url][-1]
            raise ProcessDied(f"the last inference server died: {last.death_message()}")
        return dead

    # ------------------------------------------------------------ logs
    def pull_logs(self, procs: list[RayProcess] | None = None) -> None:
        """Append what each process wrote since the last pull to ``<log_dir>/<name>.log``."""
        ray = _ray()
        procs = [p for p in (procs if procs is not None else list(self.procs)) if p.lost is None]
        refs = {p.actor.read_log.remote(p.offset): p for p in procs}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=10.0)
        for ref in ready:
            p = refs[ref]
            try:
                data, offset = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue
            except ray.exceptions.RayActorError:
                self._pull_local(p)
                continue
            self._append(p, data, offset)

    def _append(self, p: RayProcess, data: bytes, offset: int) -> None:
        with self._lock:
            if data and offset > p.offset:
                with open(p.log_path, "ab") as f:
                    f.write(data[len(data) - (offset - p.offset):])
                p.offset = offset

    def _pull_local(self, p: RayProcess) -> None:
        if p.remote_log and os.path.isfile(p.remote_log):
            with open(p.remote_log, "rb") as f:
                f.seek(p.offset)
                data = f.read()
            self._append(p, data, p.offset + len(data))

    def _pump_logs(self, every: float) -> None:
        while not self._stop_pump.wait(every):
            try:
                self.pull_logs()
            except Exception as e:  # noqa: BLE001 - logs are best effort, the watch loop reports deaths
                log.debug("log pull failed: %r", e)

    # ------------------------------------------------------------ stopping
    def shutdown(self) -> None:
        """Stop every process (SIGTERM, SIGKILL after the grace period), kill the actors, free the groups."""
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        self._stop_pump.set()
        self._pump.join(timeout=15)
        if not ray.is_initialized():
            return
        live = [p for p in self.procs if p.lost is None]
        try:
            self.pull_logs(live)
            refs = [p.actor.stop.remote(self.cfg.grace) for p in live]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=self.cfg.grace + 15)
            self.pull_logs(live)
            refs = [p.actor.discard_log.remote() for p in live if p.lost is None]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=10)
        except Exception as e:  # noqa: BLE001 - teardown goes on whatever happened
            log.warning("stopping processes: %r", e)
        for p in self.procs:
            if p.lost is not None and p.remote_log:  # same machine: pulled by _pull_local, not needed now
                _remove_log(p.remote_log)
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> RayLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class ray_session:  # noqa: N801 - used like a function: ``with ray_session(cfg): ...``
    """Connect to the cluster of ``cfg.address`` (or RAY_ADDRESS), or start a local Ray when neither is
    set; an already connected Ray is used as it is. Only what this session started is shut down."""

    def __init__(self, cfg: RayConfig | None = None):
        self.cfg = cfg or RayConfig()
        self.owned = False

    def __enter__(self) -> ray_session:
        ray = _ray()
        if ray.is_initialized():
            return self
        address = self.cfg.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=self.cfg.num_cpus, include_dashboard=False, log_to_driver=False)
        self.owned = True
        return self

    def __exit__(self, *exc) -> None:
        if self.owned:
            _ray().shutdown()


# ----------------------------------------------------------------------------- the run


def _follow_metrics(path: Path, pos: int, bar) -> int:
    """Feed the progress bar with the metrics.jsonl lines written since byte ``pos``."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < pos:  # rank 0 cut the file back on resume
                pos = 0
            f.seek(pos)
            chunk = f.read()
    except OSError:
        return pos
    end = chunk.rfind(b"\n") + 1  # only whole lines
    for line in chunk[:end].splitlines():
        try:
            bar(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return pos + end


class _sigterm_as_exit:  # noqa: N801
    """SIGTERM raises SystemExit in the main thread, so teardown runs as on Ctrl-C. Entered after
    ray.init, whose own handler (print a stack, abort) would otherwise skip the teardown."""

    def __enter__(self):
        self.prev = None
        if threading.current_thread() is threading.main_thread():
            self.prev = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum, frame) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc) -> None:
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)


def run_with_ray(cfg, *, progress: bool | None = None, say=None, ray_cfg: RayConfig | None = None,
                 poll_s: float = 0.5) -> dict:
    """``areal-fast train`` through Ray: the same run as ``launch.train.run_train``, placed by Ray.

    ``cfg`` is an ``AppConfig``; ``ray_cfg`` defaults to ``cfg.ray`` when the config has that section.
    Returns the controller's summary (``<output_dir>/summary.json``, written by trainer rank 0)."""
    import yaml

    from areal_fast.config import to_dict
    from areal_fast.launch.metrics import ProgressBar
    from areal_fast.launch.train import model_dir

    rc = ray_cfg or getattr(cfg, "ray", None) or RayConfig()
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = cfg.experiment.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "logs" / "launcher.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    pkg_log = logging.getLogger("areal_fast")
    pkg_log.addHandler(handler)
    old_level = pkg_log.level
    pkg_log.setLevel(logging.INFO)
    try:
        path = model_dir(cfg, say)
        path = str(Path(path).resolve()) if Path(path).exists() else path
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        with ray_session(rc), _sigterm_as_exit(), RayLauncher(out / "logs", rc) as launcher:
            servers = [u.rstrip("/") for u in cfg.rollout.servers]
            if not servers:
                say(f"starting {cfg.rollout.n_servers} {cfg.rollout.engine} server(s) on Ray...")
                servers = [p.url for p in launcher.start_servers(cfg.rollout, path, seed=cfg.experiment.seed)]
            ray = _ray()
            t = cfg.train
            cluster_gpus = ray.cluster_resources().get("GPU", 0)
            gpus = int(t.device == "cuda" or (t.device is None and cluster_gpus > 0))
            if gpus and cluster_gpus < t.world_size:
                raise ValueError(f"train: {t.world_size} GPU rank(s) requested but the Ray cluster has "
                                 f"{cluster_gpus:g} GPU(s) (train.device=cpu runs the ranks on CPU)")
            overrides = [f"model.path={path}", "model.warm_start.enabled=false",
                         f"rollout.servers={json.dumps(servers)}", f"experiment.output_dir={out}", "log.progress=false"]
            cmd = [PYTHON, "-m", "areal_fast.launch.ray_launcher", "rank", str(out / "config.yaml"), *overrides]
            say(f"starting {t.world_size} trainer rank(s) on Ray ({'GPU' if gpus else 'CPU'}); logs in {out / 'logs'}")
            ranks = launcher.start_trainer_ranks(cmd, t.world_size, env={"OMP_NUM_THREADS": t.threads},
                                                 cpus=rc.cpus_per_rank or float(t.threads), gpus=gpus)
            bar = ProgressBar(cfg.experiment.total_steps, 0, enabled=cfg.log.progress if progress is None else progress)
            metrics_pos, rounds = 0, 0
            try:
                finished_at = None
                while any(p.alive() for p in ranks):
                    launcher.check(health=rounds % 10 == 0)  # HTTP health every ~5 s, liveness every poll
                    rounds += 1
                    metrics_pos = _follow_metrics(out / "metrics.jsonl", metrics_pos, bar)
                    if finished_at is None and ranks[0].returncode == 0:
                        finished_at = time.monotonic()
                    if finished_at is not None and time.monotonic() - finished_at > _FOLLOWER_EXIT_S:
                        log.warning("trainer ranks still running %.0f s after rank 0 finished; stopping them",
                                    _FOLLOWER_EXIT_S)
                        break
                    time.sleep(poll_s)
                _follow_metrics(out / "metrics.jsonl", metrics_pos, bar)
            finally:
                bar.close()
        summary_path = out / "summary.json"
        return json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    finally:
        pkg_log.removeHandler(handler)
        pkg_log.setLevel(old_level)
        handler.close()


def _rank_main(argv: list[str]) -> None:
    """Entry of one trainer rank: the local training path with rollout.servers given (no Ray here)."""
    from areal_fast.config import load_config
    from areal_fast.launch.train import run_train

    cfg = load_config(argv[0], argv[1:])
    if getattr(cfg.train, "gpus", None):  # Ray chose this rank's GPU (CUDA_VISIBLE_DEVICES); no pinning
        cfg.train.gpus = None
    run_train(cfg, progress=False)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "rank":
        sys.exit("usage: python -m areal_fast.launch.ray_launcher rank CONFIG [KEY=VALUE ...]")
    _rank_main(sys.argv[2:])
