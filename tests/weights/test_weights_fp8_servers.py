"""Contract: the FP8 weights we send (``weights/fp8.py``) load into SGLang's own block-FP8 linear layers
(the released wheel, imported on CPU): its ``Fp8Config`` read from the ``quantization_config`` we write,
its linear layers' weight loaders (whole, and per shard for the merged gate/up and q/k/v layers) and
its ``Fp8LinearMethod.process_weights_after_loading``; the layer then holds our FP8 bytes and scales,
so it computes with our dequantised values. Its shape rule (every part of a merged layer a whole
number of 128-row blocks) is checked as SGLang checks it. The MoE experts: what our sender puts on the
wire for a tiny Qwen3-MoE (per expert ``gate_proj``/``up_proj``/``down_proj`` in FP8 with their
``weight_scale_inv``) goes through SGLang's own Qwen3-MoE ``load_weights`` into its ``FusedMoE`` with
``Fp8MoEMethod``, and through vLLM's (real vLLM 0.32, ``_vllm_fp8_loader.py``): every expert's ``w13``
(gate, then up) and ``w2`` and their scales hold our bytes, and the layers' parameter shapes are the
shapes we send. Skipped only when the wheel cannot be downloaded."""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch

from areal_fast.weights import fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_wheel import sglang_module  # noqa: E402
from test_weights_fp8 import _encoded_buckets  # noqa: E402  (the wire of every FP8 transport)

VERSION = "0.5.23"


@pytest.fixture(scope="module")
def sglang():
    fp8_mod = sglang_module(VERSION, "sglang.srt.layers.quantization.fp8")
    linear = sglang_module(VERSION, "sglang.srt.layers.linear")
    # one rank: the linear layers ask the runtime's parallel context for their TP group (none published on CPU)
    linear.get_parallel = lambda: types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight"]
    config = fp8_mod.Fp8Config.from_config(fp8.quantization_config(names))
    return types.SimpleNamespace(fp8=fp8_mod, linear=linear, config=config)


def _w(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def _loaded(layer, parts):
    """Our encoded ``parts`` ([(shard id or None, weight)]) through ``layer``'s own loaders, then its
    post-load processing; the dequantised weight the layer holds."""
    for shard, w in parts:
        q, s = fp8.quantize(w)
        args = () if shard is None else (shard,)
        layer.weight.weight_loader(layer.weight, q, *args)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, *args)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    return fp8.dequantize(layer.weight.data, layer.weight_scale_inv.data)


def test_our_config_is_sglangs_block_fp8_with_the_routers_and_head_unquantised(sglang):
    c = sglang.config
    assert c.is_checkpoint_fp8_serialized and c.weight_block_size == [128, 128] and c.activation_scheme == "dynamic"
    assert {"lm_head", "model.layers.0.mlp.gate"} <= set(c.ignored_layers)
    gate = sglang.linear.ReplicatedLinear(64, 4, bias=False, quant_config=c, prefix="model.layers.0.mlp.gate")
    assert type(gate.quant_method).__name__ == "UnquantizedLinearMethod"


@pytest.mark.parametrize("shape", [(130, 257), (256, 384), (7, 5)])
def test_a_linear_layer_holds_our_fp8_weight_and_scales(sglang, shape):
    layer = sglang.linear.ReplicatedLinear(shape[1], shape[0], bias=False, quant_config=sglang.config,
                                           prefix="model.layers.0.self_attn.o_proj", params_dtype=torch.bfloat16)
    assert isinstance(layer.quant_method, sglang.fp8.Fp8LinearMethod)
    w = _w(shape, 0)
    assert torch.equal(_loaded(layer, [(None, w)]), fp8.dequantize_ref(*fp8.quantize_ref(w)))


