"""Ray launcher: the ``Launcher`` of ``launch.base`` on a Ray cluster of one machine or many
(``launcher: ray``; ``launch.train.run_train`` drives it exactly as it drives the local one).

::

    driver (this process)
      |-- ray.init(address)  ................... or a local single-node Ray when no address is given
      |-- placement group "servers":  n_servers x {CPU: c, GPU: tp}    (SPREAD: one server per node first)
      |     `-- ProcessHost actor per bundle --> python -m areal_fast.embedded | sglang.launch_server
      |           --config <output_dir>/.secrets/server-key-*.yaml (the API key; 0600, removed once healthy)
      |-- placement group "trainers": world_size x {CPU: c, GPU: 1}    (PACK: ranks on as few nodes as possible)
      |     `-- ProcessHost actor per bundle --> python -m areal_fast.launch.rank <output_dir>/trainer_config.yaml
      |           env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (what torchrun would set),
      |           AREAL_FAST_API_KEY; rank 0 runs the controller against the servers named in the file
      `-- watch loop (run_train, 0.5 s): actor liveness and exit codes, server health, per-process logs
          pulled into <output_dir>/logs/<name>.log

Every program runs as a child process of a small actor (``ray_host.ProcessHost``) on the node of its
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

The API key never goes on a command line (any user of a node can read ``/proc/<pid>/cmdline``): the
driver writes it into a private file of ``secrets_dir`` (``<output_dir>/.secrets`` for a run, which
every node sees; a private temporary directory on a single node by default), the servers take it
with ``--config FILE`` and the file is removed once they are healthy. Logs are 0600.

Requirements for several nodes: the same Python environment with areal_fast on every node, and
``experiment.output_dir`` and the model on a filesystem every node sees (checkpoints are written
by all ranks). See ``docs/multinode.md``.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from areal_fast.launch.base import (
    HOST_ENV,
    PYTHON,
    LaunchedProcess,
    PrivateFileHandler,
    ProcessDied,
    gpus_per_server,
    open_private_log,
    rank_command,
    server_command,
    server_env,
    server_key_file,
)
from areal_fast.launch.ray_host import ProcessHost, remove_log
from areal_fast.launch_config import RayConfig
from areal_fast.netutil import url_host

log = logging.getLogger(__name__)
_UNHEALTHY_WARN_S = 60.0  # a busy CPU engine answers /health within ~1 s; a minute means it is stuck
_HEALTH_EVERY = 10  # check() asks /health on every 10th call: ~5 s apart at the driver's 0.5 s poll


# ----------------------------------------------------------------------------- the driver side


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the Ray launcher needs Ray: pip install 'areal_fast[ray]'") from e
    return ray


def _resources(cpus: float, gpus: int, custom: dict | None = None) -> dict:
    """One bundle: CPUs, GPUs when any, and the custom resources that pin it to some nodes."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **(custom or {})}


def policy_shortfall(cluster: dict, bundle: dict, max_servers: int) -> list[str]:
    """What a cluster of ``cluster`` resources (``ray.cluster_resources()``) lacks to hold ``max_servers``
    server bundles (``rollout.autoscale.max_servers``): one line a resource, empty when they fit."""
    return [f"{k} {v * max_servers:g} (the cluster has {cluster.get(k, 0):g})" for k, v in bundle.items()
            if v and v * max_servers > cluster.get(k, 0)]


