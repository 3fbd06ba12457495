"""``launcher: slurm`` against a real Slurm (``tests/real_slurm.py``: slurm-wlm's slurmctld and one
slurmd on this machine): the tiny recipe, shrunken, submitted with ``sbatch`` as the script
``areal-fast slurm-script`` writes.

- in one allocation: the server step's process is killed with SIGKILL and the run goes on, its
  relaunched step serving the current weights (strict staleness 1: the old weights' samples could
  not be trained); then the trainer step's rank is killed with SIGKILL, the job fails with its
  checkpoint complete, and the same script submitted again resumes: every step trained exactly once;
- servers and trainer ranks in separate allocations (``slurm.server_job``), the server count set by the
  policy (``rollout.autoscale``, ``docs/autoscale.md``) on the growing-answers task of
  ``test_autoscale_e2e.py``: it removes one of two server steps while answers are short (the step
  cancelled) and adds one back once they are long (a new step of the servers' allocation, which joins
  the pool), staleness within the bound and every prompt group trained once through both changes; then
  ``scancel`` of the run's job stops every step of both allocations, and no process of the run is left;
- the allocation ``areal-fast slurm-script`` writes for ``rollout.autoscale`` holds the policy's most
  server steps beside the trainer step, all running at once.

Each run starts from the session's warm start of the shrunken task (``tiny_warm_start``).
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
from e2e_runs import seed_run_dir
from test_autoscale_e2e import AUTOSCALE, _changes, _checkpointed, check_policy_run
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


def test_killed_server_step_is_relaunched_and_a_killed_trainer_resumes_exactly_once(tmp_path, real_slurm,
                                                                                   tiny_warm_start):
    out, steps = seed_run_dir(tiny_warm_start, tmp_path / "run"), 8
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


# In the allocation of the script: the launcher's steps of a server's and of the trainer's size, each a
# process that only waits, all started at once (``wait_started``), and the policy's room check against the
# job as scontrol describes it; the outcome written to <output_dir>/fit.json.
_FIT = """
import json, sys
from areal_fast.config import load_config
from areal_fast.launch import slurm

cfg = load_config(sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("--")])
out, most = cfg.experiment.out, cfg.rollout.autoscale.max_servers
launcher = slurm.SlurmLauncher(out / "logs", cfg.slurm, run_dir=out)
waits = {"kind": "ranks", "cmd": [sys.executable, "-c", "import time; time.sleep(600)"], "rendezvous": ""}
result = {}
try:
    cpus, gpus = slurm.server_step_size(cfg.slurm, cfg.rollout)
    steps = [launcher._launch(f"server{i}", launcher.server_job, waits, ntasks=1, cpus=cpus, gpus=gpus, extra=[],
                              env={}, critical=False) for i in range(most)]
    cpus, gpus = slurm.rank_step_size(cfg.slurm, cfg.train)
    steps.append(launcher._launch("trainer", launcher.job, waits, ntasks=cfg.train.world_size, cpus=cpus, gpus=gpus,
                                  extra=[], env={}, critical=True, nodes=None))
    launcher.wait_started(steps, timeout=60)  # a deadline, reached only when a step finds no room
    result["running"] = [p.step for p in steps]
    launcher._check_policy_room(cfg.rollout, most)
    try:
        launcher._check_policy_room(cfg.rollout, most + cfg.train.world_size + 1)
    except ValueError as e:
        result["refused"] = str(e)
except Exception as e:
    result["error"] = f"{type(e).__name__}: {e}"
finally:
    launcher.shutdown()
    (out / "fit.json").write_text(json.dumps(result))
