"""Varlen attention: the packed forward equals the unpacked per-sequence forward."""

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from tolerances import FP32_SHORT_ATTN_ATOL, FP32_SHORT_ATTN_GRAD_TOL

from areal_fast.trainer import attention
from areal_fast.trainer.attention import varlen_attention_ref


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
    torch.testing.assert_close(out, _dense_block_causal(q, k, v, cu, 0.3, window), atol=FP32_SHORT_ATTN_ATOL, rtol=0)


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
            torch.testing.assert_close(packed[a:b], single, atol=FP32_SHORT_ATTN_ATOL, rtol=0)
    # a whole-pack forward WITHOUT cu_seqlens attends across sequences: the test can fail
    with torch.no_grad():
        leaky = packed_model(input_ids=ids).logits[0]
    assert not torch.allclose(leaky[cu[1]:cu[3]], packed[cu[1]:cu[3]], atol=FP32_SHORT_ATTN_ATOL)


# ---------------------------------------------------------------- torch varlen_attn, per torch release
# Fakes with the keyword sets of the releases we meet; each computes causal (optionally windowed)
# attention per sequence. Like torch: 2.10 and 2.11 hand K/V to the flash kernel as they are, which
# reads Hkv < Hq heads directly (GQA); 2.13 refuses Hq != Hkv unless it gets enable_gqa.
def _fake_attend(q, k, v, cu_q, scale, left, gqa):
    if q.shape[1] != k.shape[1] and not gqa:
        raise ValueError(f"fake varlen_attn: Hq={q.shape[1]} != Hkv={k.shape[1]} without enable_gqa")
    return varlen_attention_ref(q, k, v, cu_q, scale, None if left < 0 else left + 1)


def fake_varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False,
                     scale=None):
    assert is_causal, "the trainer's attention is causal"
    return _fake_attend(query, key, value, cu_seq_q, scale, -1, True)


def fake_varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    assert window_size[1] == 0, "the trainer's attention is causal"
    return _fake_attend(query, key, value, cu_seq_q, scale, window_size[0], True)


def fake_varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert window_size[1] == 0, "the trainer's attention is causal"
    return _fake_attend(query, key, value, cu_seq_q, scale, window_size[0], enable_gqa)


def _packed_qkv(lens, hq=6, hkv=2, d=8):
    g = torch.Generator().manual_seed(3)
    T = sum(lens)
    q = torch.randn(T, hq, d, generator=g)
    k, v = torch.randn(T, hkv, d, generator=g), torch.randn(T, hkv, d, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


def _repeated_kv_ref(q, k, v, cu, scale, window=None):
    """Oracle with K/V repeated to the query heads by hand (what the kernels must equal)."""
    rep = q.shape[1] // k.shape[1]
    return _dense_block_causal(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu, scale, window)


@contextlib.contextmanager
def refusing_kv_repeat(monkeypatch):
    """K/V must not be repeated to the query heads (``[T, Hq, D]`` copies: 13 GB of saved activations
    at 32k tokens and 28 layers of a 7B GQA model): inside, every repeat_interleave raises."""
    def refuse(*a, **k):
        raise AssertionError("K/V repeated to the query heads (repeat_interleave called)")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "repeat_interleave", refuse)
        m.setattr(torch, "repeat_interleave", refuse)
        yield


def _with_grads(out, inputs):
    return out, torch.autograd.grad(out.square().sum(), inputs)


def _assert_same(got, want):
    (out, grads), (want_out, want_grads) = got, want
    torch.testing.assert_close(out, want_out, atol=FP32_SHORT_ATTN_ATOL, rtol=0)
    for a, b in zip(grads, want_grads):  # dK, dV: summed over each KV head's query group, as the repeat's backward
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **FP32_SHORT_ATTN_GRAD_TOL)


