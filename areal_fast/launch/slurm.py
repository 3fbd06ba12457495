"""Slurm launcher: the ``Launcher`` of ``launch.base`` on a Slurm allocation (``launcher: slurm``).
``launch.train.run_train`` drives it exactly as it drives the local and the Ray launcher; it differs
from the local one (which it extends) only in how a process starts and how its address is learnt.

::

    areal-fast train (this process: the batch script of `sbatch`, or a shell inside `salloc`)
      |-- srun --jobid=<slurm.server_job or slurm.job or $SLURM_JOB_ID> -N1 -n1 -c C --exact [--gpus-per-task G]
      |     `-- python -m areal_fast.launch.slurm <output_dir>/slurm/server0.json        (one step per server)
      |           picks a free port on its node, writes <output_dir>/slurm/server0.step.json
      |           (node, address, port, step id, pid) and becomes the server (exec)
      `-- srun --jobid=<slurm.job or $SLURM_JOB_ID> -n world_size -c C --exact --kill-on-bad-exit=1
            `-- python -m areal_fast.launch.slurm <output_dir>/slurm/trainer.json   (one step, every rank)
                  rank 0 (SLURM_PROCID 0) picks the rendezvous port and writes it under <output_dir>/slurm
                  (a file named for this launch: a requeued job never reads the previous attempt's),
                  every rank reads it and becomes ``python -m areal_fast.launch.rank`` with what torchrun
                  would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)

Each step is watched through its ``srun`` (a child of this process, its output in
``<output_dir>/logs/<name>.log``, 0600): ``srun`` exits when its step ends, with the step's exit
code (137 for a task killed with SIGKILL). No address is known before a step starts, so nothing is
put on a command line but the spec file's path: the step writes its address into the run directory,
which every node sees (the output directory must be on a shared file system, as for Ray). The API
key travels as elsewhere: servers read it from a private file under ``<output_dir>/.secrets``
(removed once they are healthy), rank processes from their environment, which ``srun`` hands to the
step (``--export=ALL``) and no other user can read.

Failures are those of the local launcher: a server step that ends is relaunched by the server
supervisor (``elastic.supervisor``) and rejoins at the next weight update; the trainer step ending with
an error fails the run (``ProcessDied``), the checkpoints stay, and the same command resumes. A step
is stopped with ``scancel --signal=TERM JOB.STEP``, then ``scancel JOB.STEP`` (SIGKILL) after
``slurm.grace`` seconds: killing ``srun`` alone would leave its step running. ``scancel`` of the job
ends every step; the launcher, in the batch script, gets SIGTERM and stops the steps it started in
other allocations (``slurm.server_job``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from areal_fast.elastic.members import read_json, write_json
from areal_fast.launch.base import (
    HOST_ENV,
    SBATCH_OUTPUT,
    STEPS_DIR,
    LaunchedProcess,
    ProcessDied,
    gpus_per_server,
    open_private_log,
    rank_command,
    server_command,
    server_env,
)
from areal_fast.launch.local import LocalLauncher
from areal_fast.launch_config import SlurmConfig
from areal_fast.netutil import find_free_port, url_host
from areal_fast.procutil import die_with_parent

log = logging.getLogger(__name__)
RENDEZVOUS_PREFIX = "rendezvous-"  # in STEPS_DIR: rank 0's address, one file per launch of the trainer step
_POLL_S = 0.1
_RENDEZVOUS_TIMEOUT_S = 600.0
_ENV_PREFIXES = ("SLURM_", "SRUN_", "SALLOC_", "SBATCH_")  # an allocation's settings, not a step's

__all__ = ["SlurmLauncher", "SlurmStep", "batch_script", "job_ids", "rank_step_size", "server_step_size",
           "srun_command"]


class SlurmStep(LaunchedProcess):
    """One job step, watched through its ``srun`` on this machine (``extra['srun']``). ``pid`` is the
    step's first task on its node (``node``) once it has started; ``step`` its ``JOB.STEP`` id."""

    def alive(self) -> bool:
        srun = self.extra.get("srun")
        if srun is not None and self.returncode is None:
            self.returncode = srun.poll()
        return self.returncode is None and self.lost is None

    @property
    def step(self) -> str | None:
        return self.extra.get("step")

    def kill(self) -> None:
        """SIGKILL every task of the step now (a hung server: ``elastic.supervisor.kill_now``)."""
        _scancel(self, "KILL")


