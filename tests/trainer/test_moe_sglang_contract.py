"""SGLang's own Qwen3-MoE loader (``Qwen3MoeForCausalLM.load_weights`` of the released wheels,
imported on this CPU machine by ``tests/sglang_wheel.py``) judges the MoE tensors our weight sync
sends: every per-expert tensor reaches the fused ``w13``/``w2`` parameter of the expert its name
says, as the shard the checkpoint means (gate w1, up w3, down w2). transformers' fused names, by
contrast, are dropped by it without a word: why the sync splits them."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the wheel helpers
from sglang_wheel import sglang_module  # noqa: E402
from tolerances import SGLANG_LOADED_SUM_ATOL  # noqa: E402

LAYER = "model.layers.0.mlp"


class _Param:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def weight_loader(self, param, loaded_weight, *args, shard_id=None, expert_id=None):
        shard = shard_id if shard_id is not None else (args[-1] if args else None)
        self.log.append({"param": self.name, "shard": shard, "expert": expert_id, "shape": tuple(loaded_weight.shape),
                         "sum": float(loaded_weight.double().sum())})


def _load(version: str, weights: dict[str, torch.Tensor], num_experts: int) -> list[dict]:
    """What SGLang ``version``'s loader does with ``weights``: one record per weight_loader call."""
    mod = sglang_module(version, "sglang.srt.models.qwen3_moe")
    log: list = []
    names = [f"{LAYER}.experts.w13_weight", f"{LAYER}.experts.w2_weight", f"{LAYER}.gate.weight"]
    params = {n: _Param(n, log) for n in names}
    stand_in = types.SimpleNamespace(
        config=types.SimpleNamespace(num_experts=num_experts), model=types.SimpleNamespace(),
        named_parameters=lambda: list(params.items()), routed_experts_weights_of_layer={})
    mod.Qwen3MoeForCausalLM.load_weights(stand_in, list(weights.items()))
    return log


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf

    model = load_hf(build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe")), hidden_size=8, num_heads=1,
                                         num_kv_heads=1, moe_intermediate_size=4, num_experts=3, num_layers=1,
                                         vocab_size=16))
    return {k: v for k, v in model.state_dict().items() if k.startswith(f"{LAYER}.experts")}


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_sglang_loader_takes_our_per_expert_tensors(version, layer):
    from areal_fast.weights.experts import to_checkpoint_state

    wire = to_checkpoint_state(layer)
    got = _load(version, wire, num_experts=3)
    assert len(got) == len(wire) == 9
    want = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"), "down_proj": ("w2_weight", "w2")}
    for (name, t), g in zip(wire.items(), got):
        e, proj = name.removeprefix(f"{LAYER}.experts.").split(".")[:2]
        param, shard = want[proj]
        assert (g["param"], g["shard"], g["expert"]) == (f"{LAYER}.experts.{param}", shard, int(e)), (name, g)
        assert g["shape"] == tuple(t.shape)
        assert g["sum"] == pytest.approx(float(t.double().sum()), abs=SGLANG_LOADED_SUM_ATOL)


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_sglang_loader_silently_drops_transformers_fused_expert_names(version, layer):
    assert {n.rsplit(".", 1)[-1] for n in layer} == {"gate_up_proj", "down_proj"}
    assert _load(version, layer, num_experts=3) == []
