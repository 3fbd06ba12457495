"""Elastic servers on the Ray launcher (a local single-node Ray, CPU): a server whose actor is
killed is relaunched by the supervisor in the same bundle of the run's server placement group (the
cluster has room for one server only: a new bundle could not be placed), becomes a member once
healthy and generates; teardown leaves no actor or placement group."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")

from areal_fast.config import RayConfig, RolloutConfig  # noqa: E402
from areal_fast.elastic.members import read_members  # noqa: E402
from areal_fast.elastic.supervisor import ServerSupervisor  # noqa: E402
from areal_fast.launch.ray_launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow
LIGHT = RayConfig(cpus_per_server=1.0, cpus_per_rank=0.5, placement_timeout=60, grace=5)
JOIN_TIMEOUT_S = 180  # a fresh engine's start-up on a busy 2-core machine


def _generates(url: str) -> bool:
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return len(json.loads(r.read())["output_ids"]) >= 1


def test_a_killed_server_actor_is_relaunched_in_its_bundle(tmp_path):
    from areal_fast.data.tiny_models import build_tiny_qwen2

    model = build_tiny_qwen2(str(tmp_path / "model"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # room for exactly one server
    try:
        rcfg = RolloutConfig(n_servers=1, health_timeout=120)
        with RayLauncher(tmp_path / "logs", LIGHT) as launcher:
            servers = launcher.start_servers(rcfg, model, seed=3)
            sup = ServerSupervisor(launcher, rcfg, model, tmp_path, seed=3, api_key=None, servers=servers)
            ray.kill(servers[0].actor)
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while True:
                sup.tick()
                urls = [m.url for m in read_members(tmp_path)]
                if urls and servers[0].url not in urls:
                    break
                assert time.monotonic() < deadline, f"no replacement joined: members {urls}"
                time.sleep(0.5)
            new = read_members(tmp_path)[0]
            assert new.slot == 0 and new.name.startswith("server0-") and _generates(new.url)
            sup.stop()
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert not [n for n in names if launcher.run_id in n], f"actors left behind: {names}"
    finally:
        ray.shutdown()
