"""The SGLang delta applier (``areal_fast.backends.sglang.delta``) on a model laid out like SGLang's
Qwen2 on one TP rank: fused qkv and gate_up, row-parallel o/down projections, a padded
vocab-parallel embedding, loaders that narrow and copy like SGLang's, and SGLang's stacked-name
``load_weights`` (unknown names skipped). After K delta updates every parameter on every rank is
bitwise what a whole load of the same weights gives; the release's own classes are checked against
the package where the SGLang wheel can be imported.
"""

from __future__ import annotations

import math

import pytest
import torch

from areal_fast.backends.sglang.delta import delta_model_class, trace_runs
from areal_fast.weights.delta import DeltaEncoder
from areal_fast.weights.gather import Bucket
from tools.weight_receiver import zero_model

H, NH, NKV, HD, INTER, VOCAB = 16, 4, 2, 4, 24, 37


def _narrow_copy(dst, w, dst_dim, dst_off, src_dim, src_off, size):
    dst.narrow(dst_dim, dst_off, size).copy_(w.narrow(src_dim, src_off, size))


class FakeSGLangQwen(torch.nn.Module):
    """SGLang's parameter layout and loaders for TP rank ``rank`` of ``tp`` (one layer)."""

    def __init__(self, tp: int = 1, rank: int = 0, dtype=torch.bfloat16):
        super().__init__()
        self.tp, self.rank = tp, rank
        q, kv, inter = NH * HD // tp, NKV * HD // tp, INTER // tp
        self.vocab_per = math.ceil(VOCAB / (8 * tp)) * 8  # padded like SGLang's vocab-parallel embedding
        shapes = {"model.embed_tokens.weight": (self.vocab_per, H), "model.norm.weight": (H,),
                  "model.layers.0.input_layernorm.weight": (H,),
                  "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, H),
                  "model.layers.0.self_attn.qkv_proj.bias": (q + 2 * kv,),
                  "model.layers.0.self_attn.o_proj.weight": (H, q),
                  "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, H),
                  "model.layers.0.mlp.down_proj.weight": (H, inter)}
        self.sizes = {"q": q, "k": kv, "v": kv, 0: inter, 1: inter}
        self.offs = {"q": 0, "k": q, "v": q + kv, 0: 0, 1: inter}
        zero_model(shapes, dtype, root=self)
        for n, p in self.named_parameters():
            p.weight_loader = self._loader_for(n)

    def _loader_for(self, name):
        r = self.rank
        if "qkv_proj" in name or "gate_up_proj" in name:
            return lambda p, w, shard: _narrow_copy(p.data, w, 0, self.offs[shard], 0, r * self.sizes[shard],
                                                    self.sizes[shard])
        if "o_proj" in name or "down_proj" in name:
            return lambda p, w: _narrow_copy(p.data, w, 1, 0, 1, r * p.data.shape[1], p.data.shape[1])
        if "embed_tokens" in name:
            def vocab(p, w):
                start = r * self.vocab_per
                n = max(0, min(VOCAB, start + self.vocab_per) - start)
                p.data[:n].copy_(w[start : start + n])
            return vocab
        return lambda p, w: p.data.copy_(w)

    def load_weights(self, weights):
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                   ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
        params = dict(self.named_parameters())
        for name, w in weights:
            for fused, part, shard in stacked:
                if part in name:
                    p = params[name.replace(part, fused)]
                    p.weight_loader(p, w, shard)
                    break
            else:
                if name in params:  # SGLang skips names it does not know
                    params[name].weight_loader(params[name], w)


def hf_state(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
         "model.layers.0.input_layernorm.weight": (H,),
         "model.layers.0.self_attn.q_proj.weight": (NH * HD, H),
         "model.layers.0.self_attn.k_proj.weight": (NKV * HD, H),
         "model.layers.0.self_attn.v_proj.weight": (NKV * HD, H), "model.layers.0.self_attn.q_proj.bias": (NH * HD,),
         "model.layers.0.self_attn.k_proj.bias": (NKV * HD,), "model.layers.0.self_attn.v_proj.bias": (NKV * HD,),
         "model.layers.0.self_attn.o_proj.weight": (H, NH * HD), "model.layers.0.mlp.gate_proj.weight": (INTER, H),
         "model.layers.0.mlp.up_proj.weight": (INTER, H), "model.layers.0.mlp.down_proj.weight": (H, INTER)}
    return {n: torch.randn(sh, generator=g) * 0.02 for n, sh in s.items()}


def _bucket(state: dict[str, torch.Tensor]) -> Bucket:
    ts = {n: t.to(torch.bfloat16).contiguous() for n, t in state.items()}
    offs, off = [], 0
    for t in ts.values():
        offs.append(off)
        off += t.numel() * 2
    return Bucket(index=0, names=list(ts), dtypes=[torch.bfloat16] * len(ts),
                  shapes=[tuple(t.shape) for t in ts.values()], offsets=offs,
                  data=torch.cat([t.view(-1).view(torch.uint8) for t in ts.values()]), last=True)