class RayLauncher:
    """Owns the actors and placement groups of one run; the Ray counterpart of ``LocalLauncher``.

    ``ray.init`` must have been called (see :func:`ray_session`)."""

    def __init__(self, log_dir: str | Path, cfg: RayConfig | None = None, *, log_pull_s: float = 1.0,
                 secrets_dir: str | Path | None = None):
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("RayLauncher needs a connected Ray: call ray.init() or use ray_session()")
        self.cfg = cfg or RayConfig()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.node_log_dir = os.path.join(tempfile.gettempdir(), "areal_fast_ray", self.run_id)
        self.secrets_dir = Path(secrets_dir) if secrets_dir is not None else None
        self._own_secrets_dir: str | None = None  # a temporary one made here (single node), removed at shutdown
        self.procs: list[LaunchedProcess] = []
        self.actors: list = []  # every actor created, started or not (all are killed at teardown)
        self.groups: list = []
        self.single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        self._checks = 0
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
             critical: bool) -> LaunchedProcess:
        ray = _ray()
        started = ray.get(actor.start.remote(name, cmd, {k: str(v) for k, v in env.items()}, os.getcwd()))
        p = LaunchedProcess(name=name, actor=actor, node=info["node_ip"], log_path=self.log_dir / f"{name}.log",
                            url=url, critical=critical, pid=started["pid"],
                            extra={"remote_log": started["log_path"], "offset": 0, "last_healthy": time.monotonic(),
                                   "warned_unhealthy": False})
        with self._lock:
            self.procs.append(p)
        log.info("started %s on %s (pid %d), log %s", name, p.node, p.pid, p.log_path)
        return p

    def start_servers(self, rollout_cfg, model_path: str, *, seed: int = 0, api_key: str | None = None
                      ) -> list[LaunchedProcess]:
        """``rollout.n_servers`` servers, one per bundle of a placement group; waits for health."""
        ray = _ray()
        r = rollout_cfg
        gpus, bundle = self._server_bundle(r)
        if gpus and ray.cluster_resources().get("GPU", 0) < gpus:
            raise ValueError(f"rollout: {r.server} servers need {gpus} GPU(s) each but the Ray cluster has "
                             f"{ray.cluster_resources().get('GPU', 0):g} (set rollout.device=cpu for CPU servers)")
        policy = getattr(r, "autoscale", None)
        if policy is not None and policy.enabled:  # before any server starts: the most it may start must fit
            self._check_policy_room(bundle, policy.max_servers)
        bundles = [bundle] * r.n_servers
        pg = self._placement_group(bundles, self.cfg.server_strategy, "servers")
        out = []
        env = server_env(r)
        with server_key_file(self.private_dir, api_key) as key_file:
            for i, (actor, info) in enumerate(self._hosts(pg, bundles, "server")):
                host = self.host_for(info["node_ip"])
                port = ray.get(actor.free_port.remote(host))
                cmd = server_command(r, model_path, host, port, seed=seed + i, api_key_file=key_file, python=PYTHON)
                out.append(self._run(actor, info, f"server{i}", cmd, {**env, HOST_ENV: host},
                                     f"http://{url_host(host)}:{port}", critical=False))
            self.wait_healthy(out, r.health_timeout)  # every server has read the key file
            return out

    def _check_policy_room(self, bundle: dict, max_servers: int) -> None:
        """``rollout.autoscale.max_servers`` server bundles against the cluster's resources: refused on a
        Ray the run started itself (its size is fixed); a warning on a cluster it connected to, which may
        add nodes on demand (an added server that cannot be placed fails its start after
        ``ray.placement_timeout``)."""
        ray = _ray()
        short = policy_shortfall(ray.cluster_resources(), bundle, max_servers)
        if not short:
            return
        msg = (f"rollout.autoscale.max_servers: {max_servers} servers of {bundle} each need "
               f"{'; '.join(short)}")
        if not (self.cfg.address or os.environ.get("RAY_ADDRESS")):
            raise ValueError(f"{msg}: lower it to what this Ray holds")
        log.warning("%s: servers past what it holds start only if the cluster adds nodes", msg)

    def _server_bundle(self, r) -> tuple[float, dict]:
        """A server's GPUs and the Ray resources of its bundle (CPUs, GPUs and ``server_resources``): the
        run's servers and a relaunched one are sized alike."""
        rc = self.cfg
        gpus = rc.gpus_per_server if rc.gpus_per_server is not None else gpus_per_server(r)
        return gpus, _resources(rc.cpus_per_server or float(r.threads_per_server), gpus, rc.server_resources)

    def private_dir(self) -> Path:
        """Where the API key file goes: ``secrets_dir``, or on a single node a private temporary one."""
        if self.secrets_dir is None:
            if not self.single_node:
                raise ValueError("RayLauncher on several nodes needs secrets_dir: a directory every node sees "
                                 "(run_train uses <experiment.output_dir>/.secrets), for the servers' API key file")
            self._own_secrets_dir = tempfile.mkdtemp(prefix="areal_fast_secrets_")  # mode 0700
            self.secrets_dir = Path(self._own_secrets_dir)
        return self.secrets_dir

    # ------------------------------------------------------------ one server (the elastic supervisor's)
    def start_server(self, rollout_cfg, model_path: str, slot: int, name: str, *, seed: int,
                     key_file: Path | None) -> LaunchedProcess:
        """One server on the Ray cluster now (not waiting for its health): a host actor in bundle
        ``slot`` of the run's server placement group (its previous actor killed: :meth:`release_dead`),
        or for a slot past it a new placement group of one bundle sized as the run's servers are
        (:meth:`start_servers`). ``elastic.supervisor`` relaunches servers through it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, r, rc = _ray(), rollout_cfg, self.cfg
        _, bundle = self._server_bundle(r)
        servers_pg = [g for g in self.groups if getattr(g, "bundle_count", 0) > slot and
                      ray.util.placement_group_table(g).get("name", "").endswith("-servers")]
        if servers_pg:
            pg, index = servers_pg[0], slot
        else:
            pg, index = self._placement_group([bundle], "PACK", name), 0
        actor = ray.remote(ProcessHost).options(
            name=f"areal-{self.run_id}-{name}", num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False),
        ).remote(self.node_log_dir)
        self.actors.append(actor)
        info = ray.get(actor.info.remote(), timeout=rc.placement_timeout)
        host = self.host_for(info["node_ip"])
        port = ray.get(actor.free_port.remote(host))
        cmd = server_command(r, model_path, host, port, seed=seed, api_key_file=key_file, python=PYTHON)
        return self._run(actor, info, name, cmd, {**server_env(r), HOST_ENV: host}, f"http://{url_host(host)}:{port}",
                         critical=False)

    def stop_process(self, p: LaunchedProcess, grace: float) -> None:
        """Stop one process now (SIGTERM, SIGKILL after ``grace``) through its host actor."""
        _ray().get(p.actor.stop.remote(grace), timeout=grace + 15)

    def release_dead(self, p: LaunchedProcess) -> None:
        """A dead server's Ray actor still holds its placement-group bundle: kill it, so the replacement
        can take the bundle (same node, same GPU)."""
        if p.actor is None:
            return
        try:
            _ray().kill(p.actor)
        except Exception as e:  # noqa: BLE001 - already gone
            log.info("killing the actor of dead server %s: %s", p.name, e)

    def start_trainer_ranks(self, train_cfg, config_file: Path, env: dict[str, str]) -> list[LaunchedProcess]:
        """``train.world_size`` trainer ranks reading ``config_file``, one per bundle (GPU ranks when
        ``train.device`` is cuda, or unset on a cluster with GPUs)."""
        ray = _ray()
        t = train_cfg
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        gpus = int(t.device == "cuda" or (t.device is None and cluster_gpus > 0))
        if gpus and cluster_gpus < t.world_size:
            raise ValueError(f"train: {t.world_size} GPU rank(s) requested but the Ray cluster has "
                             f"{cluster_gpus:g} GPU(s) (train.device=cpu runs the ranks on CPU)")
        return self.start_ranks(rank_command(config_file, python=PYTHON), t.world_size,
                                env={"OMP_NUM_THREADS": str(t.threads), **env},
                                cpus=self.cfg.cpus_per_rank or float(t.threads), gpus=gpus,
                                custom=self.cfg.rank_resources)

    def start_ranks(self, cmd: list[str], world_size: int, *, env: dict | None = None, cpus: float = 1.0,
                    gpus: int = 0, custom: dict | None = None) -> list[LaunchedProcess]:
        """``world_size`` copies of ``cmd`` with the torch.distributed rendezvous torchrun would give.

        Ranks are numbered node by node (the node of bundle 0 first), so LOCAL_RANK counts ranks on
        one node; with GPUs, CUDA_VISIBLE_DEVICES lists that node's rank GPUs in LOCAL_RANK order.
        World size 1 gets no rendezvous variables (the trainer then runs without a process group
        launcher, as in the local launcher)."""
        ray = _ray()
        bundles = [_resources(cpus, gpus, custom)] * world_size
        pg = self._placement_group(bundles, self.cfg.trainer_strategy, "trainers")
        hosts = self._hosts(pg, bundles, "rank")
        nodes = list(dict.fromkeys(info["node_id"] for _, info in hosts))
        hosts.sort(key=lambda h: nodes.index(h[1]["node_id"]))  # stable: bundle order within a node
        master = self.host_for(hosts[0][1]["node_ip"])
        port = ray.get(hosts[0][0].free_port.remote(master))
        out = []
        for rank, (actor, info) in enumerate(hosts):
            same = [h for h in hosts if h[1]["node_id"] == info["node_id"]]
            e = {**(env or {}), HOST_ENV: self.host_for(info["node_ip"])}
            if world_size > 1:
                e.update(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=same.index((actor, info)),
                         LOCAL_WORLD_SIZE=len(same), GROUP_RANK=nodes.index(info["node_id"]),
                         MASTER_ADDR=master, MASTER_PORT=port)
            if gpus:
                e["CUDA_VISIBLE_DEVICES"] = ",".join(g for h in same for g in h[1]["gpu_ids"])
            out.append(self._run(actor, info, f"trainer{rank}", cmd, e, None, critical=True))
        return out

    # ------------------------------------------------------------ watching
    def refresh(self, health: bool = False, timeout: float = 5.0, ready: bool = False) -> None:
        """Update exit codes (and health, for servers; ``ready``: whether /health answers 200) of the
        live processes from their actors."""
        ray = _ray()
        live = [p for p in self.procs if p.alive()]
        refs = {p.actor.poll.remote(p.url if health and p.url else None, ready): p for p in live}
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
                p.extra["last_healthy"] = time.monotonic()
            if st.get("ready"):
                p.extra["last_ready"] = time.monotonic()

    def wait_healthy(self, procs: list[LaunchedProcess], timeout: float) -> None:
        """Block until every process with a url answers 200 on /health; fail fast when one dies."""
        deadline = time.monotonic() + timeout
        pending = [p for p in procs if p.url]
        for p in pending:
            p.extra["last_healthy"] = p.extra["last_ready"] = 0.0
        while pending:
            t0 = time.monotonic()
            self.refresh(health=True, ready=True)
            for p in list(pending):
                if not p.alive():
                    raise ProcessDied(f"{p.death_message()}\n(it died while starting up)")
                if p.extra["last_ready"] >= t0:
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {', '.join(p.name for p in pending)}; "
                                   f"see logs in {self.log_dir}")
            time.sleep(0.2)

    def dead(self) -> list[LaunchedProcess]:
        """Processes that ended since the last call (each reported once; exit code 0 included)."""
        out = [p for p in self.procs if not p.reported and not p.alive()]
        for p in out:
            p.reported = True
        return out

    def check(self, health: bool | None = None) -> list[LaunchedProcess]:
        """Refresh; raise ProcessDied when a critical process failed or the last server is gone.

        Returns the processes that ended since the last call (finished critical ones with code 0,
        and dead servers, which are logged as warnings). ``health`` (default: every 10th call) also
        asks each server's /health; any answer counts, so a paused server is never reported."""
        if health is None:
            health = self._checks % _HEALTH_EVERY == 0
        self._checks += 1
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
            quiet = now - p.extra["last_healthy"]
            if health and p.alive() and not p.extra["warned_unhealthy"] and quiet > _UNHEALTHY_WARN_S:
                p.extra["warned_unhealthy"] = True
                log.warning("server %s (%s) has not answered /health for %.0f s", p.name, p.url, quiet)
        if servers and any(p.url for p in dead) and not any(p.alive() for p in servers):
            last = [p for p in dead if p.url][-1]
            raise ProcessDied(f"the last inference server died: {last.death_message()}")
        return dead

    # ------------------------------------------------------------ logs
    def pull_logs(self, procs: list[LaunchedProcess] | None = None) -> None:
        """Append what each process wrote since the last pull to ``<log_dir>/<name>.log``."""
        ray = _ray()
        procs = [p for p in (procs if procs is not None else list(self.procs)) if p.lost is None]
        refs = {p.actor.read_log.remote(p.extra["offset"]): p for p in procs}
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

    def _append(self, p: LaunchedProcess, data: bytes, offset: int) -> None:
        with self._lock:
            if data and offset > p.extra["offset"]:
                with open_private_log(p.log_path) as f:
                    f.write(data[len(data) - (offset - p.extra["offset"]):])
                p.extra["offset"] = offset

    def _pull_local(self, p: LaunchedProcess) -> None:
        remote = p.extra["remote_log"]
        if remote and os.path.isfile(remote):
            with open(remote, "rb") as f:
                f.seek(p.extra["offset"])
                data = f.read()
            self._append(p, data, p.extra["offset"] + len(data))

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
        if self._own_secrets_dir is not None:
            import shutil

            shutil.rmtree(self._own_secrets_dir, ignore_errors=True)
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
            if p.lost is not None and p.extra["remote_log"]:  # same machine: pulled by _pull_local already
                remove_log(p.extra["remote_log"])
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


