"""HF <-> SGLang layout maps: round trips, replicated kv heads, vocabulary padding, tied
embeddings, and the planner path (plan_tp_shard + interval copy) against the reference."""

from __future__ import annotations

import pytest
import torch

from areal_fast.weights.interval_copy import interval_copy
from areal_fast.weights.layout import ModelSpec, hf_to_sglang, sendable, sglang_to_hf
from areal_fast.weights.plan import dtype_code, plan_tp_shard, shard_rows


def _configs():
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  max_position_embeddings=64)
    return {
        "qwen2_tied": transformers.Qwen2Config(**common, num_key_value_heads=2, vocab_size=199,
                                               tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(**common, num_key_value_heads=4, head_dim=16, vocab_size=300,
                                          tie_word_embeddings=False),
        "llama_bias": transformers.LlamaConfig(**common, num_key_value_heads=2, vocab_size=257, attention_bias=True,
                                               mlp_bias=True, tie_word_embeddings=False),
    }


CONFIGS = _configs()


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_and_spec(request):
    import transformers

    cfg = CONFIGS[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    return model, ModelSpec.from_hf_config(cfg)


def test_spec_matches_transformers_state_dict(model_and_spec):
    model, spec = model_and_spec
    state = sendable(model.state_dict(), spec)
    assert list(state) == list(spec.hf_shapes())  # names and sending order
    assert {n: tuple(t.shape) for n, t in state.items()} == spec.hf_shapes()
    assert ("lm_head.weight" in state) == (not spec.tie_word_embeddings)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_round_trip_and_shapes(model_and_spec, tp):
    model, spec = model_and_spec
    if spec.num_kv_heads < tp and tp % spec.num_kv_heads or spec.intermediate_size % tp:
        pytest.skip("tp does not divide this model")
    state = {n: torch.randn(s) for n, s in spec.hf_shapes().items()}
    shards = hf_to_sglang(state, spec, tp)
    hd, h = spec.head_dim, spec.hidden_size
    nkv = max(1, spec.num_kv_heads // tp)
    vp = spec.padded_vocab(tp)
    assert vp % 64 == 0 and vp % tp == 0 and vp >= spec.vocab_size > vp - 64 * tp  # rule: test_weights_vocab.py
    for r, d in enumerate(shards):
        assert d["model.layers.0.self_attn.qkv_proj.weight"].shape == ((spec.num_heads // tp + 2 * nkv) * hd, h)
        assert d["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * spec.intermediate_size // tp, h)
        assert d["model.layers.0.self_attn.o_proj.weight"].shape == (h, spec.num_heads // tp * hd)
        assert d["model.layers.1.mlp.down_proj.weight"].shape == (h, spec.intermediate_size // tp)
        emb = d["model.embed_tokens.weight"]
        assert emb.shape == (vp // tp, h)
        lo = r * vp // tp
        n_real = max(0, min(spec.vocab_size - lo, vp // tp))
        assert torch.equal(emb[:n_real], state["model.embed_tokens.weight"][lo : lo + n_real])
        assert not emb[n_real:].any()  # vocabulary padding rows are zero
        assert ("lm_head.weight" in d) == (not spec.tie_word_embeddings)
        assert not any("rotary" in n for n in d)
    back = sglang_to_hf(shards, spec)
    assert set(back) == set(state)
    for n in state:
        assert torch.equal(back[n], state[n]), n


def test_replicated_kv_heads():
    spec = ModelSpec.from_hf_config(CONFIGS["qwen2_tied"])  # 8 heads, 2 kv heads
    state = {n: torch.randn(s) for n, s in spec.hf_shapes().items()}
    shards = hf_to_sglang(state, spec, 8)
    hd = spec.head_dim
    k = state["model.layers.0.self_attn.k_proj.weight"]
    for r in range(8):
        qkv = shards[r]["model.layers.0.self_attn.qkv_proj.weight"]
        head = r // 4  # tp / kv_heads = 4 ranks share each kv head
        assert torch.equal(qkv[hd : 2 * hd], k[head * hd : (head + 1) * hd])
        bias = shards[r]["model.layers.0.self_attn.qkv_proj.bias"]
        kb = state["model.layers.0.self_attn.k_proj.bias"]
        assert torch.equal(bias[hd : 2 * hd], kb[head * hd : (head + 1) * hd])
    shards[5]["model.layers.0.self_attn.qkv_proj.weight"][hd] += 1  # a replica that disagrees is caught
    with pytest.raises(ValueError, match="k_proj"):
        sglang_to_hf(shards, spec)


def test_bad_tp_is_named():
    spec = ModelSpec("llama", 1, 96, 96, num_heads=12, num_kv_heads=4, head_dim=8, vocab_size=100)
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        spec.sglang_params(6, 0)  # 4 kv heads cannot be replicated over 6 ranks
    with pytest.raises(ValueError, match="num_heads=12"):
        spec.sglang_params(8, 0)


@pytest.mark.parametrize("n_src_ranks", [1, 3])
@pytest.mark.parametrize("tp", [2, 4])
def test_planner_path_equals_reference(model_and_spec, tp, n_src_ranks):
    """fp32 FSDP-style shards -> bf16 SGLang buffers via plan_tp_shard + interval copy."""
    _, spec = model_and_spec
    names = list(spec.hf_shapes())
    state = {n: torch.randn(s) for n, s in spec.hf_shapes().items()}
    want = hf_to_sglang({n: t.to(torch.bfloat16) for n, t in state.items()}, spec, tp)
    shapes = [tuple(state[n].shape) for n in names]
    for r in range(tp):
        plan = plan_tp_shard(spec, tp, r, names, shapes, [dtype_code(torch.float32)] * len(names), torch.bfloat16,
                             n_ranks=n_src_ranks)
        buf = torch.zeros(plan.buffer_bytes, dtype=torch.uint8)
        for src_rank in range(n_src_ranks):  # each source rank copies the rows it holds
            local = []
            for n in names:
                lo, hi = shard_rows(state[n].shape[0], n_src_ranks, src_rank)
                local.append(state[n][lo:hi].contiguous())
            interval_copy(local, [buf], plan.intervals[src_rank])
        for n, shp, off in zip(plan.names, plan.shapes, plan.offsets.tolist()):
            got = buf[off : off + 2 * torch.Size(shp).numel()].view(torch.bfloat16).view(shp)
            assert torch.equal(got.view(torch.int16), want[r][n].view(torch.int16)), (r, n)


def test_colocated_shard_builder_on_cpu_and_gpu_only_update():
    from areal_fast.backends.sglang.colocated import ColocatedWeightSync
    from areal_fast.weights.colocated import build_tp_shard

    spec = ModelSpec.from_hf_config(CONFIGS["qwen2_tied"])
    state = {n: torch.randn(s) for n, s in spec.hf_shapes().items()}
    want = hf_to_sglang({n: t.to(torch.bfloat16) for n, t in state.items()}, spec, 4)
    for r in range(4):
        _, named, _ = build_tp_shard(state, spec, 4, r)
        assert [n for n, _ in named] == list(want[r])
        for n, t in named:
            assert torch.equal(t.view(torch.int16), want[r][n].view(torch.int16)), n
    if not torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="needs CUDA"):
            ColocatedWeightSync("http://127.0.0.1:1", spec).update(state, 1)
