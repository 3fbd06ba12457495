"""End to end on CPU with real processes: `areal-fast train` on a shrunken tiny task (embedded
engine servers over HTTP, reward worker processes, the PPO actor, disk weight sync).

- a run is killed with SIGKILL after its second checkpoint; the same command resumes and finishes:
  every step is trained once, no prompt is trained twice, the staleness bound holds, the
  servers of the killed run did not outlive it. While the first run is alive, its server refuses a
  request without the run's API key (401) and a second run on the same output directory is refused;
- two trainer ranks (torchrun, gloo) with the default distributed weight sync and the rollout client
  in two worker processes (one per server) finish a run.

(A server killed mid-run of a synchronous run, which goes on with only fresh samples: ``test_elastic_e2e``.)
Each run starts from the session's warm start of the shrunken task (``tiny_warm_start``: built once,
copied into the run's output directory, where the run finds it up to date).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _shared import poll_until
from e2e_runs import ETA, TINY, seed_run_dir

from areal_fast.buffer import checkpoint_groups
from areal_fast.checkpoint import HANG_AFTER_CHECKPOINT_ENV

ROOT = Path(__file__).resolve().parents[2]
from bench.common import proc_alive, proc_children, proc_cmdline  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "tiny_reverse.yaml")
START_TIMEOUT_S = 240  # server start-up + a few steps on a busy 2-core machine


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "areal_fast.cli", "train", EXAMPLE, f"experiment.output_dir={out}", *TINY,
            *extra]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _train_events(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("kind") == "train"]


def _wait_for(pred, proc: subprocess.Popen, what: str, timeout=START_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"run exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def kill_run(p: subprocess.Popen, kids: list[int]) -> None:
    """SIGKILL the run's launcher ``p``; its processes ``kids`` die with it (parent-death signal)."""
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    poll_until(lambda: not any(proc_alive(k) for k in kids), "the processes of the killed run to end", 30, 0.2)


def resume(cmd: list[str], out: Path, steps: int) -> tuple[list[dict], list[int]]:
    """Run the killed run's ``cmd`` again: it resumes and ends, each of its ``steps`` trained once and each
    task once (two a step). Returns (its train events, their task positions)."""
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr
    events = _train_events(out)
    assert [e["step"] for e in events] == list(range(1, steps + 1))
    positions = [pos for e in events for pos in e["positions"]]
    assert len(positions) == len(set(positions)) == steps * 2, positions
    return events, positions


@pytest.fixture
def run_dir(tmp_path, tiny_warm_start):
    """A run's output directory holding the session's warm start of TINY."""
    return seed_run_dir(tiny_warm_start, tmp_path / "run")


@pytest.fixture
def runner():
    procs = []

    def start(cmd, env=None):
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=None if env is None else {**os.environ, **env})
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            for c in proc_children(p.pid):
                try:
                    os.kill(c, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
        p.wait()


def test_kill_9_then_the_same_command_resumes_without_loss_or_duplicates(run_dir, runner):
    out = run_dir
    steps = 5
    # The first run holds still right after checkpoint 2 (a test hook), so the kill lands mid-run at
    # a point the test controls: the run can neither finish nor let retention delete step 2 first.
    p = runner(_cmd(out, f"experiment.total_steps={steps}", "weights.method=disk"),
               env={HANG_AFTER_CHECKPOINT_ENV: "2"})
    _wait_for(lambda: (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file(), p, "checkpoint 2")
    kids = proc_children(p.pid)
    engines = [proc_cmdline(k).split() for k in kids if "areal_fast.embedded" in proc_cmdline(k)]
    assert engines, "no engine server was launched"
    url = f"http://127.0.0.1:{engines[0][engines[0].index('--port') + 1]}"
    # the key travels in a private --config file, never on the (world-readable) command line
    assert "--config" in engines[0] and "--api-key" not in engines[0]
    assert _status(url + "/get_model_info") == 401  # no key, no answer
    assert _status(url + "/health") == 200  # health stays open, as in SGLang
    # a second live run on the same output directory is refused at once, naming the directory
    r = subprocess.run(_cmd(out, f"experiment.total_steps={steps}", "weights.method=disk"), cwd=ROOT,
                       capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert r.returncode == 1 and "in use by another live run" in r.stderr and str(out) in r.stderr, r.stderr[-2000:]
    assert p.poll() is None
    kill_run(p, kids)

    events, positions = resume(_cmd(out, f"experiment.total_steps={steps}", "weights.method=disk"), out, steps)
    assert max(e["staleness_max"] for e in events) <= ETA
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps
    assert (out / "final" / "config.json").is_file()
    assert (out / "plots" / "reward.png").is_file()
    ck = out / "checkpoints" / f"step_{steps:08d}"
    st = json.loads((ck / "controller.json").read_text())
    seen = positions + [g.position for g in checkpoint_groups(ck)] + st["pending"]
    assert sorted(seen) == list(range(st["position"])), "a prompt was lost or handed out twice"

    # `areal-fast eval` of the exported model reproduces the run's final greedy evaluation
    r = subprocess.run([sys.executable, "-m", "areal_fast.cli", "eval", EXAMPLE, f"experiment.output_dir={out}",
                        *TINY], cwd=ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(r.stdout.strip().splitlines()[-1])
    assert ev["eval_n"] == 8 and ev["eval_reward"] == pytest.approx(summary["eval"]["eval_reward"])


def test_two_trainer_ranks_and_the_rollout_client_in_two_worker_processes_finish(run_dir, runner):
    """The local launcher with train.world_size=2 (torchrun, gloo), the example's default weight sync
    (distributed) and `rollout.client_processes=2`: two servers, one per rollout worker process
    (``areal_fast.rollout.sharded``). The run makes every step and exits 0, the staleness bound holds,
    no worker outlives the run; the API key is in the ranks' environment, never on a command line."""
    out = run_dir
    steps = 4
    p = runner(_cmd(out, f"experiment.total_steps={steps}", "train.world_size=2", "rollout.n_servers=2",
                    "rollout.client_processes=2", "checkpoint.every_steps=0", "log.plots=false"))
    cmdlines: list[str] = []
    while p.poll() is None and len(cmdlines) < 3:  # record the ranks' command lines while they run
        cmdlines = [c for c in (proc_cmdline(k) for k in proc_children(p.pid)) if "areal_fast.launch.rank" in c]
        time.sleep(0.2)
    _, err = p.communicate(timeout=START_TIMEOUT_S * 2)
    assert p.returncode == 0, err.decode()[-3000:] + (out / "logs" / "trainer.log").read_text()[-3000:]
    events = _train_events(out)
    assert [e["step"] for e in events] == list(range(1, steps + 1))
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    assert cmdlines and not [c for c in cmdlines if "api-key" in c or "API_KEY" in c]
    assert all(e["staleness_max"] <= ETA for e in events)  # strict mode (TINY): the bound is hard
    log = (out / "logs" / "controller.log").read_text()
    assert "rollout client in 2 worker processes" in log
    pids = [int(x) for x in log.split("rollout client in 2 worker processes (pids ", 1)[1].split(")", 1)[0].split(", ")]
    assert len(pids) == 2 and not [k for k in pids if proc_alive(k)]
