"""The Slurm launcher's parts that need no Slurm (``areal_fast/launch/slurm.py``); the launcher against a
real Slurm is ``test_slurm_e2e.py``.

- the config: job ids, srun options the launcher sets itself, and YAML's seconds for ``slurm.time``
  are refused or read with the key named;
- the allocation: none is refused naming ``slurm.job``; servers go to ``slurm.server_job`` when set;
- an ``srun`` line holds sizes and the spec file's path, nothing else: no key, no address; a step
  gets its size from those options alone, not from the allocation's SLURM_* settings;
- a trainer rank's rendezvous: rank 0 publishes its address, the others read it, each gets what
  torchrun would set (its node's share of the tasks read from Slurm's compressed list); a requeued
  job's ranks never read the previous attempt's address;
- a hung server step is killed with ``scancel`` (killing its srun would leave the step running); a removed
  server step that outlives its grace is killed while an added one waits for its room;
- ``areal-fast slurm-script`` writes an sbatch script sized for the run that resumes it when
  submitted again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_fast.config import ConfigError, load_config
from areal_fast.launch import slurm
from areal_fast.launch_config import SlurmConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"


@pytest.mark.parametrize("override, needle", [
    ("slurm.job=abc", "slurm.job: expected a Slurm job id"),
    ('slurm.server_srun_args=["--ntasks=4"]', "slurm.server_srun_args: --ntasks is set by the launcher"),
    ('slurm.rank_srun_args=["-c", "2"]', "slurm.rank_srun_args: -c is set by the launcher"),
    ('slurm.sbatch_args=["account=x"]', "slurm.sbatch_args: expected options"),
    ("slurm.cpus_per_server=0", "slurm.cpus_per_server: must be >= 1"),
    ("launcher=slurmm", "launcher: must be one of"),
])
def test_bad_slurm_keys_are_refused_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        load_config(EXAMPLE, [override])


def test_yaml_seconds_for_the_time_limit_become_hours_minutes_seconds():
    assert load_config(EXAMPLE, ["slurm.time=24:00:00"]).slurm.time == "24:00:00"  # YAML 1.1 read 86400
    assert load_config(EXAMPLE, ['slurm.time="2-00:00:00"']).slurm.time == "2-00:00:00"
    assert load_config(EXAMPLE, ["slurm.job=4242"]).slurm.job == "4242"


def test_no_allocation_is_refused_naming_the_key_and_servers_may_have_their_own():
    with pytest.raises(ValueError, match="slurm.job"):
        slurm.job_ids(SlurmConfig(), environ={})
    assert slurm.job_ids(SlurmConfig(), environ={"SLURM_JOB_ID": "7"}) == ("7", "7")
    assert slurm.job_ids(SlurmConfig(server_job="8"), environ={"SLURM_JOB_ID": "7"}) == ("8", "7")
    assert slurm.job_ids(SlurmConfig(job="9"), environ={"SLURM_JOB_ID": "7"}) == ("9", "9")


def test_srun_line_holds_sizes_and_the_spec_path_and_steps_ignore_the_allocations_settings(monkeypatch):
    cmd = slurm.srun_command("12", "server0", Path("/runs/a/slurm/server0.json"), ntasks=1, cpus=4, gpus=2,
                             extra=["--mem=8G"], python="/venv/bin/python")
    assert cmd[:2] == ["srun", "--jobid=12"] and "--exact" in cmd and "--gpus-per-task=2" in cmd
    assert cmd[-4:] == ["/venv/bin/python", "-m", "areal_fast.launch.slurm", "/runs/a/slurm/server0.json"]
    assert "--mem=8G" in cmd and "--cpus-per-task=4" in cmd
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "32")
    monkeypatch.setenv("SLURM_NTASKS", "9")
    monkeypatch.setenv("SLURM_CONF", "/etc/x/slurm.conf")
    env = slurm._client_env({"OMP_NUM_THREADS": 1})
    assert "SLURM_CPUS_PER_TASK" not in env and "SLURM_NTASKS" not in env
    assert env["SLURM_CONF"] == "/etc/x/slurm.conf" and env["OMP_NUM_THREADS"] == "1"


def test_tasks_per_node_reads_slurms_compressed_list():
    assert [slurm.tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="cannot read"):
        slurm.tasks_on_node("2x3", 0)


def test_rank_rendezvous_through_the_run_directory(tmp_path, monkeypatch):
    execs = []
    monkeypatch.setattr(slurm, "_exec", lambda cmd, env: execs.append((cmd, env)))
    spec = {"kind": "ranks", "cmd": ["python", "-m", "areal_fast.launch.rank", "cfg.yaml"], "host": "127.0.0.1",
            "started_file": str(tmp_path / "trainer.step.json"), "rendezvous": str(tmp_path / "rendezvous-5.0.ab.json")}
    step = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
    slurm.run_rank(spec, {**step, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    slurm.run_rank(spec, {**step, "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"})
    (cmd0, env0), (cmd2, env2) = execs
    assert cmd0 == spec["cmd"] == cmd2
    assert env0["MASTER_ADDR"] == env2["MASTER_ADDR"] == "127.0.0.1" and env0["MASTER_PORT"] == env2["MASTER_PORT"]
    assert (env0["RANK"], env0["LOCAL_WORLD_SIZE"], env2["RANK"], env2["LOCAL_WORLD_SIZE"]) == (0, 2, 2, 1)
    assert env2["GROUP_RANK"] == 1 and env0["WORLD_SIZE"] == 3
    started = json.loads((tmp_path / "trainer.step.json").read_text())
    assert started["step"] == "5.3"  # what scancel needs to stop it
    execs.clear()
    slurm.run_rank(spec, {**step, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert "MASTER_ADDR" not in execs[0][1]  # one rank: no process group, as with the other launchers


class _NoSrun:
    """Stands for the ``srun`` of a step: nothing runs, it has ended."""

    pid = 2**22 + 11

    def __init__(self, cmd, **kw):
        self.cmd = cmd

    def poll(self):
        return 0


def test_a_requeued_job_never_meets_at_the_previous_attempts_address(tmp_path, monkeypatch):
    """A requeued job keeps its id and numbers its steps from 0 again: the ranks above 0 of the new
    attempt must wait for the new rank 0's address, not read the one the previous attempt left."""
    from types import SimpleNamespace

    steps = tmp_path / slurm.STEPS_DIR
    steps.mkdir()
    (steps / "rendezvous-5.0.json").write_text(json.dumps({"addr": "10.9.9.9", "port": 1}))  # attempt 0's
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setattr(slurm.subprocess, "Popen", _NoSrun)
    monkeypatch.setattr(slurm.SlurmLauncher, "wait_started", lambda self, steps, timeout=None: None)
    monkeypatch.setattr(slurm, "_RENDEZVOUS_TIMEOUT_S", 0.3)
    execs = []
    monkeypatch.setattr(slurm, "_exec", lambda cmd, env: execs.append(env))
    with slurm.SlurmLauncher(tmp_path / "logs", SlurmConfig(job="5", host="127.0.0.1"), run_dir=tmp_path) as launcher:
        launcher.start_trainer_ranks(SimpleNamespace(world_size=2, threads=1, device="cpu"), tmp_path / "t.yaml", {})
        spec = json.loads((steps / "trainer.json").read_text())
        assert list(steps.glob("rendezvous-*")) == []  # the previous attempt's is gone
        step = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1,1",
                "SLURM_LOCALID": "0"}
        with pytest.raises(SystemExit, match="rank 0 wrote no rendezvous file"):  # before rank 0: it waits
            slurm.run_rank(spec, {**step, "SLURM_PROCID": "1", "SLURM_NODEID": "1"})
        assert execs == []
        slurm.run_rank(spec, {**step, "SLURM_PROCID": "0", "SLURM_NODEID": "0"})
        slurm.run_rank(spec, {**step, "SLURM_PROCID": "1", "SLURM_NODEID": "1"})
        assert [(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in execs] == [("127.0.0.1", execs[0]["MASTER_PORT"])] * 2
        assert execs[0]["MASTER_PORT"] != 1
        assert ".1." in Path(spec["rendezvous"]).name  # the attempt is in its name
    assert list(steps.glob("rendezvous-*")) == []  # removed when the launcher ends


def test_a_step_is_port_checked_from_here_only_when_it_runs_in_this_machines_namespaces(tmp_path):
    """``this_machine`` (the server's port checked against its process tree, ``elastic.port_owner``)
    needs the step's pid to be this ``/proc``'s: the same boot, pid and network namespaces."""
    spec = {"started_file": str(tmp_path / "server0.step.json")}
    slurm._started(spec, {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "1"}, host="127.0.0.1", port=1234)
    info = json.loads((tmp_path / "server0.step.json").read_text())
    assert slurm._here(info)
    assert not slurm._here({**info, "pidns": "pid:[1]"})  # a container on this kernel: its pids are not ours
    assert not slurm._here({**info, "boot_id": "another-node"})


def test_a_hung_server_step_is_killed_with_scancel(monkeypatch):
    from areal_fast.elastic.supervisor import kill_now

    calls = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    p = slurm.SlurmStep(name="server0", log_path=Path("/nonexistent"), pid=2**22 + 7, critical=False)
    p.extra["step"] = "5.1"
    kill_now(p)
    assert calls == [["scancel", "--signal", "KILL", "5.1"]]


def test_slurm_script_sizes_the_allocation_and_runs_train_with_the_slurm_launcher(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "areal_fast.cli", "slurm-script", str(EXAMPLE), f"experiment.output_dir={out}",
            "rollout.n_servers=2", "train.world_size=2", "train.threads=3", "slurm.gpus_per_rank=1",
            "slurm.time=1:00:00", "slurm.partition=gpu", 'slurm.sbatch_args=["--account=rl"]']
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ("#SBATCH --ntasks=4", "#SBATCH --cpus-per-task=3", "#SBATCH --gpus=2", "#SBATCH --time=1:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=rl", f"#SBATCH --output={out}/slurm-%j.out"):
        assert want in lines, (want, r.stdout)
    train = lines[-1]
    assert train.startswith(f"exec {sys.executable} -m areal_fast.cli train {EXAMPLE}") and "launcher=slurm" in train
    assert out.is_dir()  # sbatch opens its output there before the script runs
    r = subprocess.run([*args, "slurm.server_job=77"], capture_output=True, text=True, timeout=120)
    assert "#SBATCH --ntasks=2" in r.stdout.splitlines()  # the servers live in job 77


def test_train_outside_any_allocation_exits_2_naming_the_key_before_starting_anything(tmp_path, monkeypatch, capsys):
    import shutil

    from areal_fast import cli

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(shutil, "which", lambda prog, *a, **kw: f"/usr/bin/{prog}")  # srun and scancel 'found'
    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(EXAMPLE), "launcher=slurm", f"experiment.output_dir={tmp_path / 'run'}"])
    assert e.value.code == 2 and "slurm.job" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_removed_server_step_is_signalled_with_scancel_without_waiting(monkeypatch):
    """A server the target removed (the server-count policy's decrease) gets SIGTERM through
    ``scancel --signal TERM`` and the call returns at once (``elastic.supervisor`` watches its srun end);
    a step that has already ended is not signalled."""
    calls = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    launcher = object.__new__(slurm.SlurmLauncher)  # no allocation needed to signal a step
    p = slurm.SlurmStep(name="server1", log_path=Path("/nonexistent"), pid=2**22 + 7, critical=False)
    p.extra["step"] = "5.2"
    launcher.begin_stop(p)
    assert calls == [["scancel", "--signal", "TERM", "5.2"]]
    p.returncode = 0  # its srun ended
    launcher.begin_stop(p)
    assert len(calls) == 1


