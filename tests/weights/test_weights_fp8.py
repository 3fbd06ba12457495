"""Blockwise FP8 on sync (``weights/fp8.py``): the vectorised codec against its block-by-block reference,
which tensors travel in FP8, the encoded bucket every transport sends (back to back, in the order
vLLM's transfer announces), the disk file, the config's refusals, and the embedded engine serving the
dequantised weights (``embedded/fp8.py``, ``WeightReceiver.load``)."""

from __future__ import annotations

import re

import pytest
import torch

from areal_fast.config import ConfigError, load_config
from areal_fast.weights import fp8
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.experts import to_checkpoint_state
from areal_fast.weights.gather import BucketGatherer, collect_sources

# Shapes below, at and across a block edge in each dimension (a partial block has a scale of its own).
SHAPES = [(1, 1), (7, 5), (128, 128), (130, 257), (300, 129), (64, 896), (256, 384)]


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 0, shape[1])  # columns of very different size
    if shape[0] > 128 and shape[1] > 128:
        w[:128, :128] = 0  # an all-zero block
    return w


@pytest.mark.parametrize("shape", SHAPES)
def test_vectorised_codec_is_bitwise_the_reference(shape):
    w = _weight(shape)
    q, s = fp8.quantize(w)
    q_ref, s_ref = fp8.quantize_ref(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_shape(shape)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(fp8.dequantize(q, s), fp8.dequantize_ref(q, s))


@pytest.mark.parametrize("shape", SHAPES)
def test_quantisation_rounds_the_bf16_weight_to_the_nearest_fp8_value_of_its_block(shape):
    """Each element is within half a step of E4M3's top binade ([256, 448], step 32) of the bf16-rounded
    weight, in its block's scale; the block's largest element maps to 448 (the scale is amax / 448)."""
    w = _weight(shape, seed=1)
    x = w.to(torch.bfloat16).float()
    q, s = fp8.quantize(w)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    err = (fp8.dequantize(q, s) - x).abs()
    half_top_step = (torch.finfo(torch.float8_e4m3fn).max - 2 ** 8) / 6  # 448 - 256 spans 6 steps of 32: 16
    assert bool((err <= half_top_step * full).all())
    top = q.float().abs().amax()
    assert top == torch.finfo(torch.float8_e4m3fn).max or not bool(x.abs().amax() > fp8.AMAX_FLOOR)


def test_which_tensors_travel_in_fp8():
    """Linear projections (per expert too) in FP8; embeddings, norms, biases, LM head and routers as they are."""
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight",
           "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.shared_expert.gate_proj.weight"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
          "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate.weight",
          "model.layers.0.mlp.shared_expert_gate.weight"]
    assert all(fp8.is_quantized(n, (8, 8)) for n in yes)
    assert not any(fp8.is_quantized(n, (8, 8)) for n in no)
    assert not fp8.is_quantized("model.layers.0.self_attn.q_proj.bias", (8,))
    assert not fp8.is_quantized("model.layers.0.mlp.experts.gate_up_proj", (4, 16, 8))  # split first, then per expert


def test_quantization_config_keeps_the_lm_head_and_routers_unquantised():
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
             "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"]
    qc = fp8.quantization_config(names)
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                  "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]}


def _moe_state():
    g = torch.Generator().manual_seed(3)
    return {"model.embed_tokens.weight": torch.randn(50, 24, generator=g),
            "model.layers.0.input_layernorm.weight": torch.randn(24, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(130, 24, generator=g),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(130, generator=g),
            "model.layers.0.mlp.gate.weight": torch.randn(4, 24, generator=g),
            "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 2 * 9, 24, generator=g),
            "model.layers.0.mlp.experts.down_proj": torch.randn(4, 24, 9, generator=g),
            "lm_head.weight": torch.randn(50, 24, generator=g)}


def _encoded_buckets(state, dtype, bucket_bytes=4096):
    src = collect_sources(state)
    dtypes = [dtype] * len(src.names)
    g = BucketGatherer(bucket_bytes, encode=fp8.bucket_encoder(WeightSyncConfig(quantize="fp8")))
    out = []
    g.run(src, dtypes, lambda b: out.append(b) or _Done())
    return out, g.plan(src, dtypes), src, dtypes


class _Done:
    def wait(self):
        pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_encoded_buckets_carry_every_weight_once_back_to_back_in_the_announced_order(dtype):
    state = _moe_state()
    buckets, plan, src, dtypes = _encoded_buckets(state, dtype)
    assert plan.n_buckets > 1
    names = [n for b in buckets for n in b.names]
    assert fp8.transfer_wire(plan, src, dtypes)[0] == names  # vLLM's update_info order is the broadcast order
    assert fp8.transfer_wire(plan, src, dtypes)[1] == [str(d).removeprefix("torch.") for b in buckets for d in b.dtypes]
    ckpt = to_checkpoint_state(state)
    want = fp8.quantize_state(ckpt)
    assert sorted(names) == sorted(want)
    for b in buckets:  # SGLang's flattened bucket: no padding, every tensor aligned to its element size
        end = 0
        for i in range(len(b.names)):
            assert b.offsets[i] == end and end % b.dtypes[i].itemsize == 0
            end += b.tensor(i).numel() * b.dtypes[i].itemsize
        assert end == b.data.numel()
        for i, n in enumerate(b.names):
            t = b.tensor(i)
            if fp8.is_quantized(n, t.shape):
                assert t.dtype == torch.float8_e4m3fn
                assert torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))
            elif n.endswith(fp8.SCALE_SUFFIX):
                assert torch.equal(t, want[n])
            else:
                assert t.dtype == dtype and torch.equal(t, ckpt[n].to(dtype))
    received = fp8.dequantize_state([(n, b.tensor(i)) for b in buckets for i, n in enumerate(b.names)])
    for n, t in received:
        if fp8.is_quantized(n, t.shape):
            assert torch.equal(t, fp8.dequantize_ref(*fp8.quantize_ref(ckpt[n])))