def _scancel(p: SlurmStep, sig: str | None) -> None:
    if p.step is None:  # not started yet: srun gives up on the step it waits for
        srun = p.extra.get("srun")
        if srun is not None and srun.poll() is None:
            srun.send_signal(signal.SIGTERM if sig != "KILL" else signal.SIGKILL)
        return
    cmd = ["scancel", *(["--signal", sig] if sig else []), p.step]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_client_env())
    if r.returncode != 0 and "already completed" not in r.stderr and "Invalid job id" not in r.stderr:
        log.warning("%s: %s", shlex.join(cmd), (r.stdout + r.stderr).strip()[-500:])


def _client_env(extra: dict | None = None) -> dict[str, str]:
    """This process's environment without the allocation's SLURM_* settings (SLURM_CONF kept): a step
    gets its size from the launcher's srun options alone, whatever allocation this process is in."""
    env = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(_ENV_PREFIXES)}
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def job_ids(cfg: SlurmConfig, environ=os.environ) -> tuple[str, str]:
    """(the servers' job id, the trainer ranks' job id): ``slurm.server_job`` / ``slurm.job``, else the
    job this process runs in. ValueError naming the keys when there is none."""
    job = cfg.job or environ.get("SLURM_JOB_ID")
    if not job:
        raise ValueError("launcher 'slurm': no allocation to run in. Run inside one (sbatch the script of "
                         "`areal-fast slurm-script CONFIG`, or salloc), or name its job id in slurm.job")
    return cfg.server_job or job, job


def job_resources(job: str) -> dict[str, int]:
    """The CPUs and GPUs of allocation ``job`` (``scontrol show job -o``: NumCPUs, the TRES' gres/gpu);
    {} when scontrol does not answer."""
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60,
                           env=_client_env())
    except (OSError, subprocess.SubprocessError):
        return {}
    if r.returncode != 0:
        return {}
    fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
    out = {}
    if fields.get("NumCPUs", "").isdigit():
        out["CPU"] = int(fields["NumCPUs"])
    tres = dict(t.split("=", 1) for t in fields.get("TRES", "").split(",") if "=" in t)
    typed = [v for k, v in tres.items() if k.startswith("gres/gpu:")]  # gres/gpu:a100=2 without gres/gpu
    gpus = [tres["gres/gpu"]] if "gres/gpu" in tres else typed
    if fields.get("TRES") and all(g.isdigit() for g in gpus):
        out["GPU"] = sum(int(g) for g in gpus)
    return out


def srun_command(job: str, name: str, spec: Path, *, ntasks: int, cpus: int, gpus: int, extra: list[str],
                 nodes: int | None = 1, python: str = sys.executable) -> list[str]:
    """The ``srun`` of one step: ``ntasks`` tasks of ``cpus`` CPUs (and ``gpus`` GPUs) each, only
    those (``--exact``: the steps of an allocation do not wait on each other), every task gone when
    one fails; the program is this module reading ``spec``."""
    cmd = ["srun", f"--jobid={job}", f"--job-name={name}", f"--ntasks={ntasks}", f"--cpus-per-task={cpus}",
           "--exact", "--kill-on-bad-exit=1", "--export=ALL"]
    if nodes is not None:
        cmd.append(f"--nodes={nodes}")
    if gpus:
        cmd.append(f"--gpus-per-task={gpus}")
    return [*cmd, *extra, python, "-m", "areal_fast.launch.slurm", str(spec)]


def server_step_size(c: SlurmConfig, rollout_cfg) -> tuple[int, int]:
    """(CPUs, GPUs) of one server step: ``slurm.cpus_per_server`` / ``gpus_per_server``, else from the
    rollout config (threads per server; the tensor-parallel size, 1 for a CUDA embedded engine, 0)."""
    return (c.cpus_per_server or rollout_cfg.threads_per_server,
            c.gpus_per_server if c.gpus_per_server is not None else gpus_per_server(rollout_cfg))


