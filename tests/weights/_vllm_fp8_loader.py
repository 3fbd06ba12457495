"""Run by real vLLM's interpreter (its CPU build, ``tests/real_vllm.py``), not by pytest: load the FP8
tensors of ``IN`` (a ``torch.save`` of ``{case: {name: tensor}}``, made by our codec) through vLLM's own
block-FP8 linear layers and write what the layers hold to ``OUT``.

    python _vllm_fp8_loader.py IN OUT QUANT_CONFIG_JSON

What is vLLM's: ``Fp8Config.from_config`` of our ``quantization_config``, the layers (``ReplicatedLinear``,
``MergedColumnParallelLinear``, ``QKVParallelLinear``, the router's ``GateLinear``), their parameters'
weight loaders (whole and per shard) and ``Fp8LinearMethod.process_weights_after_loading``. What is
not: the GEMM kernel. vLLM picks it in ``create_weights`` (``init_fp8_linear_kernel``); its CPU build's
block-FP8 kernels need AMX tiles, which this machine lacks, so a stand-in kernel whose own post-load
step (a hardware repacking) does nothing takes its place.

The MoE cases (``moe_*``: ``{"hidden", "intermediate", "experts", "top_k", "weights": [(name, tensor)]}``,
the per-expert tensors as we send them) go through vLLM's fused-MoE path: ``FusedMoEFactory`` (as its
Qwen3-MoE builds ``mlp.experts``) makes ``RoutedExperts`` with ``Fp8MoEMethod``, and
``Qwen3MoeModel.load_weights`` (its ``AutoWeightsLoader``, which hands the experts' tensors to the
experts' own ``load_weights`` and per-expert ``weight_loader``) loads our names. Every ``weight_loader``
call is recorded. Not vLLM's here either: the MoE GEMM. Its backend oracle finds none on this machine
(the CPU build's FP8 MoE experts need AMX tiles too: ``Fp8MoeBackend.NONE``), so the method's
``_setup_kernel`` (convert to the chosen kernel's layout, build the kernel) is a stand-in that does
nothing; the rest of ``Fp8MoEMethod.process_weights_after_loading`` runs. A case whose construction or
load raises is reported as the error's text.
"""

from __future__ import annotations

import json
import sys
import types

import torch


class _NoKernel:
    def process_weights_after_loading(self, layer) -> None:
        pass


def main(src: str, out: str, qc: str) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.quantization import fp8
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        ps.initialize_model_parallel(1, 1)
        fp8.init_fp8_linear_kernel = lambda **kw: _NoKernel()
        fp8.get_current_vllm_config = lambda: types.SimpleNamespace(
            model_config=types.SimpleNamespace(dtype=torch.bfloat16))
        cfg = fp8.Fp8Config.from_config(json.loads(qc))
        cases = torch.load(src)
        res = {}
        for name, t in cases.items():
            if name.startswith("moe"):
                try:
                    res[name] = _moe(cfg, t)
                except Exception as e:  # noqa: BLE001 - the test reads what vLLM said
                    res[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            if name == "replicated":
                q = t["weight"]
                layer = linear.ReplicatedLinear(q.shape[1], q.shape[0], bias=False, quant_config=cfg,
                                                prefix="model.layers.0.self_attn.o_proj", params_dtype=torch.bfloat16)
                parts = [(None, t["weight"], t["weight_scale_inv"])]
            elif name == "gate_up":
                layer = linear.MergedColumnParallelLinear(t["g"].shape[1], [t["g"].shape[0], t["u"].shape[0]],
                                                          bias=False, quant_config=cfg,
                                                          prefix="model.layers.0.mlp.gate_up_proj",
                                                          params_dtype=torch.bfloat16)
                parts = [(0, t["g"], t["g_scale"]), (1, t["u"], t["u_scale"])]
            else:  # qkv: 4 query heads and 2 key/value heads of 64
                layer = linear.QKVParallelLinear(t["q"].shape[1], 64, 4, 2, bias=False, quant_config=cfg,
                                                 prefix="model.layers.0.self_attn.qkv_proj",
                                                 params_dtype=torch.bfloat16)
                parts = [(s, t[s], t[s + "_scale"]) for s in ("q", "k", "v")]
            for shard, w, s in parts:
                args = () if shard is None else (shard,)
                layer.weight.weight_loader(layer.weight, w, *args)
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, *args)
            layer.quant_method.process_weights_after_loading(layer)
            res[name] = {"method": type(layer.quant_method).__name__, "weight": layer.weight.data.clone(),
                         "weight_scale_inv": layer.weight_scale_inv.data.clone()}
        gate = GateLinear(64, 4, quant_config=cfg, prefix="model.layers.0.mlp.gate")
        res["router_method"] = type(gate.quant_method).__name__
        torch.save(res, out)


def _moe(cfg, t) -> dict:
    """Our per-expert FP8 tensors through vLLM's fused-MoE layer and its Qwen3-MoE loader (module docstring)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel

    with set_current_vllm_config(VllmConfig()):  # a config of its own: layer names are unique per config
        runner = FusedMoEFactory(num_experts=t["experts"], top_k=t["top_k"], hidden_size=t["hidden"],
                                 intermediate_size=t["intermediate"], params_dtype=torch.bfloat16,
                                 quant_config=cfg, prefix="model.layers.0.mlp.experts")
    experts = runner.routed_experts
    expected = {n: (tuple(p.shape), str(p.dtype)) for n, p in experts.named_parameters()}
    calls = []
    for p in experts.parameters():
        p.data.view(torch.uint8).fill_(0xFF)  # NaN in FP8 and fp32: a slot no loader call wrote stays NaN

        def loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False, _orig=p.weight_loader):
            ok = _orig(param, loaded_weight, weight_name, shard_id, expert_id, return_success=True)
            calls.append((weight_name, shard_id, expert_id, bool(ok)))
            return ok if return_success else None

        p.weight_loader = loader
    model = torch.nn.Module()  # Qwen3MoeModel's tree down to the experts (prefix "model." stripped by its parent)
    model.hf_to_vllm_mapper = Qwen3MoeModel.hf_to_vllm_mapper
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.experts = runner
    loaded = Qwen3MoeModel.load_weights(model, [(n.removeprefix("model."), w) for n, w in t["weights"]])
    method = experts.quant_method
    method._setup_kernel = lambda *a, **k: None  # the MoE GEMM's layout and kernel (module docstring)
    method.process_weights_after_loading(experts)
    return {"method": type(method).__name__, "block_quant": method.block_quant,
            "weight_block_size": list(experts.weight_block_size), "expected": expected, "calls": calls,
            "loaded": sorted(loaded), "params": {n: p.data.clone() for n, p in experts.named_parameters()}}


if __name__ == "__main__":
    main(*sys.argv[1:4])