"""


def test_the_allocation_of_slurm_script_holds_the_most_servers_the_policy_may_start(tmp_path, real_slurm):
    """``areal-fast slurm-script`` with ``rollout.autoscale`` sizes the allocation for ``max_servers``
    server steps beside the trainer step, not for the servers the run starts with: in the allocation it
    writes, steps of the launcher's sizes for all of them run at once (sized for the start, the added
    servers' steps would wait for room until ``slurm.start_timeout``), and the launcher's check of the
    policy's room reads the job's size from the real ``scontrol``: the most fits, more is refused."""
    out, probe = tmp_path / "run", tmp_path / "fit.py"
    probe.write_text(_FIT)
    script = _script(tmp_path, out, "rollout.n_servers=1", "rollout.autoscale.enabled=true",
                     "rollout.autoscale.max_servers=3")
    lines = script.read_text().splitlines()
    train = next(i for i, x in enumerate(lines) if x.startswith("exec "))
    assert " -m areal_fast.cli train " in lines[train], lines[train]
    lines[train] = lines[train].replace(" -m areal_fast.cli train ", f" {probe} ")  # the same config, the probe
    script.write_text("\n".join(lines) + "\n")
    job = _sbatch(real_slurm, script)
    _wait_gone(real_slurm, job)
    fit = json.loads((out / "fit.json").read_text()) if (out / "fit.json").is_file() else {"error": _job_out(out, job)}
    assert "error" not in fit, fit["error"]
    assert len(set(fit["running"])) == 4 and all(s.startswith(f"{job}.") for s in fit["running"]), fit
    assert "rollout.autoscale.max_servers: 5 server steps need CPU 5 (job" in fit["refused"], fit


def test_the_policy_removes_and_adds_server_steps_and_scancel_stops_every_step_of_both_allocations(
        tmp_path, real_slurm, tiny_warm_start):
    """Servers and trainer ranks in separate allocations (``slurm.server_job``), the server count set by
    the policy (``rollout.autoscale``, the growing-answers task of ``test_autoscale_e2e.py``): while the
    answers are short it removes one of the two server steps (its step cancelled), once they are long it
    adds one back, a new step of the servers' allocation that joins the pool; staleness within the bound
    on every step, every prompt group trained once or held at the last checkpoint. Then ``scancel`` of the
    run's job stops every step of both allocations, the added one included, and no process of the run is
    left."""
    # room for the policy's two server steps of 1 CPU and one more: the added step starts while the removed one
    # is still exiting (in an allocation with room for two, it waits for that: test_slurm.py)
    servers_job = real_slurm.run(["sbatch", "--parsable", "-n1", "-c3", f"--output={tmp_path}/holder-%j.out",
                                   "--wrap", "sleep 600"]).stdout.strip()
    out = seed_run_dir(tiny_warm_start, tmp_path / "run")
    try:
        script = _script(tmp_path, out, "experiment.total_steps=100000", f"slurm.server_job={servers_job}",
                         *AUTOSCALE)
        job = _sbatch(real_slurm, script)
        _wait(lambda: _step(out, "server0") and _step(out, "server1") and _step(out, "trainer"), real_slurm, job,
              "the trainer step", out=out)
        first, removed, trainer = _step(out, "server0"), _step(out, "server1"), _step(out, "trainer")
        assert first["step"].startswith(f"{servers_job}.") and removed["step"].startswith(f"{servers_job}.")
        assert trainer["step"].startswith(f"{job}.")
        _wait(lambda: [c["autoscale/change"] for c in _changes(out)][:1] == [-1], real_slurm, job,
              "the policy to remove a server", out=out)
        _wait(lambda: removed["step"] not in real_slurm.steps() and not proc_alive(removed["pid"]), real_slurm, job,
              "the removed server's step to end", out=out)
        _wait(lambda: [c["autoscale/change"] for c in _changes(out)][:2] == [-1, 1], real_slurm, job,
              "the policy to add one back", out=out)
        added_at = _changes(out)[1]["step"]

        def joined():
            return [e for e in _events(out) if e["step"] > added_at and e.get("sync/servers") == 2]

        _wait(joined, real_slurm, job, "the added server to join the pool", out=out)
        _wait(lambda: _checkpointed(out) >= joined()[0]["step"], real_slurm, job,
              "a checkpoint of a step on the grown pool", out=out)
        names = [m["name"] for m in json.loads((out / "servers" / "members.json").read_text())["servers"]]
        added = [_step(out, n) for n in names if n != "server0"]  # its slot's name, or the next free slot's
        assert len(added) == 1 and added[0]["step"].startswith(f"{servers_job}.") and \
            added[0]["step"] not in (first["step"], removed["step"]), (names, added)  # a new step of the servers' job
        assert sorted(real_slurm.steps()) == sorted([first["step"], added[0]["step"], trainer["step"]])

        real_slurm.run(["scancel", job])
        _wait_gone(real_slurm, job)
        pids = [first["pid"], added[0]["pid"], trainer["pid"]]
        deadline = time.monotonic() + 30
        while (real_slurm.steps() or any(proc_alive(p) for p in pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert real_slurm.steps() == [], real_slurm.run(["squeue", "-s"]).stdout
        assert not [p for p in pids if proc_alive(p)]
        assert servers_job in real_slurm.jobs()  # the other allocation itself is the user's
    finally:
        real_slurm.run(["scancel", servers_job], check=False)
    removal, addition = check_policy_run(out, added_at)
    assert "generation runs ahead" in removal["reason"] and "trainer idle" in addition["reason"]
