"""Contract: the FP8 weights we send (``weights/fp8.py``) load into SGLang's own block-FP8 linear layers
(the released wheel, imported on CPU): its ``Fp8Config`` read from the ``quantization_config`` we write,
its linear layers' weight loaders (whole, and per shard for the merged gate/up and q/k/v layers) and
its ``Fp8LinearMethod.process_weights_after_loading``; the layer then holds our FP8 bytes and scales,
so it computes with our dequantised values. Its shape rule (every part of a merged layer a whole
number of 128-row blocks) is checked as SGLang checks it. Skipped only when the wheel cannot be
downloaded."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from areal_fast.weights import fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_wheel import sglang_module  # noqa: E402

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


def _vllm_python():
    import real_vllm as rv

    try:
        return rv.vllm_python()
    except rv.VLLMUnavailable as e:
        rv.skip_or_fail(str(e))


@pytest.mark.slow  # vLLM's interpreter in a subprocess (its import: ~10-20 s)
def test_vllm_block_fp8_layers_hold_our_weights_and_scales(tmp_path):
    """Real vLLM 0.32 (its CPU build's interpreter, ``_vllm_fp8_loader.py``): our config makes its
    ``Fp8LinearMethod`` with 128 x 128 blocks, its loaders put our FP8 bytes and scales into a plain,
    a merged gate/up and a q/k/v layer bit for bit, and the router stays unquantised."""
    import json
    import subprocess

    python = _vllm_python()
    cases = {"replicated": dict(zip(("weight", "weight_scale_inv"), fp8.quantize(_w((130, 257), 0))))}
    g, u = fp8.quantize(_w((256, 200), 1)), fp8.quantize(_w((256, 200), 2))
    cases["gate_up"] = {"g": g[0], "g_scale": g[1], "u": u[0], "u_scale": u[1]}
    cases["qkv"] = {}
    for s, rows, seed in (("q", 256, 3), ("k", 128, 4), ("v", 128, 5)):
        cases["qkv"][s], cases["qkv"][s + "_scale"] = fp8.quantize(_w((rows, 200), seed))
    torch.save(cases, tmp_path / "in.pt")
    qc = json.dumps(fp8.quantization_config(["model.layers.0.mlp.gate.weight", "lm_head.weight"]))
    r = subprocess.run([str(python), os.path.join(os.path.dirname(__file__), "_vllm_fp8_loader.py"),
                        str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), qc],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    res = torch.load(tmp_path / "out.pt")
    assert res["router_method"] == "UnquantizedLinearMethod"
    want = {"replicated": [cases["replicated"]["weight"]], "gate_up": [g[0], u[0]],
            "qkv": [cases["qkv"][s] for s in "qkv"]}
    want_s = {"replicated": [cases["replicated"]["weight_scale_inv"]], "gate_up": [g[1], u[1]],
              "qkv": [cases["qkv"][s + "_scale"] for s in "qkv"]}
    for name in want:
        assert res[name]["method"] == "Fp8LinearMethod"
        assert torch.equal(res[name]["weight"].view(torch.uint8), torch.cat(want[name]).view(torch.uint8)), name
        assert torch.equal(res[name]["weight_scale_inv"], torch.cat(want_s[name])), name


def test_the_launch_flags_are_the_servers_own(sglang):
    """``--quantization fp8``: a choice of SGLang's flag and a flag and method of vLLM's (both wheels)."""
    from vllm_wheel import source_dir_or_skip, unknown_vllm_flags

    choices = sglang_module(VERSION, "sglang.srt.arg_groups.choices")
    assert fp8.SERVER_FLAGS["sglang"] == ("--quantization", "fp8") and "fp8" in choices.QUANTIZATION_CHOICES
    assert unknown_vllm_flags("0.33.0", list(fp8.SERVER_FLAGS["vllm"])) == []
    methods = (source_dir_or_skip("0.33.0") / "vllm/model_executor/layers/quantization/__init__.py").read_text()
    assert '"fp8": Fp8Config' in methods