def test_a_removed_step_outliving_its_grace_is_killed_while_a_new_step_waits_for_its_room(tmp_path, monkeypatch):
    """A removal then an addition (the server-count policy) in an allocation sized for the servers: the
    added server's step waits for the room the removed step holds until it ends. A removed step that
    ignores its SIGTERM past ``slurm.grace`` is killed while the new step waits (the server supervisor,
    which would kill it, is the caller blocked in the start), so the new step starts then, not after
    ``slurm.start_timeout`` (a failed start)."""
    from areal_fast.elastic.members import write_json

    class Srun:  # a step's srun on this machine: exits when its step is killed
        def __init__(self):
            self.rc = None

        def poll(self):
            return self.rc

        def send_signal(self, sig):
            self.rc = -sig

    calls, started = [], tmp_path / "server2.step.json"

    def scancel(cmd, **kw):
        calls.append(cmd)
        if cmd == ["scancel", "--signal", "KILL", "5.1"]:  # the removed step is gone: the new one gets its room
            removed.extra["srun"].rc = 137
            write_json(started, {"node": "n1", "pid": 2**22 + 9, "step": "5.2", "host": "127.0.0.1", "port": 8000})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(slurm.subprocess, "run", scancel)
    launcher = object.__new__(slurm.SlurmLauncher)  # no allocation needed
    launcher.cfg, launcher.procs, launcher.log_dir = SlurmConfig(grace=0.2, start_timeout=5), [], tmp_path
    removed = slurm.SlurmStep(name="server1", log_path=Path("/nonexistent"), pid=2**22 + 7, critical=False)
    removed.extra.update(step="5.1", srun=Srun())
    added = slurm.SlurmStep(name="server2", log_path=Path("/nonexistent"), critical=False)
    added.extra.update(srun=Srun(), started_file=started)
    launcher.procs += [removed, added]
    launcher.begin_stop(removed)  # SIGTERM, which it ignores
    launcher.wait_started([added])  # raises TimeoutError at slurm.start_timeout if the removed step is never killed
    assert calls == [["scancel", "--signal", "TERM", "5.1"], ["scancel", "--signal", "KILL", "5.1"]]
    assert added.step == "5.2" and added.url == "http://127.0.0.1:8000" and not removed.alive()