def test_merged_gate_up_and_qkv_layers_take_our_per_projection_tensors(sglang):
    lin, c = sglang.linear, sglang.config
    g, u = _w((256, 200), 1), _w((256, 200), 2)
    gate_up = lin.MergedColumnParallelLinear(200, [256, 256], bias=False, quant_config=c,
                                             prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.bfloat16)
    want = torch.cat([fp8.dequantize_ref(*fp8.quantize_ref(t)) for t in (g, u)])
    assert torch.equal(_loaded(gate_up, [(0, g), (1, u)]), want)
    q, k, v = _w((256, 200), 3), _w((128, 200), 4), _w((128, 200), 5)
    qkv = lin.QKVParallelLinear(200, 64, 4, 2, bias=False, quant_config=c, prefix="model.layers.0.self_attn.qkv_proj",
                                params_dtype=torch.bfloat16)
    want = torch.cat([fp8.dequantize_ref(*fp8.quantize_ref(t)) for t in (q, k, v)])
    assert torch.equal(_loaded(qkv, [("q", q), ("k", k), ("v", v)]), want)


def test_sglang_refuses_a_merged_layer_whose_parts_are_not_whole_blocks(sglang):
    """Why the tiny models (64-wide) are served in FP8 by the embedded engine only: a real server
    needs every part of a merged layer (gate/up: the intermediate size; q/k/v: heads x head size) to
    be a multiple of 128."""
    with pytest.raises(ValueError, match="not divisible by weight quantization block_n = 128"):
        sglang.linear.MergedColumnParallelLinear(64, [160, 160], bias=False, quant_config=sglang.config,
                                                 prefix="model.layers.0.mlp.gate_up_proj")


# ----------------------------------------------------------------------------------- MoE experts
MOE_INTERMEDIATE = 128
"""The experts' width of the tiny MoE judged here. Both servers' block-FP8 MoE needs it a whole number
of 128-row blocks: SGLang refuses anything else when it builds the layer; vLLM 0.32 (one rank) shrinks
its blocks (to 32 x 32 for the tiny models' default width, 32) and then fails to load the one scale per
128 x 128 block every FP8 checkpoint (and our sender) carries. Both are asserted below
(``test_sglang_refuses_experts_narrower_than_a_block``, ``test_vllm_fused_moe_holds_our_fp8_experts_and_scales``).
The tiny models' default is served in FP8 by the embedded engine only."""


def _sent(state: dict) -> list[tuple[str, torch.Tensor]]:
    """What the trainer puts on the wire for ``state`` with ``weights.quantize: fp8``: the bucket
    gatherer with the FP8 encoder every transport sends through (fused experts split per expert, linear
    weights quantised); (name, tensor) in wire order, several buckets."""
    buckets, *_ = _encoded_buckets(state, torch.bfloat16, 16 << 10)
    assert len(buckets) > 1
    return [(n, b.tensor(i).clone()) for b in buckets for i, n in enumerate(b.names)]


def _tiny_moe(root, intermediate: int):
    """(path, HF config, the experts' tensors as sent) of a one-layer tiny Qwen3-MoE."""
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf

    path = build_tiny_qwen3_moe(str(root / f"moe{intermediate}"), num_layers=1, moe_intermediate_size=intermediate)
    model = load_hf(path)
    experts = [(n, t) for n, t in _sent(model.state_dict()) if ".mlp.experts." in n]
    return path, model.config, experts


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return _tiny_moe(tmp_path_factory.mktemp("fp8_moe"), MOE_INTERMEDIATE)


_PROJ_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _expert_of(name: str) -> tuple[int, str, bool]:
    """(expert, the servers' shard id, is a scale) of a sent per-expert name."""
    m = re.fullmatch(r"model\.layers\.0\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight(_scale_inv)?", name)
    assert m is not None, f"unexpected expert tensor name {name!r}"
    return int(m[1]), _PROJ_SHARD[m[2]], m[3] is not None


