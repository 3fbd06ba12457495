"""The Ray launcher on a local single-node Ray cluster (CPU, 2 logical CPUs, no dashboard).

- trainer ranks as actors get a working torch.distributed rendezvous (2-rank gloo all_reduce);
- a failing rank fails fast with its name and log tail;
- an embedded-engine server is placed, becomes healthy and generates; killing its actor kills
  the engine and, as it was the last server, fails fast like the local launcher;
- the tiny end-to-end training run through ``run_train`` with ``launcher: ray``, two servers and two
  trainer ranks, one server's actor killed mid-run: the run still finishes (as with the local launcher);
- teardown leaves no actors, placement groups or engine processes, and ``ray.shutdown`` leaves no
  raylet behind.

One Ray instance serves the whole module (starting one costs ~13 s here).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from areal_fast.config import RayConfig, RolloutConfig, load_config  # noqa: E402
from areal_fast.elastic.liveness import server_ready  # noqa: E402
from areal_fast.launch.base import PYTHON, ProcessDied, server_command, tp_size  # noqa: E402
from areal_fast.launch.ray_launcher import RayLauncher  # noqa: E402
from areal_fast.launch.train import run_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"
# 2 logical CPUs: two half-CPU servers and two half-CPU trainer ranks fit together
LIGHT = RayConfig(cpus_per_server=0.5, cpus_per_rank=0.5, placement_timeout=60, grace=5)
RUN_TIMEOUT_S = 240  # warm start + 2 engines + trainer start-up + 3 steps on a busy 2-core machine
GONE_TIMEOUT_S = 15  # a SIGKILLed actor's child gets SIGKILL from the kernel (PR_SET_PDEATHSIG) at once

TINY = [  # the shrunken tiny task of tests/launch/test_e2e.py
    "model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
    "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
    "model.warm_start.num_key_value_heads=1", "data.synthetic.max_len=6", "data.synthetic.n_train=200",
    "data.synthetic.n_eval=8", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_staleness=1",
    "rollout.max_concurrent=8", "train.batch_size=2", "eval.every_steps=0", "checkpoint.every_steps=0",
    "log.tensorboard=false", "log.progress=false", "log.plots=false", "reward.workers=1",
    # disk sync: the launcher is under test here, not the broadcast path's handling of a dead server
    "weights.method=disk",
]

ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} local={os.environ['LOCAL_RANK']} "
      f"master={os.environ['MASTER_ADDR']} sum={t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_config_validation_and_server_placement_helpers():
    with pytest.raises(ValueError, match="server_strategy"):
        RayConfig(server_strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="cpus_per_rank"):
        RayConfig(cpus_per_rank=0)
    assert tp_size(["--mem-fraction-static", "0.8", "--tp-size", "4"]) == 4
    assert tp_size(["--tp=2"]) == 2 and tp_size([]) == 1
    r = RolloutConfig(server="sglang", server_args=["--tp-size", "2"])
    cmd = server_command(r, "/m", "10.0.0.7", 30001, seed=0, api_key_file="/run/.secrets/k.yaml", python=PYTHON)
    assert cmd[:3] == [PYTHON, "-m", "sglang.launch_server"] and cmd.count("--tp-size") == 1
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--config") + 1] == "/run/.secrets/k.yaml"
    assert "--api-key" not in cmd  # the key travels in the file, never on the command line
    assert cmd[cmd.index("--host") + 1] == "10.0.0.7" and cmd[cmd.index("--port") + 1] == "30001"


def _proc_cmdlines() -> dict[int, str]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    out[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout=GONE_TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _assert_torn_down(launcher: RayLauncher) -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if launcher.run_id in n], f"actors left behind: {names}"
    table = ray.util.placement_group_table()
    left = [g for g in table.values() if launcher.run_id in (g.get("name") or "") and g["state"] != "REMOVED"]
    assert not left, f"placement groups left behind: {left}"
    assert not _wait_gone([p.pid for p in launcher.procs]), "launched processes outlived the launcher"
    assert not os.path.exists(launcher.node_log_dir), "node-local logs were not cleaned up"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for the module; afterwards no raylet of this session may be left running."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
    raylets = [pid for pid, cmd in _proc_cmdlines().items() if "raylet" in cmd and session in cmd]
    try:
        yield ray
    finally:
        ray.shutdown()
        assert raylets, "no raylet found for this session: the teardown check would test nothing"
        assert not _wait_gone(raylets, timeout=30), "raylet still running after ray.shutdown()"


def _wait_done(launcher: RayLauncher, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.alive() for p in procs):
        launcher.check()
        assert time.monotonic() < deadline, "processes did not finish"
        time.sleep(0.2)
    launcher.check()


def test_trainer_ranks_rendezvous_and_all_reduce(ray_cluster, tmp_path):
    with RayLauncher(tmp_path / "logs", LIGHT) as launcher:
        ranks = launcher.start_ranks([PYTHON, "-c", ALL_REDUCE], 2, cpus=0.5)
        _wait_done(launcher, ranks, 120)
        assert [p.returncode for p in ranks] == [0, 0]
        for r, p in enumerate(ranks):
            assert p.name == f"trainer{r}"
            assert f"rank={r} world=2 local={r} master=127.0.0.1 sum=3.0" in p.log_path.read_text()
    _assert_torn_down(launcher)


def test_a_failing_rank_fails_fast_with_its_log(ray_cluster, tmp_path):
    cmd = [PYTHON, "-c", "import sys; print('bad batch at step 7', flush=True); sys.exit(3)"]
    with RayLauncher(tmp_path / "logs", LIGHT) as launcher:
        launcher.start_ranks(cmd, 1, cpus=0.5)
        with pytest.raises(ProcessDied, match=r"(?s)trainer0.*exited with code 3.*bad batch at step 7"):
            _wait_done(launcher, launcher.procs, 60)
    _assert_torn_down(launcher)


def test_server_health_generate_and_killed_actor(ray_cluster, tmp_path):
    from areal_fast.data.tiny_models import build_tiny_qwen2

    model = build_tiny_qwen2(str(tmp_path / "model"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    rcfg = RolloutConfig(n_servers=1, health_timeout=120)
    with RayLauncher(tmp_path / "logs", LIGHT) as launcher:
        (server,) = launcher.start_servers(rcfg, model, seed=3)
        assert server.url.startswith("http://127.0.0.1:")
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                           "return_logprob": True}).encode()
        req = urllib.request.Request(server.url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            res = json.loads(r.read())
        assert len(res["output_ids"]) == len(res["meta_info"]["output_token_logprobs"]) >= 1
        assert launcher.check() == []
        ray.kill(server.actor)
        with pytest.raises(ProcessDied, match=r"(?s)the last inference server died: process 'server0'.*is gone"):
            deadline = time.monotonic() + GONE_TIMEOUT_S
            while time.monotonic() < deadline:
                launcher.check()
                time.sleep(0.2)
        assert not _wait_gone([server.pid]), "the engine outlived its killed actor"
        assert not server_ready(server.url)
        assert "areal_fast.embedded" in server.log_path.read_text()  # its log was collected
    _assert_torn_down(launcher)


@pytest.mark.slow
def test_tiny_e2e_run_survives_a_killed_server_actor(ray_cluster, tmp_path):
    """Two embedded servers and two FSDP2 trainer ranks (gloo) placed by Ray; rank 0 runs the controller."""
    out = tmp_path / "run"
    steps = 3  # the server dies after step 1; steps 2-3 (seconds of work) cannot finish before the kill
    cfg = load_config(EXAMPLE, [*TINY, f"experiment.output_dir={out}", f"experiment.total_steps={steps}",
                                "rollout.n_servers=2", "train.world_size=2", "launcher=ray"])
    cfg.ray = LIGHT
    box: dict = {}

    def run():
        try:
            box["summary"] = run_train(cfg, say=lambda m: None)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        assert th.is_alive(), f"run ended before step 1: {box.get('error')!r}"
        assert time.monotonic() < deadline, "timed out waiting for step 1"
        time.sleep(0.2)
    victim = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-server0")]
    assert len(victim) == 1
    ray.kill(ray.get_actor(victim[0]["name"], namespace=victim[0]["namespace"]))
    th.join(max(1.0, deadline - time.monotonic()))
    assert not th.is_alive(), "run did not finish"
    assert "error" not in box, box.get("error")
    assert box["summary"]["steps"] == steps
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == list(range(1, steps + 1))
    logs = out / "logs"
    assert "server0" in (logs / "launcher.log").read_text() and "died" in (logs / "launcher.log").read_text()
    for name in ("server1", "trainer0", "trainer1"):
        assert (logs / f"{name}.log").stat().st_size > 0, f"no log collected for {name}"
    assert (out / "final" / "config.json").is_file()
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("areal-")]
    assert not left, f"actors left behind: {left}"
    engines = [pid for pid, c in _proc_cmdlines().items() if "areal_fast.embedded" in c and str(out) in c]
    assert not _wait_gone(engines), "engine processes outlived the run"