@pytest.mark.parametrize("fake", [fake_varlen_2_10, fake_varlen_2_11, fake_varlen_2_13])
@pytest.mark.parametrize("hkv", [6, 2, 1])
def test_torch_varlen_call_matches_reference_for_every_signature(fake, hkv):
    lens = [5, 1, 9, 0, 3]
    q, k, v, cu = _packed_qkv(lens, hkv=hkv)
    args, kwargs = attention.torch_varlen_call(fake, q, k, v, cu, cu, max(lens), max(lens), 0.3)
    inspect.signature(fake).bind(*args, **kwargs)
    assert args[1].shape[1] == hkv and args[2].shape[1] == hkv, "K/V reach the kernel with their own heads"
    out = fake(*args, **kwargs)
    torch.testing.assert_close(out, varlen_attention_ref(q, k, v, cu, 0.3), atol=FP32_SHORT_ATTN_ATOL, rtol=0)


@pytest.mark.parametrize("fake", [fake_varlen_2_10, fake_varlen_2_11, fake_varlen_2_13])
def test_torch_varlen_gqa_gives_the_repeated_output_and_gradients_without_repeating(fake, monkeypatch):
    lens = [5, 1, 9, 0, 3]
    q, k, v, cu = (t.requires_grad_() if t.is_floating_point() else t for t in _packed_qkv(lens, hkv=2))
    want = _with_grads(_repeated_kv_ref(q, k, v, cu, 0.3), (q, k, v))
    with refusing_kv_repeat(monkeypatch):
        args, kwargs = attention.torch_varlen_call(fake, q, k, v, cu, cu, max(lens), max(lens), 0.3)
        got = _with_grads(fake(*args, **kwargs), (q, k, v))
    _assert_same(got, want)


def test_torch_varlen_call_repeats_kv_where_the_kernel_cannot_take_gqa():
    lens = [4, 7]
    q, k, v, cu = _packed_qkv(lens, hkv=2)
    for fake in (fake_varlen_2_11, fake_varlen_2_13):
        args, kwargs = attention.torch_varlen_call(fake, q, k, v, cu, cu, 7, 7, 0.3, native_gqa=False)
        assert args[1].shape[1] == 6 and args[2].shape[1] == 6 and not kwargs.get("enable_gqa")
        torch.testing.assert_close(fake(*args, **kwargs), _repeated_kv_ref(q, k, v, cu, 0.3),
                                   atol=FP32_SHORT_ATTN_ATOL, rtol=0)


def test_varlen_gqa_native_follows_the_backend_torch_routes_to(monkeypatch):
    import sys
    import types

    cuda0, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert attention.varlen_gqa_native(fake_varlen_2_11, cuda0)  # no cuDNN routing: the flash kernel
    mod = types.ModuleType("fake_torch_varlen")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        raise AssertionError("not called")

    varlen_attn.__module__ = mod.__name__
    mod._should_use_cudnn = lambda index: False
    assert attention.varlen_gqa_native(varlen_attn, cuda0)
    mod._should_use_cudnn = lambda index: True  # routed to cuDNN, which does not take Hkv < Hq there
    assert not attention.varlen_gqa_native(varlen_attn, cuda0)
    assert attention.varlen_gqa_native(varlen_attn, cpu)  # only CUDA tensors are routed to cuDNN
    mod._select_backend = lambda *a, **k: 0  # torch picks per call and leaves cuDNN for GQA
    assert attention.varlen_gqa_native(varlen_attn, cuda0)


@pytest.mark.parametrize("window", [None, 4])
def test_sdpa_loop_gqa_gives_the_repeated_output_and_gradients_without_repeating(window, monkeypatch):
    lens = [5, 1, 9, 0, 3]
    q, k, v, cu = (t.requires_grad_() if t.is_floating_point() else t for t in _packed_qkv(lens, hkv=2))
    want = _with_grads(_repeated_kv_ref(q, k, v, cu, 0.3, window), (q, k, v))
    with refusing_kv_repeat(monkeypatch):
        got = _with_grads(varlen_attention_ref(q, k, v, cu, 0.3, window), (q, k, v))
    _assert_same(got, want)


def test_unpacked_forward_gqa_gives_the_repeated_output_and_gradients_without_repeating(monkeypatch):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, 9, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 9, 8, generator=g, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True,
                                         scale=0.3)
    want = _with_grads(ref.transpose(1, 2), (q, k, v))
    with refusing_kv_repeat(monkeypatch):
        out, _ = attention.varlen_attention_forward(None, q, k, v, None, scaling=0.3)
        got = _with_grads(out, (q, k, v))
    _assert_same(got, want)