def _assert_experts_hold_ours(params: dict, sent: list, num_experts: int) -> None:
    """Each expert's ``w13`` (gate rows, then up rows), ``w2`` and both ``weight_scale_inv`` are our sent
    tensors bit for bit, and each part of the server's parameter has our tensor's shape exactly (the
    loaders copy with broadcasting or zero-fill a short part: a shape they would reject or pad must fail
    here, not load)."""
    ours = dict(sent)
    assert set(params) == {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}
    assert params["w13_weight"].dtype == params["w2_weight"].dtype == torch.float8_e4m3fn
    assert params["w13_weight_scale_inv"].dtype == params["w2_weight_scale_inv"].dtype == torch.float32
    assert params["w13_weight"].shape[0] == num_experts
    for e in range(num_experts):
        for suffix in ("weight", "weight_scale_inv"):
            gate, up, down = (ours[f"model.layers.0.mlp.experts.{e}.{p}.{suffix}"]
                              for p in ("gate_proj", "up_proj", "down_proj"))
            w13, w2 = params[f"w13_{suffix}"][e], params[f"w2_{suffix}"][e]
            assert tuple(w13.shape) == (2 * gate.shape[0], gate.shape[1]) and up.shape == gate.shape, (e, suffix)
            assert tuple(w2.shape) == tuple(down.shape), (e, suffix)
            for got, want in ((w13, torch.cat([gate, up])), (w2, down)):
                assert got.dtype == want.dtype, (e, suffix)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (e, suffix)


def _sglang_experts(sglang, monkeypatch, path, hf_config, intermediate: int, cuda_loader: bool = True):
    """SGLang's MoE layer of a Qwen3-MoE block, built as its ``Qwen3MoeSparseMoeBlock`` builds it
    (``get_moe_impl_class``), under a runtime context of its own (``create_context``: a ``ServerArgs``
    for ``model_path`` with ``--quantization fp8`` on one rank; SGLang's embedded use of its layers).
    ``cuda_loader``: the loader branch a CUDA server takes (SGLang's module flag ``_is_cpu`` False);
    on CPU it narrows through its padded loader instead. The flag stays set for the rest of the test:
    the loader reads it when it loads, not only when the layer is built."""
    rc = sglang_module(VERSION, "sglang.srt.runtime_context")
    server_args = sglang_module(VERSION, "sglang.srt.server_args")
    ep = sglang_module(VERSION, "sglang.srt.layers.moe.ep_moe.layer")
    fused = sglang_module(VERSION, "sglang.srt.layers.moe.fused_moe_triton.layer")
    qwen3_moe = sglang_module(VERSION, "sglang.srt.models.qwen3_moe")
    args = server_args.ServerArgs(model_path=path, quantization="fp8", device="cpu", skip_tokenizer_init=True)
    ctx = rc.create_context(args, role="test", ranks=rc.SpawnRanks(world_rank=0))
    monkeypatch.setattr(fused, "_is_cpu", not cuda_loader)
    with rc.use_context(ctx):
        experts = ep.get_moe_impl_class(sglang.config)(
            num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok, layer_id=0,
            hidden_size=hf_config.hidden_size, intermediate_size=intermediate, quant_config=sglang.config,
            prefix="model.layers.0.mlp.experts", routing_method_type=qwen3_moe.RoutingMethodType.Renormalize)
    return rc, ctx, qwen3_moe, experts