def _entries(b: Bucket):
    return [(n, b.tensor(i)) for i, n in enumerate(b.names)]


DeltaQwen = delta_model_class(__name__, "FakeSGLangQwen")


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_k_deltas_through_sglang_loaders_equal_a_whole_load(tp, rank):
    state = hf_state()
    model = DeltaQwen(tp, rank)
    enc = DeltaEncoder(full_every=100)
    for k in range(4):  # one whole update, then 3 deltas
        if k:
            g = torch.Generator().manual_seed(k)
            for t in state.values():
                m = torch.rand(t.shape, generator=g) < 0.05
                t[m] += 0.003
        enc.begin()
        out = enc.encode(_bucket(state))
        enc.done(True)
        assert enc.stats.mode == ("whole" if k == 0 else "delta")
        model.load_weights(_entries(out))
    ref = FakeSGLangQwen(tp, rank)
    ref.load_weights(_entries(_bucket(state)))
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    for n in want:
        assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), n


def test_trace_finds_the_shard_of_this_rank_and_restores_the_storage():
    model = FakeSGLangQwen(2, 1)
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    runs = trace_runs(model, "model.layers.0.self_attn.k_proj.weight", (NKV * HD, H), model.load_weights)
    assert [r[0] for r in runs] == ["model.layers.0.self_attn.qkv_proj.weight"]
    _, hf_start, p_start, length = runs[0]
    kv = NKV * HD // 2
    assert hf_start.tolist() == [kv * H] and p_start.tolist() == [NH * HD // 2 * H] and length.tolist() == [kv * H]
    rows = trace_runs(model, "model.layers.0.mlp.down_proj.weight", (H, INTER), model.load_weights)[0]
    assert len(rows[1]) == H  # an input-dim split: one run per row
    assert all((p.data_ptr(), p.dtype) == before[n] for n, p in model.named_parameters())


@pytest.mark.slow  # imports SGLang's model modules (~30 s per release on 2 cores)
@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_the_package_subclasses_the_release_models(version):
    import sys

    from sglang_wheel import sglang_module

    try:
        sglang_module(version, "sglang.srt.models.qwen2")
    except Exception as e:  # noqa: BLE001 - the model modules need more of SGLang than the stubs give
        pytest.skip(f"sglang {version}'s model modules do not import on this machine: {type(e).__name__}: {e}")
    import importlib

    for mod, cls in (("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("llama", "LlamaForCausalLM")):
        sys.modules.pop(f"areal_fast.backends.sglang.models.{mod}", None)  # built against this release
        ours = importlib.import_module(f"areal_fast.backends.sglang.models.{mod}").EntryClass
        base = sglang_module(version, f"sglang.srt.models.{mod}")
        assert ours.__name__ == cls and issubclass(ours, getattr(base, cls))


@pytest.mark.parametrize("bad", [-1, NKV * HD, 2**31 - 1])
def test_indices_outside_the_tensor_are_refused_before_anything_is_written(bad):
    """An index no run holds used to be dropped as "another rank's"; one outside the tensor is a
    broken update: refused, naming the tensor and the index, with no parameter touched (neither
    the good delta before it nor the whole tensor in the same call)."""
    from areal_fast.weights.delta_wire import DELTA_VAL, delta_name

    state = hf_state()
    model = DeltaQwen(2, 1)
    model.load_weights(_entries(_bucket(state)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    q, kb = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias"
    entries = [(delta_name(q, (NH * HD, H)), torch.tensor([0, NH * HD * H - 1], dtype=torch.int32)),
               (q + DELTA_VAL, torch.ones(2, dtype=torch.bfloat16)),
               ("model.norm.weight", torch.ones(H, dtype=torch.bfloat16)),
               (delta_name(kb, (NKV * HD,)), torch.tensor([0, bad], dtype=torch.int32)),
               (kb + DELTA_VAL, torch.ones(2, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=rf"{kb}.*index {bad}\b.*{NKV * HD} elements"):
        model.load_weights(entries)
    for n, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n


def test_a_streamed_call_checks_every_delta_before_applying_one():
    """An iterator (start-up's checkpoint stream) cannot be checked ahead of SGLang's loader, but
    no delta is applied while another one in the call is out of range."""
    from areal_fast.weights.delta_wire import DELTA_VAL, delta_name

    model = DeltaQwen(1, 0)
    model.load_weights(_entries(_bucket(hf_state())))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    q, kb = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias"
    entries = [(delta_name(q, (NH * HD, H)), torch.tensor([0], dtype=torch.int32)),
               (q + DELTA_VAL, torch.ones(1, dtype=torch.bfloat16)),
               (delta_name(kb, (NKV * HD,)), torch.tensor([NKV * HD], dtype=torch.int32)),
               (kb + DELTA_VAL, torch.ones(1, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=rf"{kb}.*index {NKV * HD}\b"):
        model.load_weights(iter(entries))
    for n, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