def rank_step_size(c: SlurmConfig, train_cfg) -> tuple[int, int]:
    """(CPUs, GPUs) of each trainer rank's task: ``slurm.cpus_per_rank`` / ``gpus_per_rank``, else the
    trainer's threads and one GPU with ``train.device: cuda``."""
    return c.cpus_per_rank or train_cfg.threads, c.gpus_per_rank if c.gpus_per_rank is not None else \
        int(train_cfg.device == "cuda")


class SlurmLauncher(LocalLauncher):
    """Owns the job steps of one run (module docstring)."""

    def __init__(self, log_dir: str | Path, cfg: SlurmConfig | None = None, *, run_dir: str | Path,
                 secrets_dir: str | Path | None = None):
        self.cfg = cfg or SlurmConfig()
        self.server_job, self.job = job_ids(self.cfg)
        super().__init__(log_dir, secrets_dir=secrets_dir)
        self.steps_dir = Path(run_dir) / STEPS_DIR
        self.steps_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ starting
    def _launch(self, name: str, job: str, spec: dict, *, ntasks: int, cpus: int, gpus: int, extra: list[str],
                env: dict, critical: bool, nodes: int | None = 1) -> SlurmStep:
        """Write ``spec`` and start its step with ``srun`` (output to ``<log_dir>/<name>.log``)."""
        spec_path = self.steps_dir / f"{name}.json"
        started = self.steps_dir / f"{name}.step.json"
        started.unlink(missing_ok=True)  # a previous run's: this step writes its own
        write_json(spec_path, {**spec, "started_file": str(started), "host": self.cfg.host})
        cmd = srun_command(job, name, spec_path, ntasks=ntasks, cpus=cpus, gpus=gpus, extra=extra, nodes=nodes)
        log_path = self.log_dir / f"{name}.log"
        with open_private_log(log_path) as f:
            f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
            srun = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_client_env(env),
                                    start_new_session=True, preexec_fn=die_with_parent)
        p = SlurmStep(name=name, log_path=log_path, critical=critical, pid=None, node="(pending)")
        p.extra.update(srun=srun, started_file=started, job=job)
        self.procs.append(p)
        log.info("started step %s of job %s (srun pid %d), log %s", name, job, srun.pid, log_path)
        return p

    def wait_started(self, steps: list[SlurmStep], timeout: float | None = None) -> None:
        """Block until each step has written where it runs (node, pid, step id; a server its URL).
        Meanwhile a step this launcher signalled to stop (``begin_stop``) that still runs past
        ``slurm.grace`` is killed: in an allocation sized for the servers it may hold the room the new
        step waits for (a removal followed by an addition), and the caller (the server supervisor's
        thread, which would kill it itself) is blocked here."""
        limit = self.cfg.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pending = list(steps)
        while pending:
            self._kill_late_stops()
            for p in list(pending):
                info = read_json(p.extra["started_file"])
                if info:
                    p.node, p.pid, p.extra["step"] = info["node"], info["pid"], info["step"]
                    p.extra["this_machine"] = _here(info)  # its pid can be looked up (``port_owner``)
                    if info.get("port"):
                        p.url = f"http://{url_host(info['host'])}:{info['port']}"
                    pending.remove(p)
                elif not p.alive():
                    raise ProcessDied(f"{p.death_message()}\n(its step ended before it started)")
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                for p in pending:
                    self.stop_process(p, 0)
                raise TimeoutError(f"slurm steps not started after {limit:.0f}s (slurm.start_timeout):"
                                   f" {names}; is the allocation big enough? see {self.log_dir}")
            if pending:
                time.sleep(_POLL_S)

    def start_server(self, rollout_cfg, model_path: str, slot: int, name: str, *, seed: int,
                     key_file: Path | None) -> SlurmStep:
        """One server as a step of ``slurm.server_job`` (or the run's job), returned once it knows its
        address, not waiting for its health (``elastic.supervisor`` starts replacements with it)."""
        p = self._start_server_step(rollout_cfg, model_path, name, seed=seed, key_file=key_file)
        p.extra["slot"] = slot
        self.wait_started([p])
        return p

    def _start_server_step(self, rollout_cfg, model_path: str, name: str, *, seed: int,
                           key_file: Path | None) -> SlurmStep:
        from areal_fast.config import to_dict

        cpus, gpus = server_step_size(self.cfg, rollout_cfg)
        spec = {"kind": "server", "rollout": to_dict(rollout_cfg), "model": model_path, "seed": seed,
                "key_file": str(key_file) if key_file else None}
        return self._launch(name, self.server_job, spec, ntasks=1, cpus=cpus, gpus=gpus,
                            extra=list(self.cfg.server_srun_args), env=server_env(rollout_cfg), critical=False)

    def start_servers(self, rollout_cfg, model_path: str, *, seed: int = 0, api_key: str | None = None
                      ) -> list[LaunchedProcess]:
        """``rollout.n_servers`` server steps, healthy on return (the key in a private file removed then)."""
        from areal_fast.launch.base import server_key_file

        policy = getattr(rollout_cfg, "autoscale", None)
        if policy is not None and policy.enabled:  # before any step starts: the most it may start must fit
            self._check_policy_room(rollout_cfg, policy.max_servers)
        with server_key_file(self.private_dir, api_key) as key_file:
            out = [self._start_server_step(rollout_cfg, model_path, f"server{i}", seed=seed + i, key_file=key_file)
                   for i in range(rollout_cfg.n_servers)]
            for i, p in enumerate(out):
                p.extra["slot"] = i
            self.wait_started(out)
            self.wait_healthy(out, rollout_cfg.health_timeout)  # the port checked on this machine's steps
            return out

    def _check_policy_room(self, rollout_cfg, max_servers: int) -> None:
        """``rollout.autoscale.max_servers`` server steps against the CPUs and GPUs of the servers' job
        (``scontrol show job``): refused, naming the key, when they cannot all fit (the trainer step of
        the same job needs room besides). Unknown sizes (scontrol failed) are let through."""
        cpus, gpus = server_step_size(self.cfg, rollout_cfg)
        need = {"CPU": max_servers * cpus, "GPU": max_servers * gpus}
        have = job_resources(self.server_job)
        short = [f"{k} {v} (job {self.server_job} has {have[k]})" for k, v in need.items()
                 if v and k in have and v > have[k]]
        if short:
            raise ValueError(f"rollout.autoscale.max_servers: {max_servers} server steps need {'; '.join(short)}: "
                             "lower it, or run in a larger allocation (`areal-fast slurm-script` sizes one for "
                             "max_servers)")

    def start_trainer_ranks(self, train_cfg, config_file: Path, env: dict[str, str]) -> list[LaunchedProcess]:
        """``train.world_size`` ranks as one step of ``slurm.job`` (or the run's job); a rank that fails
        ends the step (``--kill-on-bad-exit``)."""
        t = train_cfg
        cpus, gpus = rank_step_size(self.cfg, t)
        spec = {"kind": "ranks", "cmd": rank_command(config_file), "rendezvous": str(self._fresh_rendezvous())}
        p = self._launch("trainer", self.job, spec, ntasks=t.world_size, cpus=cpus, gpus=gpus,
                         extra=list(self.cfg.rank_srun_args), env={"OMP_NUM_THREADS": str(t.threads), **env},
                         critical=True, nodes=None)
        self.wait_started([p])
        return [p]

    def _fresh_rendezvous(self) -> Path:
        """Where rank 0 of the trainer step about to start publishes its address: a name of this launch
        alone (the job, its attempt ``$SLURM_RESTART_COUNT`` and a random part), every earlier one
        removed first. A requeued job keeps its id and numbers its steps from 0 again, so a name made
        of the job and step ids would be the previous attempt's, address included, read by the ranks
        above 0 before rank 0 rewrites it."""
        import secrets

        self._remove_rendezvous()
        attempt = os.environ.get("SLURM_RESTART_COUNT") or "0"
        return self.steps_dir / f"{RENDEZVOUS_PREFIX}{self.job}.{attempt}.{secrets.token_hex(4)}.json"

    def _remove_rendezvous(self) -> None:
        for old in self.steps_dir.glob(f"{RENDEZVOUS_PREFIX}*.json"):
            old.unlink(missing_ok=True)

    # ------------------------------------------------------------ stopping
    def begin_stop(self, p: LaunchedProcess) -> None:
        """SIGTERM the step's tasks (``scancel --signal=TERM``) and return at once (``elastic.supervisor``
        watches its srun end and SIGKILLs the step past its grace period; so does ``wait_started``)."""
        if p.alive():
            _scancel(p, "TERM")
            p.extra["stop_sent"] = time.monotonic()

    def _kill_late_stops(self) -> None:
        """SIGKILL (``scancel``) every step signalled by ``begin_stop`` more than ``slurm.grace`` ago that
        still runs."""
        now = time.monotonic()
        for p in self.procs:
            sent = p.extra.get("stop_sent")
            if sent is not None and now - sent > self.cfg.grace and p.alive():
                log.warning("step %s (%s) still runs %.0f s after SIGTERM (slurm.grace): killed", p.name, p.step,
                            now - sent)
                del p.extra["stop_sent"]
                _scancel(p, "KILL")

    def stop_process(self, p: LaunchedProcess, grace: float | None = None) -> None:
        """SIGTERM the step's tasks (``scancel --signal=TERM``), SIGKILL them after ``grace`` seconds,
        then wait for its srun."""
        grace = self.cfg.grace if grace is None else grace
        srun = p.extra.get("srun")
        for sig, wait in (("TERM", grace), (None, 30.0)):
            if not p.alive():
                break
            _scancel(p, sig)
            deadline = time.monotonic() + wait
            while p.alive() and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        if srun is not None and srun.poll() is None:  # the step is gone, srun did not notice
            srun.kill()
            srun.wait()
            p.alive()

    def shutdown(self) -> None:
        """Every step stopped (TERM to all at once, KILL after the grace period), every srun gone."""
        if self._closed:
            return
        self._closed = True
        live = [p for p in self.procs if p.alive()]
        for p in live:
            _scancel(p, "TERM")
        deadline = time.monotonic() + self.cfg.grace
        while any(p.alive() for p in live) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for p in live:
            self.stop_process(p, 0)
        self._remove_rendezvous()  # every rank read it, or the step is gone
        if self._own_secrets_dir is not None:
            import shutil

            shutil.rmtree(self._own_secrets_dir, ignore_errors=True)
        import atexit

        atexit.unregister(self.shutdown)

    def __enter__(self) -> SlurmLauncher:
        return self


