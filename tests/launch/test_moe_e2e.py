"""The MoE recipe end to end on CPU with real processes: `areal-fast train
examples/tiny_reverse_moe.yaml`, shrunken, with two trainer ranks (torchrun, gloo: each holds half
of every block's experts) and the example's distributed weight sync into the embedded engine
server. The run makes every step and evaluates; the warm start and the exported model are
Qwen3-MoE checkpoints in the per-expert layout, the export equal to what the trainer held. Routing
replay is on: the engine records every position's experts, the samples carry them through the
buffer to both ranks, and every trained position is replayed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "tiny_reverse_moe.yaml")
TIMEOUT_S = 480

TINY = [
    "model.warm_start.steps=10", "model.warm_start.hidden_size=64", "model.warm_start.num_hidden_layers=1",
    "model.warm_start.num_attention_heads=2", "model.warm_start.num_key_value_heads=1",
    "model.warm_start.moe_intermediate_size=32", "data.synthetic.max_len=6", "data.synthetic.n_train=200",
    "data.synthetic.n_eval=8", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
    "train.batch_size=2", "checkpoint.every_steps=0", "log.tensorboard=false", "log.progress=false",
    "log.plots=false", "reward.workers=1",
]


@pytest.mark.slow  # a training run: warm start, engine server, two trainer ranks
def test_moe_recipe_trains_on_two_ranks_and_syncs_the_experts(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "run"
    steps = 3
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", EXAMPLE, f"experiment.output_dir={out}", *TINY,
           f"experiment.total_steps={steps}", f"eval.every_steps={steps}", "train.world_size=2",
           "rollout.return_routed_experts=true", "train.ppo.routing_replay=true"]
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=TIMEOUT_S)
    logs = out / "logs" / "trainer.log"
    assert p.returncode == 0, p.stderr.decode()[-3000:] + (logs.read_text()[-3000:] if logs.exists() else "")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # every forwarded position of every trained sample had its server routing, across weight updates
    assert [r["train/routing_replayed_fraction"] for r in train] == [1.0] * steps, train
    assert [r for r in rows if r.get("kind") == "eval"], "no held-out evaluation"
    for d in (out / "warm_start", out / "final"):
        config = json.loads((d / "config.json").read_text())
        # transformers 5 writes the expert count as num_local_experts (num_experts is its alias)
        assert config["model_type"] == "qwen3_moe" and config.get("num_experts", config.get("num_local_experts")) == 4
        names = set()
        for f in d.glob("*.safetensors"):
            names |= set(safe_open(str(f), "pt").keys())
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in names, d
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names), d
