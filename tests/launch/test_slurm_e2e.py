"""``launcher: slurm`` against a real Slurm (``tests/real_slurm.py``: slurm-wlm's slurmctld and one
slurmd on this machine): the tiny recipe, shrunken, submitted with ``sbatch`` as the script
``areal-fast slurm-script`` writes.

- in one allocation: the server step's process is killed with SIGKILL and the run goes on, its
  relaunched step serving the current weights (strict staleness 1: the old weights' samples could
  not be trained); then the trainer step's rank is killed with SIGKILL, the job fails with its
  checkpoint complete, and the same script submitted again resumes: every step trained exactly once;
- servers and trainer ranks in separate allocations (``slurm.server_job``): ``scancel`` of the run's
  job stops every step of both, and no process of the run is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e import EXAMPLE, ROOT, TINY, _train_events

from areal_fast.checkpoint import HANG_AFTER_CHECKPOINT_ENV

pytestmark = pytest.mark.slow
TIMEOUT_S = 240  # imports of three interpreters, the warm start and a few steps on a busy 2-core machine
from bench.common import proc_alive  # noqa: E402


def _script(tmp_path: Path, out: Path, *extra: str) -> Path:
    r = subprocess.run([sys.executable, "-m", "areal_fast.cli", "slurm-script", EXAMPLE,
                        f"experiment.output_dir={out}", *TINY, "log.plots=false", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "job.sh"
    path.write_text(r.stdout)
    return path


def _sbatch(cluster, script: Path, env: dict | None = None) -> str:
    e = {k: v for k, v in os.environ.items() if k != HANG_AFTER_CHECKPOINT_ENV}
    r = subprocess.run(["sbatch", "--parsable", str(script)], env={**e, **cluster.env, **(env or {})},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _wait(pred, cluster, job: str, what: str, timeout: float = TIMEOUT_S, out: Path | None = None):
    deadline = time.monotonic() + timeout
    while not pred():
        if job not in cluster.jobs():
            raise AssertionError(f"job {job} ended before {what}: {_job_out(out, job)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {_job_out(out, job)}")
        time.sleep(0.2)


def _wait_gone(cluster, job: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while job in cluster.jobs():
        assert time.monotonic() < deadline, f"job {job} still there: {cluster.run(['squeue', '-s']).stdout}"
        time.sleep(0.2)


def _job_out(out: Path | None, job: str) -> str:
    try:
        return (out / f"slurm-{job}.out").read_text()[-3000:]
    except (OSError, TypeError):
        return "(no job output)"


def _step(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / "slurm" / f"{name}.step.json").read_text())
    except (OSError, ValueError):
        return None


def _events(out: Path) -> list[dict]:
    return _train_events(out) if (out / "metrics.jsonl").is_file() else []


def test_killed_server_step_is_relaunched_and_a_killed_trainer_resumes_exactly_once(tmp_path, real_slurm):
    out, steps = tmp_path / "run", 8
    script = _script(tmp_path, out, f"experiment.total_steps={steps}", "weights.method=distributed")
    # the first job holds still right after checkpoint steps - 1 (a test hook): the trainer kill lands there
    before = set(real_slurm.jobs())
    job = _sbatch(real_slurm, script, {HANG_AFTER_CHECKPOINT_ENV: str(steps - 1)})
    try:
        _killed_server_then_trainer(real_slurm, script, out, job, steps)
    finally:  # a failed check leaves no job of this test (the first or the resubmitted one) to the next
        for left in set(real_slurm.jobs()) - before:
            real_slurm.run(["scancel", left], check=False)


def _relaunched(out: Path) -> list[dict]:
    """The step files of server0's relaunches (``server0-<n>.step.json``)."""
    found = [_step(out, n.name[:-len(".step.json")]) for n in sorted((out / "slurm").glob("server0-*.step.json"))]
    return [s for s in found if s]


def _members(out: Path) -> list[str]:
    try:
        return [m["url"] for m in json.loads((out / "servers" / "members.json").read_text())["servers"]]
    except (OSError, ValueError, KeyError):
        return []