# ----------------------------------------------------------------------------- the sbatch script


def batch_script(cfg, config_path: str, overrides: list[str], *, python: str = sys.executable,
                 cwd: str | None = None) -> str:
    """The ``sbatch`` script of a run (``areal-fast slurm-script``): an allocation for the servers
    and trainer ranks of ``cfg`` and ``areal-fast train`` inside it. Submitting it again resumes."""
    s, r, t = cfg.slurm, cfg.rollout, cfg.train
    launched = not r.servers
    # with the server-count policy the allocation holds the most servers it may start: a step past the
    # allocation would wait for room until slurm.start_timeout
    most = r.autoscale.max_servers if r.autoscale.enabled else r.n_servers
    n_servers = most if launched and not s.server_job else 0
    cpus_server, gpus_server = server_step_size(s, r)  # the steps' own sizes (``SlurmLauncher``)
    cpus_rank, gpus_rank = rank_step_size(s, t)
    out = cfg.experiment.out.resolve()
    out.mkdir(parents=True, exist_ok=True)  # sbatch opens its --output there before the script runs
    lines = ["#!/bin/bash", f"#SBATCH --job-name=areal-{cfg.experiment.name}", f"#SBATCH --nodes={s.nodes}",
             f"#SBATCH --ntasks={n_servers + t.world_size}",
             f"#SBATCH --cpus-per-task={max(cpus_rank, cpus_server if n_servers else 1)}",
             f"#SBATCH --output={out}/{SBATCH_OUTPUT}"]
    gpus = n_servers * gpus_server + t.world_size * gpus_rank
    if gpus:
        lines.append(f"#SBATCH --gpus={gpus}")
    if s.time:
        lines.append(f"#SBATCH --time={s.time}")
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    lines += [f"#SBATCH {a}" for a in s.sbatch_args]
    train = [python, "-m", "areal_fast.cli", "train", str(Path(config_path).resolve()), *overrides, "--no-progress"]
    if cfg.launcher != "slurm":
        train.append("launcher=slurm")
    lines += ["", "# written by `areal-fast slurm-script`; submitting it again resumes the run from its newest "
              "checkpoint", "set -eu", f"cd {shlex.quote(cwd or os.getcwd())}",
              f"exec {shlex.join(train)}", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- on the node


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _namespaces() -> dict[str, str]:
    """This process's pid and network namespaces (``pid:[4026531836]``), where /proc tells them."""
    out = {}
    for ns in ("pid", "net"):
        try:
            out[f"{ns}ns"] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            pass
    return out


def _here(info: dict) -> bool:
    """A step's start record (``_started``) was written on this machine, in this process's pid and
    network namespaces: its pid and its listening socket can be looked up in this ``/proc``."""
    return info.get("boot_id") == _boot_id() and all(info.get(k) == v for k, v in _namespaces().items())


def node_address(host: str | None) -> str:
    """Where this node's processes listen and are reached: ``slurm.host``, else the address its
    hostname resolves to (127.0.0.1 when it resolves to nothing)."""
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks of node ``node_id`` in Slurm's compressed list (SLURM_STEP_TASKS_PER_NODE: '2(x3),1')."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"tasks per node: cannot read {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id]


def _started(spec: dict, environ=os.environ, **info) -> None:
    env = environ
    write_json(Path(spec["started_file"]), {"node": socket.gethostname(), "pid": os.getpid(), "boot_id": _boot_id(),
                                            **_namespaces(),
                                            "step": f"{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}", **info})


def _exec(cmd: list[str], env: dict) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, {**os.environ, **{k: str(v) for k, v in env.items()}})