@pytest.mark.parametrize("fake", [fake_varlen_2_11, fake_varlen_2_13])
def test_torch_varlen_call_sliding_window(fake):
    lens = [10, 6]
    q, k, v, cu = _packed_qkv(lens)
    args, kwargs = attention.torch_varlen_call(fake, q, k, v, cu, cu, 10, 10, 0.3, sliding_window=4)
    assert kwargs["window_size"] == (3, 0)
    torch.testing.assert_close(fake(*args, **kwargs), _dense_block_causal(q, k, v, cu, 0.3, 4),
                               atol=FP32_SHORT_ATTN_ATOL, rtol=0)


def test_torch_varlen_call_refuses_window_without_window_size():
    q, k, v, cu = _packed_qkv([4])
    with pytest.raises(NotImplementedError, match="sliding_window=4"):
        attention.torch_varlen_call(fake_varlen_2_10, q, k, v, cu, cu, 4, 4, 0.3, sliding_window=4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        q4, k4, v4, _ = _packed_qkv([4], hkv=4)  # 6 query heads cannot share 4 KV heads
        attention.torch_varlen_call(fake_varlen_2_13, q4, k4, v4, cu, cu, 4, 4, 0.3)


@pytest.mark.skipif(not attention._has_torch_varlen(), reason="this torch has no torch.nn.attention.varlen")
@pytest.mark.parametrize("hkv,window", [(2, None), (6, None), (2, 4)])
def test_torch_varlen_call_fits_installed_torch(hkv, window):
    """The call we would make on CUDA binds to the installed signature and passes the installed
    function's own checks: it is run on meta tensors (torch's fake kernel: shapes only)."""
    from torch.nn.attention.varlen import varlen_attn

    lens = [5, 7]
    q, k, v, cu = (t.to("meta") for t in _packed_qkv(lens, hkv=hkv))
    args, kwargs = attention.torch_varlen_call(varlen_attn, q, k, v, cu, cu, 7, 7, 0.3, window)
    inspect.signature(varlen_attn).bind(*args, **kwargs)
    if window is None and "window_size" in kwargs:
        # torch derives is_causal from `window_size == (-1, 0)`: a list would silently mean non-causal
        assert type(kwargs["window_size"]) is tuple and kwargs["window_size"] == (-1, 0)
    out = varlen_attn(*args, **kwargs)
    assert out.shape == q.shape and out.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_length_bucketed_sdpa_equals_the_per_sequence_reference_bit_for_bit(dtype, monkeypatch):
    """The CPU kernel batches the sequences of one length into one SDPA call: the same numbers as one
    call per sequence, forward and gradients, with repeated, unique and empty lengths and trailing
    tokens outside every sequence (their output is not read: only the sequences' rows compared)."""
    lens = [3, 7, 3, 1, 0, 7, 7, 12, 3, 1, 5]
    q, k, v, cu = _packed_qkv(lens, hq=4, hkv=2)
    q, k, v = (torch.cat([t, t[:2]]).to(dtype).requires_grad_() for t in (q, k, v))  # 2 trailing rows
    n = int(cu[-1])
    want = varlen_attention_ref(q, k, v, cu, 0.3)[:n]
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    with refusing_kv_repeat(monkeypatch):
        got = attention.varlen_attention_bucketed(q, k, v, cu, 0.3)[:n]
        got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
    # every length once, or a sliding window: the reference itself
    q1, k1, v1, cu1 = _packed_qkv([2, 5, 9])
    assert torch.equal(attention.varlen_attention_bucketed(q1, k1, v1, cu1, 0.3),
                       varlen_attention_ref(q1, k1, v1, cu1, 0.3))
    q2, k2, v2, cu2 = _packed_qkv([5, 5, 9])
    assert torch.equal(attention.varlen_attention_bucketed(q2, k2, v2, cu2, 0.3, 3),
                       varlen_attention_ref(q2, k2, v2, cu2, 0.3, 3))