@pytest.mark.parametrize("cuda_loader", [True, False], ids=["cuda_loader", "cpu_loader"])
def test_sglang_fused_moe_holds_our_fp8_experts_and_scales(sglang, tiny_moe, cuda_loader, monkeypatch):
    """SGLang's ``FusedMoE`` with ``Fp8MoEMethod`` (128 x 128 blocks), loaded by its Qwen3-MoE
    ``load_weights`` and post-processed by the method: every tensor we send reaches its expert and shard
    once, and each expert's ``w13``/``w2`` and scales are ours bit for bit, in shapes that are ours."""
    path, hf_config, sent = tiny_moe
    rc, ctx, qwen3_moe, experts = _sglang_experts(sglang, monkeypatch, path, hf_config, MOE_INTERMEDIATE, cuda_loader)
    assert experts.use_padded_loading == (not cuda_loader)  # the branch asked for
    assert isinstance(experts.quant_method, sglang.fp8.Fp8MoEMethod) and experts.quant_method.block_quant
    calls = []
    for n, p in experts.named_parameters():
        p.data.view(torch.uint8).fill_(0xFF)  # NaN in FP8 and fp32: a slot no loader call wrote stays NaN

        def loader(param, w, name, shard_id, expert_id, _orig=p.weight_loader, _n=n):
            calls.append((_n, shard_id, expert_id))
            return _orig(param, w, name, shard_id=shard_id, expert_id=expert_id)

        p.weight_loader = loader
    model = torch.nn.Module()  # Qwen3MoeForCausalLM's tree down to the experts, for its own load_weights
    model.config = hf_config
    model.model = torch.nn.Module()
    model.model.start_layer, model.model.end_layer = 0, 1
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.experts = experts
    with rc.use_context(ctx):
        qwen3_moe.Qwen3MoeForCausalLM.load_weights(model, sent)
        experts.quant_method.process_weights_after_loading(experts)
    # every tensor we send reaches its expert and shard once (the model's loader skips a name it cannot place)
    want = sorted((("w13_" if shard != "w2" else "w2_") + ("weight_scale_inv" if scale else "weight"), shard, e)
                  for e, shard, scale in map(_expert_of, (n for n, _ in sent)))
    assert sorted(calls) == want
    _assert_experts_hold_ours({n: p.data for n, p in experts.named_parameters()}, sent, hf_config.num_experts)


def test_sglang_refuses_experts_narrower_than_a_block(sglang, tiny_moe, monkeypatch):
    """The tiny models' default experts (32 wide): SGLang refuses to build the layer."""
    path, hf_config, _ = tiny_moe
    with pytest.raises(ValueError, match="32 is not divisible by weight quantization block_n = 128"):
        _sglang_experts(sglang, monkeypatch, path, hf_config, 32)


def _vllm_python():
    import real_vllm as rv

    try:
        return rv.vllm_python()
    except rv.VLLMUnavailable as e:
        rv.skip_or_fail(str(e))