def run_server(spec: dict) -> None:
    """The server of ``spec`` on this node: a free port, the address written, then the server itself."""
    from areal_fast.config import from_dict
    from areal_fast.rollout.config import RolloutConfig

    r = from_dict(RolloutConfig, spec["rollout"])
    host = node_address(spec.get("host"))
    port = find_free_port(host)
    cmd = server_command(r, spec["model"], host, port, seed=spec["seed"], api_key_file=spec["key_file"])
    _started(spec, host=host, port=port)
    _exec(cmd, {HOST_ENV: host})


def run_rank(spec: dict, environ=os.environ) -> None:
    """One trainer rank: the rendezvous torchrun would give, learnt from Slurm and rank 0's file."""
    rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    host = node_address(spec.get("host"))
    env = {HOST_ENV: host}
    if rank == 0:
        _started(spec, environ, host=host)
    if world > 1:
        node_id = int(environ["SLURM_NODEID"])
        rdv = Path(spec["rendezvous"])  # named by the launcher for this launch alone (``_fresh_rendezvous``)
        if rank == 0:
            write_json(rdv, {"addr": host, "port": find_free_port(host)})
        deadline = time.monotonic() + _RENDEZVOUS_TIMEOUT_S
        while (meet := read_json(rdv)) is None:
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: rank 0 wrote no rendezvous file {rdv} in {_RENDEZVOUS_TIMEOUT_S:.0f}s")
            time.sleep(_POLL_S)
        env.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=environ["SLURM_LOCALID"],
                   LOCAL_WORLD_SIZE=tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], node_id),
                   GROUP_RANK=node_id, MASTER_ADDR=meet["addr"], MASTER_PORT=meet["port"])
    _exec(spec["cmd"], env)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m areal_fast.launch.slurm SPEC_FILE (run by srun: see areal_fast/launch/slurm.py)")
    spec = json.loads(Path(argv[0]).read_text())
    {"server": run_server, "ranks": run_rank}[spec["kind"]](spec)


if __name__ == "__main__":
    main()