# ----------------------------------------------------------------------------- the session


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


@contextmanager
def open_ray_launcher(ray_cfg: RayConfig, log_dir: Path, secrets_dir: Path | None = None):
    """Connect to (or start) Ray, make SIGTERM unwind like Ctrl-C, and yield a RayLauncher; on exit
    every process, actor and placement group of the run is gone, and a Ray started here is stopped.
    ``secrets_dir``: where the servers' API key file is written (a directory every node sees)."""
    handler = PrivateFileHandler(Path(log_dir) / "launcher.log") if not _logs_to(log_dir) else None
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("areal_fast").addHandler(handler)
    try:
        with ray_session(ray_cfg), _sigterm_as_exit(), \
                RayLauncher(log_dir, ray_cfg, secrets_dir=secrets_dir) as launcher:
            yield launcher
    finally:
        if handler is not None:
            logging.getLogger("areal_fast").removeHandler(handler)
            handler.close()


def _logs_to(log_dir: Path) -> bool:
    """Some handler of the package already writes launcher.log in ``log_dir`` (run_train sets one up)."""
    target = os.path.abspath(Path(log_dir) / "launcher.log")
    handlers = logging.getLogger().handlers + logging.getLogger("areal_fast").handlers
    return any(getattr(h, "baseFilename", None) == target for h in handlers)
