"""Varlen attention: the packed forward equals the unpacked per-sequence forward."""

import pytest
import torch
import torch.nn.functional as F

from areal_fast.trainer import attention
from areal_fast.trainer.attention import varlen_attention_ref

# fp32 attention over <= 40 tokens: different summation orders differ by ~1e-7
ATOL = 1e-5


def _dense_block_causal(q, k, v, cu, scaling, window=None):
    """Oracle: one SDPA call over the whole pack with a block-diagonal causal mask."""
    T = q.shape[0]
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    pos = torch.arange(T)
    mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    rep = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)
    kt, vt = (x.transpose(0, 1).repeat_interleave(rep, 0) for x in (k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scaling).transpose(0, 1)


@pytest.mark.parametrize("lens,window", [([5, 1, 9, 3], None), ([7, 0, 12], None), ([10, 6], 4)])
def test_varlen_ref_matches_block_diagonal_mask(lens, window):
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q = torch.randn(T, 4, 8, generator=g)
    k = torch.randn(T, 2, 8, generator=g)
    v = torch.randn(T, 2, 8, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = varlen_attention_ref(q, k, v, cu, 0.3, window)
    torch.testing.assert_close(out, _dense_block_causal(q, k, v, cu, 0.3, window), atol=ATOL, rtol=0)


def test_resolve_impl_on_cpu():
    assert attention.resolve_impl("auto", torch.device("cpu")) == "sdpa_loop"
    with pytest.raises(RuntimeError, match="flash_attn"):
        attention.resolve_impl("flash_attn", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention impl"):
        attention.resolve_impl("bogus", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_forward_equals_per_sequence_forward(arch):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    cfg = Qwen2Config(**kw) if arch == "qwen2" else LlamaConfig(**kw)
    torch.manual_seed(0)
    ref_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    packed_model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention.register("sdpa_loop")).eval()
    packed_model.load_state_dict(ref_model.state_dict())
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 100, (n,), generator=g) for n in (11, 1, 23, 6)]
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = packed_model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                              max_length_q=max(lens), max_length_k=max(lens)).logits[0]
        for s, a, b in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
            single = ref_model(input_ids=s[None]).logits[0]
            torch.testing.assert_close(packed[a:b], single, atol=ATOL, rtol=0)
    # a whole-pack forward WITHOUT cu_seqlens attends across sequences: the test can fail
    with torch.no_grad():
        leaky = packed_model(input_ids=ids).logits[0]
    assert not torch.allclose(leaky[cu[1]:cu[3]], packed[cu[1]:cu[3]], atol=ATOL)