def test_a_weight_without_its_scale_is_refused_naming_it():
    q, s = fp8.quantize(torch.randn(4, 4))
    with pytest.raises(ValueError, match="q_proj.weight arrived in FP8 without"):
        fp8.dequantize_state([("a.q_proj.weight", q)])
    with pytest.raises(ValueError, match="q_proj.weight_scale_inv arrived without"):
        fp8.dequantize_state([("a.q_proj.weight_scale_inv", s)])
    with pytest.raises(ValueError, match="does not fit a weight"):
        fp8.dequantize(q, torch.ones(2, 1))


def test_the_disk_transport_writes_fp8_safetensors(tmp_path):
    from safetensors.torch import load_file

    from areal_fast.weights.sync import write_safetensors

    buckets, *_ = _encoded_buckets(_moe_state(), torch.bfloat16, bucket_bytes=1 << 20)
    (b,) = buckets
    write_safetensors(str(tmp_path / "m.safetensors"), b)
    back = load_file(str(tmp_path / "m.safetensors"))
    for i, n in enumerate(b.names):
        assert back[n].dtype == b.dtypes[i]
        assert torch.equal(back[n].view(torch.uint8), b.tensor(i).contiguous().view(torch.uint8))


def test_config_refuses_deltas_and_lora_and_turns_auto_deltas_off():
    with pytest.raises(ValueError, match="^quantize:"):
        WeightSyncConfig(quantize="int8")
    with pytest.raises(ValueError, match="^delta: 'on' with quantize 'fp8'"):
        WeightSyncConfig(quantize="fp8", delta="on")
    assert WeightSyncConfig(quantize="fp8").delta == "off"
    assert WeightSyncConfig().delta == "auto"
    with pytest.raises(ConfigError, match="weights.quantize 'fp8' with train.lora"):
        load_config("examples/tiny_reverse_lora.yaml", ["weights.quantize=fp8"])
    with pytest.raises(ConfigError, match="weights.quantize 'fp8': the launched servers .* rollout.server_args"):
        load_config("examples/tiny_reverse.yaml", ["weights.quantize=fp8"])
    fp8_engine = 'rollout.server_args=["--quantization", "fp8"]'
    assert load_config("examples/tiny_reverse.yaml", ["weights.quantize=fp8", fp8_engine]).weights.quantize == "fp8"


def test_config_refuses_fp8_experts_that_sglang_and_vllm_cannot_load(tmp_path):
    # both load block-FP8 experts only in whole 128-wide blocks (judged in test_weights_fp8_servers.py)
    fp8 = ["weights.quantize=fp8", 'rollout.server_args=["--quantization", "fp8"]']
    for server in (["rollout.server=sglang"], ["rollout.server=vllm", "rollout.api=vllm"]):
        with pytest.raises(ConfigError, match="moe_intermediate_size 64, not a multiple of 128"):
            load_config("examples/tiny_reverse_moe.yaml", [*fp8, *server, "model.warm_start.moe_intermediate_size=64"])
    ok = load_config("examples/tiny_reverse_moe.yaml", [*fp8, "rollout.server=sglang",
                                                        "model.warm_start.moe_intermediate_size=128"])
    assert ok.weights.quantize == "fp8"
    load_config("examples/tiny_reverse_moe.yaml", [*fp8, "model.warm_start.moe_intermediate_size=64"])  # the engine
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "moe_intermediate_size": 96}')
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}/config.json has moe_intermediate_size 96")):
        load_config("examples/tiny_reverse_moe.yaml", [*fp8, "rollout.server=sglang", f"model.path={tmp_path}",
                                                       "model.warm_start.enabled=false"])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen2, build_tiny_qwen3_moe

    d = tmp_path_factory.mktemp("fp8_models")
    return {"dense": build_tiny_qwen2(str(d / "dense"), hidden_size=64, num_layers=1, intermediate_size=160),
            "moe": build_tiny_qwen3_moe(str(d / "moe"), hidden_size=64, num_layers=1)}


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_the_embedded_engine_serves_the_dequantised_weights(tiny_models, arch):
    """At launch (``--quantization fp8``) and after a sync, the engine's weights are the servers'
    dequantised values of what the trainer sends; the other weights are the trainer's."""
    from areal_fast.data.tiny_models import load_hf
    from areal_fast.embedded.fp8 import serve_fp8
    from areal_fast.embedded.weight_sync import WeightReceiver

    trainer = load_hf(tiny_models[arch])
    served = load_hf(tiny_models[arch])
    assert serve_fp8(served) > 0
    ckpt = to_checkpoint_state({k: v.detach() for k, v in trainer.state_dict().items()})
    got = to_checkpoint_state({k: v.detach() for k, v in served.state_dict().items()})
    for n, t in ckpt.items():
        want = fp8.dequantize_ref(*fp8.quantize_ref(t)) if fp8.is_quantized(n, t.shape) else t
        assert torch.equal(got[n], want), n
    # a sync of perturbed weights, through the encoded buckets, into the engine's receiver
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    buckets, *_ = _encoded_buckets(trainer, torch.bfloat16, bucket_bytes=1 << 14)
    WeightReceiver(served).load([(n, b.tensor(i)) for b in buckets for i, n in enumerate(b.names)])
    ckpt = to_checkpoint_state({k: v.detach() for k, v in trainer.state_dict().items()})
    got = to_checkpoint_state({k: v.detach() for k, v in served.state_dict().items()})
    for n, t in ckpt.items():
        want = fp8.dequantize_ref(*fp8.quantize_ref(t)) if fp8.is_quantized(n, t.shape) else t.to(torch.bfloat16)
        assert torch.equal(got[n], want.float()), n