@pytest.fixture(scope="module")
def vllm_loaded(tmp_path_factory, tiny_moe):
    """One run of real vLLM 0.32 (its CPU build's interpreter, ``_vllm_fp8_loader.py``) loading every
    case: (the cases sent, what vLLM's layers hold)."""
    import json
    import subprocess

    python = _vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_fp8")
    cases = {"replicated": dict(zip(("weight", "weight_scale_inv"), fp8.quantize(_w((130, 257), 0))))}
    g, u = fp8.quantize(_w((256, 200), 1)), fp8.quantize(_w((256, 200), 2))
    cases["gate_up"] = {"g": g[0], "g_scale": g[1], "u": u[0], "u_scale": u[1]}
    cases["qkv"] = {}
    for s, rows, seed in (("q", 256, 3), ("k", 128, 4), ("v", 128, 5)):
        cases["qkv"][s], cases["qkv"][s + "_scale"] = fp8.quantize(_w((rows, 200), seed))
    for name, (_path, c, sent) in (("moe", tiny_moe), ("moe_unaligned", _tiny_moe(tmp, 32))):
        cases[name] = {"hidden": c.hidden_size, "intermediate": c.moe_intermediate_size, "experts": c.num_experts,
                       "top_k": c.num_experts_per_tok, "weights": sent}
    torch.save(cases, tmp / "in.pt")
    qc = json.dumps(fp8.quantization_config(["model.layers.0.mlp.gate.weight", "lm_head.weight"]))
    r = subprocess.run([str(python), os.path.join(os.path.dirname(__file__), "_vllm_fp8_loader.py"),
                        str(tmp / "in.pt"), str(tmp / "out.pt"), qc],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    return cases, torch.load(tmp / "out.pt")


@pytest.mark.slow  # vLLM's interpreter in a subprocess (its import: ~10-20 s), shared with the MoE test
def test_vllm_block_fp8_layers_hold_our_weights_and_scales(vllm_loaded):
    """Our config makes vLLM's ``Fp8LinearMethod`` with 128 x 128 blocks, its loaders put our FP8 bytes
    and scales into a plain, a merged gate/up and a q/k/v layer bit for bit, and the router stays
    unquantised."""
    cases, res = vllm_loaded
    assert res["router_method"] == "UnquantizedLinearMethod"
    c = cases
    want = {"replicated": [c["replicated"]["weight"]], "gate_up": [c["gate_up"]["g"], c["gate_up"]["u"]],
            "qkv": [c["qkv"][s] for s in "qkv"]}
    want_s = {"replicated": [c["replicated"]["weight_scale_inv"]],
              "gate_up": [c["gate_up"]["g_scale"], c["gate_up"]["u_scale"]],
              "qkv": [c["qkv"][s + "_scale"] for s in "qkv"]}
    for name in want:
        assert res[name]["method"] == "Fp8LinearMethod"
        assert torch.equal(res[name]["weight"].view(torch.uint8), torch.cat(want[name]).view(torch.uint8)), name
        assert torch.equal(res[name]["weight_scale_inv"], torch.cat(want_s[name])), name


@pytest.mark.slow  # the vLLM run above
def test_vllm_fused_moe_holds_our_fp8_experts_and_scales(vllm_loaded, tiny_moe):
    """vLLM's ``FusedMoEFactory`` layer with ``Fp8MoEMethod`` (128 x 128 blocks), loaded by its
    Qwen3-MoE ``load_weights``: every tensor we send reaches its expert and shard once, and each
    expert's ``w13``/``w2`` and scales are ours bit for bit, in shapes that are ours. The tiny models'
    default experts (32 wide) it cannot load (``MOE_INTERMEDIATE``)."""
    _path, hf_config, sent = tiny_moe
    _cases, res = vllm_loaded
    moe = res["moe"]
    assert "error" not in moe, moe.get("error")
    assert moe["method"] == "Fp8MoEMethod" and moe["block_quant"] and moe["weight_block_size"] == [128, 128]
    assert {n: s for n, (s, _d) in moe["expected"].items()} == {n: tuple(p.shape) for n, p in moe["params"].items()}
    want = sorted((f"model.layers.0.mlp.experts.{'w2' if shard == 'w2' else 'w13'}_"
                   f"{'weight_scale_inv' if scale else 'weight'}", shard, e, True)
                  for e, shard, scale in map(_expert_of, (n for n, _ in sent)))
    assert sorted(moe["calls"]) == want
    assert moe["loaded"] == sorted(f"layers.0.mlp.experts.routed_experts.{n}" for n in moe["params"])
    _assert_experts_hold_ours(moe["params"], sent, hf_config.num_experts)
    assert "must match the size of tensor" in res["moe_unaligned"]["error"]


def test_the_launch_flags_are_the_servers_own(sglang):
    """``--quantization fp8``: a choice of SGLang's flag and a flag and method of vLLM's (both wheels)."""
    from vllm_wheel import source_dir_or_skip, unknown_vllm_flags

    choices = sglang_module(VERSION, "sglang.srt.arg_groups.choices")
    assert fp8.SERVER_FLAGS["sglang"] == ("--quantization", "fp8") and "fp8" in choices.QUANTIZATION_CHOICES
    assert unknown_vllm_flags("0.33.0", list(fp8.SERVER_FLAGS["vllm"])) == []
    methods = (source_dir_or_skip("0.33.0") / "vllm/model_executor/layers/quantization/__init__.py").read_text()
    assert '"fp8": Fp8Config' in methods