def test_slurm_script_sizes_the_allocation_for_the_most_servers_the_policy_may_start(tmp_path):
    """With ``rollout.autoscale`` on, the allocation has room for ``max_servers`` server steps (CPUs
    and GPUs), not only the ones the run starts with: an added server's step would otherwise wait
    for room until ``slurm.start_timeout``."""
    from areal_fast.config import load_config

    base = [f"experiment.output_dir={tmp_path / 'run'}", "rollout.n_servers=2", "rollout.device=cuda",
            "train.world_size=1", "slurm.gpus_per_rank=1"]
    fixed = slurm.batch_script(load_config(str(EXAMPLE), base), str(EXAMPLE), [])
    policy = slurm.batch_script(load_config(str(EXAMPLE), [*base, "rollout.autoscale.enabled=true",
                                                           "rollout.autoscale.max_servers=5"]), str(EXAMPLE), [])
    assert "#SBATCH --ntasks=3" in fixed.splitlines() and "#SBATCH --gpus=3" in fixed.splitlines(), fixed
    assert "#SBATCH --ntasks=6" in policy.splitlines() and "#SBATCH --gpus=6" in policy.splitlines(), policy


def test_the_most_servers_the_policy_may_start_must_fit_the_servers_job(monkeypatch):
    """In an allocation that exists (``slurm.job``, ``slurm.server_job`` or the job it runs in), the
    policy's ``max_servers`` server steps are checked against the job's CPUs and GPUs (``scontrol show
    job``) before any step starts; refused naming the key. A job scontrol cannot describe passes."""
    from areal_fast.rollout.config import RolloutConfig

    show = ("JobId=7 JobName=areal JobState=RUNNING NumNodes=1 NumCPUs=8 NumTasks=4 "
            "TRES=cpu=8,mem=16G,node=1,billing=8,gres/gpu=4")
    answer = {"rc": 0}
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, answer["rc"], show if cmd[:3] == ["scontrol", "show", "job"] else "", ""))
    assert slurm.job_resources("7") == {"CPU": 8, "GPU": 4}
    launcher = object.__new__(slurm.SlurmLauncher)
    launcher.cfg, launcher.server_job = slurm.SlurmConfig(job="7", cpus_per_server=2), "7"
    rollout = RolloutConfig(n_servers=2, device="cuda")  # one GPU a server
    launcher._check_policy_room(rollout, 4)  # 8 CPUs, 4 GPUs: fits
    with pytest.raises(ValueError, match=r"rollout\.autoscale\.max_servers: 5 server steps need CPU 10 \(job 7 has "
                                         r"8\); GPU 5 \(job 7 has 4\)"):
        launcher._check_policy_room(rollout, 5)
    answer["rc"] = 1  # scontrol failed: sizes unknown, let through
    launcher._check_policy_room(rollout, 5)
