"""A real Slurm in the test suite: Debian's ``slurm-wlm`` and ``munge`` installed with apt-get (once,
under a lock), and a one-node cluster on this machine started in a temporary directory: ``munged``
with a socket of its own, ``slurmctld`` and one ``slurmd``, configured by :func:`write_conf` (no
cgroups: process tracking by process group, ``select/cons_tres`` with cores as the consumable).

    with SlurmCluster(tmp_dir) as cluster:       # idle node on return (sinfo), everything stopped after
        env = cluster.env                        # SLURM_CONF: what srun, sbatch, squeue, scancel read
        subprocess.run(["sbatch", ...], env={**os.environ, **env})

Where the packages cannot be installed (no root, no apt-get, no network) the tests that need it
skip, saying why; with ``AREAL_FAST_REAL_SLURM=require`` (CI) they fail instead.
``python tests/real_slurm.py install`` installs the packages ahead of the tests (``.ci/run`` starts
it in the background); ``python tests/real_slurm.py up`` starts a cluster, prints its times and
stops it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REQUIRE_ENV = "AREAL_FAST_REAL_SLURM"
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scancel", "squeue")
INSTALL_TIMEOUT_S = 900
START_TIMEOUT_S = 60
LOCK = Path("/tmp/areal_fast_slurm_install.lock")
NODE_CPUS = 8  # declared, more than the machine's cores: steps are few processes that mostly wait
NODE_MEMORY_MB = 4096


class SlurmUnavailable(RuntimeError):
    """Slurm could not be installed or started here (the reason is the message)."""


def required() -> bool:
    """True where the real-Slurm tests must run (CI): they fail instead of skipping."""
    return os.environ.get(REQUIRE_ENV, "") == "require"


def _missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def install() -> float:
    """``apt-get install slurm-wlm munge`` unless their programs are already here; the seconds it took
    (waiting for a concurrent install included). Raises :class:`SlurmUnavailable` with the reason."""
    t0 = time.monotonic()
    try:
        lock = open(LOCK, "a")
    except OSError:  # another user's lock file: nothing of ours can be installing
        lock = None
    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent installer (.ci/run's early start) finishes first
        if not _missing():
            return time.monotonic() - t0
        if sys.platform != "linux" or shutil.which("apt-get") is None:
            raise SlurmUnavailable("no apt-get on this machine (Debian's slurm-wlm and munge are installed with it)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("installing slurm-wlm and munge needs root (apt-get); install them by hand")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if r.returncode != 0:  # the package lists may be missing or stale: update once and try again
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=INSTALL_TIMEOUT_S)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if r.returncode != 0:
            raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed (exit {r.returncode}): "
                                   f"{(r.stdout + r.stderr)[-1500:]}")
    if _missing():
        raise SlurmUnavailable(f"installed {PACKAGES}, but these programs are still missing: {_missing()}")
    return time.monotonic() - t0


def write_conf(root: Path, node: str, *, cpus: int = NODE_CPUS, memory_mb: int = NODE_MEMORY_MB) -> Path:
    """slurm.conf of a one-node cluster on this machine, every path under ``root``."""
    port = _free_port_pair()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=areal-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={port}",
        f"SlurmdPort={port + 1}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/pgid",  # no cgroups: they do not work in every container
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",  # the declared CPUs, whatever the machine has
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1",
        "MessageTimeout=20",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=60",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    return conf


def _free_port_pair() -> int:
    """A port p with p + 1 free too (slurmctld's and slurmd's)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 65535:
            with contextlib.suppress(OSError), socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
                return p
    raise SlurmUnavailable("no two consecutive free ports for slurmctld and slurmd")


class SlurmCluster:
    """One-node Slurm on this machine (module docstring); ``env``, ``node``, ``stop()``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.timings: dict[str, float] = {}
        self.conf: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd runs jobs as their users and must run as root; this is not root")
        for d in ("state", "spool", "munge"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        self.conf = write_conf(self.root, self.node)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._daemon("munged", ["munged", "-F", "--force", f"--socket={self.root / 'munge.socket'}",
                                f"--key-file={key}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                f"--log-file={self.root / 'munge' / 'munged.log'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait(lambda: (self.root / "munge.socket").exists(), "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(self._node_idle, f"node {self.node} idle in sinfo")
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, **(self.env if self.conf else {})}))
        log.close()

    def _node_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-n", self.node, "-o", "%t"], check=False)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, pred, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            for p in self.procs:
                if p.poll() is not None:
                    self.stop()
                    raise SlurmUnavailable(f"{p.args[0]} exited with {p.returncode} while waiting for {what}: "
                                           f"{self.logs()}")
            if time.monotonic() > deadline:
                self.stop()
                raise SlurmUnavailable(f"no {what} after {timeout:.0f} s: {self.logs()}")
            time.sleep(0.2)

    def logs(self, n: int = 1500) -> str:
        out = []
        for name in ("munged.out", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            with contextlib.suppress(OSError):
                out.append(f"--- {name}:\n{(self.root / name).read_text(errors='replace')[-n:]}")
        return "\n".join(out)

    def run(self, cmd: list[str], check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited with {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still knows as pending or running."""
        return self.run(["squeue", "-h", "-o", "%i", "-t", "PD,R,CG"]).stdout.split()

    def steps(self) -> list[str]:
        """Ids of the running job steps (JOB.STEP), the batch and extern steps left out."""
        return [s for s in self.run(["squeue", "-h", "-s", "-o", "%i"]).stdout.split()
                if s.split(".")[-1].isdigit()]

    def cancel_all(self) -> None:
        with contextlib.suppress(Exception):
            self.run(["scancel", "--full", "-u", str(os.getuid())], check=False)

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, SIGKILL after 10 s), slurmd first."""
        if self.conf is not None and self.procs:
            self.cancel_all()
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        self.procs = []

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def skip_or_fail(why: str):
    """``pytest.skip`` with ``why``, or a failure where the real-Slurm tests must run (CI)."""
    import pytest

    if required():
        pytest.fail(f"real Slurm is required here ({REQUIRE_ENV}=require) but: {why}", pytrace=False)
    pytest.skip(f"real Slurm not available: {why}")


if __name__ == "__main__":
    if sys.argv[1:] not in (["install"], ["up"]):
        sys.exit("usage: python tests/real_slurm.py install|up")
    try:
        print(f"slurm-wlm and munge installed ({install():.0f} s)", flush=True)
        if sys.argv[1] == "up":
            import tempfile

            with tempfile.TemporaryDirectory(prefix="real_slurm-") as d, SlurmCluster(d) as c:
                print(f"one-node Slurm up in {c.timings['start_s']:.1f} s:", c.run(["sinfo"]).stdout, flush=True)
    except SlurmUnavailable as e:
        sys.exit(f"real Slurm: {e}")