@pytest.mark.gpu
def test_quantise_on_sync_on_cuda_matches_the_cpu_codec():
    """The GPU trainer's path: the buckets gathered from CUDA tensors are encoded on the GPU (the
    bucket's device), bit for bit what the CPU reference codec makes of the same bf16 weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    state = {n: t.cuda() for n, t in _moe_state().items()}
    state["model.layers.0.mlp.down_proj.weight"] = _weight((300, 257)).cuda()  # partial blocks on both edges
    buckets, *_ = _encoded_buckets(state, torch.bfloat16, bucket_bytes=1 << 16)
    want = fp8.quantize_state(to_checkpoint_state({n: t.cpu() for n, t in state.items()}))
    seen = set()
    for b in buckets:
        assert b.data.device.type == "cuda"
        for i, n in enumerate(b.names):
            t = b.tensor(i).cpu()
            if t.dtype == torch.float8_e4m3fn:
                q_ref, _ = fp8.quantize_ref(to_checkpoint_state({k: v.cpu() for k, v in state.items()})[n])
                assert torch.equal(t.view(torch.uint8), q_ref.view(torch.uint8)), n
            elif n.endswith(fp8.SCALE_SUFFIX):
                assert torch.equal(t, want[n]), n
            seen.add(n)
    assert seen == set(want)


@pytest.mark.slow  # a sender subprocess (torch import) and three engines
def test_every_transport_delivers_the_fp8_weights_to_the_engine(tmp_path):
    """SGLang's broadcast and disk transports and vLLM's weight transfer, with ``quantize: fp8``, each
    leave its own embedded engine (``--quantization fp8``; the vLLM twin) holding the dequantised FP8
    values of the trainer's bf16-rounded weights, and its other weights as sent."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, perturbed_state_dict
    from areal_fast.embedded import start_engine_in_thread

    model_dir = build_tiny_qwen3_moe(str(tmp_path / "base"), hidden_size=64, num_layers=1)
    state = perturbed_state_dict(model_dir, seed=7)
    torch.save(state, tmp_path / "s.pt")
    ckpt = to_checkpoint_state(state)
    want = {n: fp8.dequantize_ref(*fp8.quantize_ref(t)) if fp8.is_quantized(n, t.shape) else t.to(torch.bfloat16)
            for n, t in ckpt.items()}
    engines = [start_engine_in_thread(model_dir, seed=1, dtype="float32", quantization="fp8") for _ in range(2)]
    engines.append(start_engine_in_thread(model_dir, seed=1, api="vllm", vllm_version="0.33.0", dtype="float32",
                                          quantization="fp8"))
    sender = Path(__file__).with_name("_fp8_sender.py")
    try:
        r = subprocess.run([sys.executable, str(sender), str(tmp_path / "s.pt"), *(h.url for h in engines),
                            str(tmp_path)],
                           capture_output=True, text=True, timeout=240,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(sender.parent),
                                                                               os.environ.get("PYTHONPATH", "")])})
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.count("SENT") == 3
        for h, transport in zip(engines, ("broadcast", "disk", "vLLM transfer")):
            assert h.server.scheduler.weight_version == "1", transport
            got = to_checkpoint_state({k: v.detach() for k, v in h.server.model.state_dict().items()})
            for n, w in want.items():
                assert torch.equal(got[n], w.float()), (transport, n)
    finally:
        for h in engines:
            h.stop()