def _killed_server_then_trainer(real_slurm, script: Path, out: Path, job: str, steps: int) -> None:
    _wait(lambda: len(_events(out)) >= 1 and _step(out, "server0"), real_slurm, job, "step 1", out=out)
    first = _step(out, "server0")
    assert first["step"].startswith(f"{job}.")
    os.kill(first["pid"], signal.SIGKILL)
    killed_at, hold = _events(out)[-1]["step"], steps - 1
    # steps after the replacement joined come before the hold (the run trains a few steps between the first
    # step's record and the kill, more on a loaded machine: the hold is late enough to leave room)
    assert killed_at <= hold - 2, f"the server kill landed at step {killed_at}, too late to see its replacement"
    _wait(lambda: (out / "checkpoints" / f"step_{hold:08d}" / "COMPLETE").is_file(), real_slurm, job,
          f"checkpoint {hold} after the server kill", out=out)
    # the buffer may carry the run to checkpoint 5 before the relaunched step has started: the job
    # holds there, and the replacement joins during the hold
    _wait(lambda: _relaunched(out) and _members(out) == [f"http://127.0.0.1:{_relaunched(out)[0]['port']}"],
          real_slurm, job, "the relaunched server step in the pool", out=out)
    again = _relaunched(out)
    assert again[0]["pid"] != first["pid"] and again[0]["step"] != first["step"], "no relaunched step"
    after = [e for e in _events(out) if e["step"] > killed_at + 1]
    assert after and all(e["staleness_max"] <= 1 for e in after)  # served by the replacement, current weights

    trainer = _step(out, "trainer")
    assert trainer["step"].startswith(f"{job}.")
    os.kill(trainer["pid"], signal.SIGKILL)
    _wait_gone(real_slurm, job)
    assert not [s for s in real_slurm.steps() if s.startswith(f"{job}.")]
    assert not proc_alive(again[0]["pid"]), "the server step outlived the failed job"
    log = _job_out(out, job)
    assert "process 'trainer'" in log and "exited with code 137" in log, log
    assert (out / "checkpoints" / f"step_{hold:08d}" / "COMPLETE").is_file()

    job2 = _sbatch(real_slurm, script)  # the same script, submitted again
    _wait_gone(real_slurm, job2)
    log = _job_out(out, job2)
    resumed = [x for x in (out / "logs" / "trainer.log").read_text().splitlines() if "resuming from" in x]
    assert len(resumed) == 1 and f"step_{hold:08d}" in resumed[0], log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps, log
    assert [e["step"] for e in _events(out)] == list(range(1, steps + 1))
    positions = [p for e in _events(out) for p in e["positions"]]
    assert len(positions) == len(set(positions)) == steps * 2
    assert (out / "checkpoints" / f"step_{steps:08d}" / "COMPLETE").is_file()
    from areal_fast.launch.run_dir import is_checked_entry  # slurm/, slurm-<job>.out...: checked at a start

    assert all(is_checked_entry(p.name) for p in out.iterdir()), sorted(p.name for p in out.iterdir())
    assert not list((out / "slurm").glob("rendezvous-*")), "a rendezvous file outlived its launcher"


def test_scancel_stops_every_step_of_servers_and_trainers_in_separate_allocations(tmp_path, real_slurm):
    servers_job = real_slurm.run(["sbatch", "--parsable", "-n1", "-c2", f"--output={tmp_path}/holder-%j.out",
                                   "--wrap", "sleep 600"]).stdout.strip()
    out = tmp_path / "run"
    try:
        script = _script(tmp_path, out, "experiment.total_steps=100000", "checkpoint.every_steps=0",
                         f"slurm.server_job={servers_job}")
        job = _sbatch(real_slurm, script)
        _wait(lambda: _step(out, "server0") and _step(out, "trainer"), real_slurm, job, "the trainer step", out=out)
        server, trainer = _step(out, "server0"), _step(out, "trainer")
        assert server["step"].startswith(f"{servers_job}.") and trainer["step"].startswith(f"{job}.")
        real_slurm.run(["scancel", job])
        _wait_gone(real_slurm, job)
        deadline = time.monotonic() + 30
        while (real_slurm.steps() or proc_alive(server["pid"]) or proc_alive(trainer["pid"])) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert real_slurm.steps() == [], real_slurm.run(["squeue", "-s"]).stdout
        assert not proc_alive(server["pid"]) and not proc_alive(trainer["pid"])
        assert servers_job in real_slurm.jobs()  # the other allocation itself is the user's
    finally:
        real_slurm.run(["scancel", servers_job], check=False)
