"""The Ray launcher across nodes, on a simulated cluster of three nodes on this machine
(``ray.cluster_utils.Cluster``): each node has its own address (127.0.0.2 and 127.0.0.3 are
loopback addresses of their own on Linux; the head keeps the machine's) and its own resources,
and custom resources pin the embedded-engine server to the head and one trainer rank to each
other node. A two-step run with the broadcast weight sync must then bind and advertise every
address per node: the server on its node's address (reachable only there, 127.0.0.1 would not
answer), the ranks' rendezvous on rank 0's node, the weight group's store on rank 0's node too.
Small on purpose: 1 CPU a node, 80 MB object stores (``docs/multinode.md``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"
RUN_TIMEOUT_S = 420  # three raylets, a warm start, an engine, two ranks and two steps on 2 busy cores
NODE_IPS = ("127.0.0.2", "127.0.0.3")
STORE_MB = 80 << 20

TINY = [  # the shrunken tiny task of tests/launch/test_launch_ray.py, with the broadcast sync
    "model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
    "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
    "model.warm_start.num_key_value_heads=1", "data.synthetic.max_len=6", "data.synthetic.n_train=200",
    "data.synthetic.n_eval=8", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_staleness=1",
    "rollout.max_concurrent=8", "train.batch_size=2", "eval.every_steps=0", "checkpoint.every_steps=0",
    "log.tensorboard=false", "log.progress=false", "log.plots=false", "reward.workers=1",
    "weights.method=distributed", "weights.collective=gloo", "checkpoint.save_hf=false",
]


@pytest.mark.slow  # ~3-5 min: three raylets and a real run
def test_servers_and_ranks_on_different_nodes_bind_and_meet_per_node(tmp_path):
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from areal_fast.config import RayConfig, load_config
    from areal_fast.launch.train import run_train

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"areal_server": 1}, object_store_memory=STORE_MB, include_dashboard=False))
    try:
        for ip in NODE_IPS:
            cluster.add_node(num_cpus=1, resources={"areal_trainer": 1}, object_store_memory=STORE_MB,
                             node_ip_address=ip)
        head_ip = cluster.head_node.node_ip_address
        out = tmp_path / "run"
        cfg = load_config(EXAMPLE, [*TINY, f"experiment.output_dir={out}", "experiment.total_steps=2",
                                    "rollout.n_servers=1", "train.world_size=2", "launcher=ray"])
        cfg.ray = RayConfig(address=cluster.address, cpus_per_server=0.5, cpus_per_rank=1,
                            server_resources={"areal_server": 1}, rank_resources={"areal_trainer": 1},
                            trainer_strategy="SPREAD", placement_timeout=120, grace=5)
        box: dict = {}

        def run():
            try:
                box["summary"] = run_train(cfg, say=lambda m: None)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                box["error"] = e

        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(RUN_TIMEOUT_S)
        assert not th.is_alive(), f"run did not finish in {RUN_TIMEOUT_S}s"
        assert "error" not in box, box.get("error")
        assert box["summary"]["steps"] == 2

        (server,) = yaml.safe_load((out / "trainer_config.yaml").read_text())["rollout"]["servers"]
        assert server.startswith(f"http://{head_ip}:"), server  # bound and advertised on its node
        launcher_log = (out / "logs" / "launcher.log").read_text()
        assert f"started server0 on {head_ip}" in launcher_log
        rank_nodes = {f"trainer{r}": ip for r in (0, 1) for ip in NODE_IPS if f"started trainer{r} on {ip}" in
                      launcher_log}
        assert sorted(rank_nodes.values()) == sorted(NODE_IPS), launcher_log  # one rank on each other node
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        train = [r for r in rows if r.get("kind") == "train"]
        assert [r["step"] for r in train] == [1, 2]
        assert all("sync/broadcast_s" in r for r in train), train  # the weights crossed nodes by broadcast
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
