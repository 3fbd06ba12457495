"""Fused-linear decoupled-PPO loss vs the materialised path; chunking and micro-batch invariance."""

import contextlib
import warnings

import pytest
import torch
from tolerances import (
    BF16_GPU_SAME_GEMM_LOSS_TOL,
    BF16_GRAD_REL_OF_MAX,
    BF16_SAME_GEMM_LOSS_TOL,
    FP32_ACCUM_OF_BF16_REL_OF_MAX,
    FP32_CHUNKED_GEMM_TOL,
    FP64_CLOSED_FORM_TOL,
    FP64_REORDER_TOL,
)

from areal_fast.ops import (
    PPOLossConfig,
    decoupled_ppo_loss,
    default_chunk_size,
    fused_linear_decoupled_ppo_loss,
    fused_linear_decoupled_ppo_loss_ref,
    fused_linear_token_logprobs,
    fused_linear_token_logprobs_ref,
)
from areal_fast.ops.custom_ops import op_args
from areal_fast.ops.objective import per_token_grads, per_token_loss, token_constants

OPTS = dict(temperature=0.8, eps_clip=0.1, dual_clip=1.5, kl_coef=0.1, entropy_coef=0.05,
            importance_level="sequence", loss_agg="seq-mean-token-mean")


def make(T=10, H=16, V=150, seed=0, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bvec = (0.1 * torch.randn(V, generator=g)).to(dtype) if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    lp = torch.log_softmax((h.double() @ W.double().T) / OPTS["temperature"], -1)[torch.arange(T), y].float()
    b = lp + 0.3 * torch.randn(T, generator=g)
    p = b + 0.2 * torch.randn(T, generator=g)
    q = lp + 0.3 * torch.randn(T, generator=g)
    A = torch.randn(T, generator=g)
    m = (torch.rand(T, generator=g) > 0.3).float()
    m[0] = 1
    cu = torch.tensor([0, 3, 7, T], dtype=torch.int32)
    return dict(h=h, W=W, bias=bvec, y=y, b=b, p=p, q=q, A=A, m=m, cu=cu)


def run_fused(fn, d, **kw):
    h = d["h"].clone().requires_grad_()
    W = d["W"].clone().requires_grad_()
    bias = None if d["bias"] is None else d["bias"].clone().requires_grad_()
    options = {} if "config" in kw else OPTS  # a config passed as a value carries its own options
    kwargs = dict(bias=bias, prox_logprobs=d["p"], ref_logprobs=d["q"], cu_seqlens=d["cu"], **options) | kw
    out = fn(h, W, d["y"], d["b"], d["A"], d["m"], **kwargs)
    out.loss.backward()
    return out, h.grad, W.grad, (None if bias is None else bias.grad)


def assert_same(a, b, tol=FP32_CHUNKED_GEMM_TOL):
    (oa, *ga), (ob, *gb) = a, b
    torch.testing.assert_close(oa.loss, ob.loss, **tol)
    torch.testing.assert_close(oa.logprobs, ob.logprobs, **tol)
    for x, y in zip(ga, gb):
        if x is None:
            assert y is None
        else:
            torch.testing.assert_close(x.float(), y.float(), **tol)


TOKEN_OPTS = dict(temperature=0.8, eps_clip=0.1, eps_clip_higher=0.15, dual_clip=1.2, token_mis_upper=1.2,
                  kl_coef=0.1, kl_estimator="k2", entropy_coef=0.05, importance_level="token")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
def test_fused_matches_materialised_reference_backend(chunk, level):
    """token level runs the single-pass path (gradients in the forward), sequence level the recompute."""
    d = make()
    kw = TOKEN_OPTS if level == "token" else {}
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=chunk, backend="reference", **kw)
    ref = run_fused(fused_linear_decoupled_ppo_loss_ref, d, **kw)
    assert_same(fused, ref)
    assert fused[2].abs().sum() > 0 and fused[3].abs().sum() > 0
    for k in ref[0].stats:
        torch.testing.assert_close(fused[0].stats[k], ref[0].stats[k], **FP32_CHUNKED_GEMM_TOL)


@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_single_pass_equals_recompute(single_pass, agg):
    d = make(seed=9)
    kw = dict(TOKEN_OPTS, loss_agg=agg, normalizer=4.0 if agg == "token-mean" else None)
    a = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=4, backend="reference", single_pass=single_pass,
                  **kw)
    b = run_fused(fused_linear_decoupled_ppo_loss_ref, d, **kw)
    assert_same(a, b)


PER_TOKEN_CASES = [
    dict(),
    dict(eps_clip=0.1, eps_clip_higher=0.3),
    dict(eps_clip=0.05, dual_clip=1.05),
    dict(token_mis_upper=1.1, kl_coef=0.2, kl_estimator="k1"),
    dict(tis_cap=1.1, kl_coef=0.2, kl_estimator="k3", entropy_coef=0.1),
    dict(kl_coef=0.3, kl_estimator="k2", dual_clip=2.0),
]


@pytest.mark.parametrize("case", range(len(PER_TOKEN_CASES)))
def test_per_token_grads_match_autograd(case):
    """The closed-form derivative used by the single pass equals autograd of per_token_loss,
    ties and boundaries included (A = 0, r inside the clip range, |rho| > 20, non-finite p)."""
    cfg = PPOLossConfig(**PER_TOKEN_CASES[case])
    g = torch.Generator().manual_seed(case)
    T = 64
    logp = -torch.rand(T, generator=g, dtype=torch.float64) * 5
    b = logp + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)
    p = b + 0.2 * torch.randn(T, generator=g, dtype=torch.float64)
    A = torch.randn(T, generator=g, dtype=torch.float64)
    A[:4] = 0.0
    p[4], p[5], p[6] = logp[4] + 25.0, logp[5] - 25.0, float("nan")
    q = logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    m = (torch.rand(T, generator=g) > 0.2).float()
    ent = torch.rand(T, generator=g, dtype=torch.float64)
    C = token_constants(b, A, m, p, q, torch.float64, "cpu", cfg)
    lv, ev = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    L, _, _ = per_token_loss(lv, ev, C, cfg)
    gl, ge = torch.autograd.grad(L.sum(), (lv, ev), allow_unused=True)
    ge = torch.zeros_like(ent) if ge is None else ge
    g_cf, e_cf = per_token_grads(logp, ent, C, cfg)
    torch.testing.assert_close(g_cf, gl, **FP64_CLOSED_FORM_TOL)
    torch.testing.assert_close(e_cf, ge, **FP64_CLOSED_FORM_TOL)
    assert gl.abs().sum() > 0


def test_fused_without_bias_and_frozen_weight():
    d = make(bias=False)
    h = d["h"].clone().requires_grad_()
    out = fused_linear_decoupled_ppo_loss(h, d["W"], d["y"], d["b"], d["A"], d["m"], chunk_size=4,
                                          backend="reference")
    out.loss.backward()
    h2 = d["h"].clone().requires_grad_()
    ref = fused_linear_decoupled_ppo_loss_ref(h2, d["W"], d["y"], d["b"], d["A"], d["m"])
    ref.loss.backward()
    torch.testing.assert_close(h.grad, h2.grad, **FP32_CHUNKED_GEMM_TOL)


@pytest.mark.interpreter
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_interpreter_matches_materialised(dtype, level):
    d = make(T=9, V=150, dtype=dtype, seed=1)
    kw = TOKEN_OPTS if level == "token" else {}
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=4, backend="interpret", **kw)
    if dtype == torch.float32:
        assert_same(fused, run_fused(fused_linear_decoupled_ppo_loss_ref, d, **kw))
    else:
        # same bf16 GEMMs on both sides; the logits gradient is rounded to bf16 before the gradient
        # GEMMs on the fused path (as in any bf16 training), not on the materialised fp32 one
        mat = run_fused(lambda h, W, *a, bias=None, **k: decoupled_ppo_loss(
            torch.nn.functional.linear(h, W, bias), *a, backend="interpret", **k), d, **kw)
        torch.testing.assert_close(fused[0].loss, mat[0].loss, **BF16_SAME_GEMM_LOSS_TOL)
        for x, y in zip(fused[1:], mat[1:]):
            assert (x.float() - y.float()).abs().max() <= BF16_GRAD_REL_OF_MAX * y.float().abs().max()


def test_chunking_invariance_token_logprobs():
    d = make(T=11, seed=2)
    outs = [fused_linear_token_logprobs(d["h"], d["W"], d["y"], bias=d["bias"], temperature=0.8,
                                        return_entropy=True, chunk_size=c, backend="reference")
            for c in (1, 4, 11)]
    ref = fused_linear_token_logprobs_ref(d["h"], d["W"], d["y"], bias=d["bias"], temperature=0.8,
                                          return_entropy=True)
    for lp, ent in outs:
        torch.testing.assert_close(lp, ref[0], **FP32_CHUNKED_GEMM_TOL)
        torch.testing.assert_close(ent, ref[1], **FP32_CHUNKED_GEMM_TOL)


@pytest.mark.interpreter
def test_fused_token_logprobs_interpreter():
    d = make(T=6, seed=3)
    lp = fused_linear_token_logprobs(d["h"], d["W"], d["y"], bias=d["bias"], chunk_size=4, backend="interpret")
    torch.testing.assert_close(lp, fused_linear_token_logprobs_ref(d["h"], d["W"], d["y"], bias=d["bias"]),
                               **FP32_CHUNKED_GEMM_TOL)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_microbatch_invariance(agg, fused, level):
    """Two micro-batches with the global normalizer give the gradient of one batch."""
    d = make(T=10, seed=4)
    d["cu"] = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    opts = dict(OPTS, loss_agg=agg, importance_level=level)
    if agg == "token-mean":
        norm = float(d["m"].sum())
    else:
        norm = float(sum(bool(d["m"][a:b].any()) for a, b in ((0, 3), (3, 7), (7, 10))))

    def loss_of(h, W, sl, cu):
        args = (d["y"][sl], d["b"][sl], d["A"][sl], d["m"][sl])
        kw = dict(prox_logprobs=d["p"][sl], ref_logprobs=d["q"][sl], cu_seqlens=cu, normalizer=norm,
                  backend="reference", **opts)
        if fused:
            return fused_linear_decoupled_ppo_loss(h[sl], W, *args, chunk_size=2, **kw).loss
        return decoupled_ppo_loss(h[sl] @ W.T, *args, **kw).loss

    h1, W1 = d["h"].clone().requires_grad_(), d["W"].clone().requires_grad_()
    loss_of(h1, W1, slice(0, 10), d["cu"]).backward()
    h2, W2 = d["h"].clone().requires_grad_(), d["W"].clone().requires_grad_()
    total = loss_of(h2, W2, slice(0, 3), torch.tensor([0, 3])) + loss_of(h2, W2, slice(3, 10),
                                                                          torch.tensor([0, 4, 7]))
    total.backward()
    torch.testing.assert_close(h1.grad, h2.grad, **FP32_CHUNKED_GEMM_TOL)
    torch.testing.assert_close(W1.grad, W2.grad, **FP32_CHUNKED_GEMM_TOL)


def test_opcheck_fused_linear_ops():
    d = make(T=5, H=8, V=30, seed=5)
    args = (d["h"].clone().requires_grad_(), d["W"].clone().requires_grad_(), d["bias"].clone().requires_grad_(),
            d["y"], 1.0, 2, "reference")
    torch.library.opcheck(torch.ops.areal_fast.fused_linear_token_stats, args)
    lp, ent, lse = torch.ops.areal_fast.fused_linear_token_stats(d["h"], d["W"], d["bias"], d["y"], 1.0, 2,
                                                                 "reference")
    torch.library.opcheck(torch.ops.areal_fast.fused_linear_token_stats_bwd,
                          (d["h"], d["W"], d["bias"], d["y"], lse, ent, torch.randn(5), torch.randn(5), 1.0, 2,
                           "reference", True, True, True))


def test_opcheck_single_pass_ops():
    d = make(T=5, H=8, V=30, seed=5)
    coef = d["m"] / d["m"].sum()
    cfg = PPOLossConfig(temperature=0.8, eps_clip=0.1, eps_clip_higher=0.15, dual_clip=1.2, token_mis_upper=1.2,
                        kl_coef=0.1, kl_estimator="k2", entropy_coef=0.05)
    torch.library.opcheck(torch.ops.areal_fast.fused_linear_ppo_single_pass,
                          (d["h"], d["W"], d["bias"], d["y"], d["b"], d["A"], d["m"], d["p"], d["q"], None, coef, 2,
                           "reference", True, True, True, *op_args(cfg)))
    h = d["h"].clone().requires_grad_()
    torch.library.opcheck(torch.ops.areal_fast.attach_grads,
                          (torch.tensor(1.5), h, d["W"], None, torch.randn(5, 8), torch.empty(0), torch.empty(0)))


def test_single_pass_traces_under_torch_compile_fullgraph():
    d = make(seed=11)

    def f(h, W, bias):
        return fused_linear_decoupled_ppo_loss(h, W, d["y"], d["b"], d["A"], d["m"], bias=bias, prox_logprobs=d["p"],
                                               ref_logprobs=d["q"], chunk_size=4, backend="reference",
                                               **TOKEN_OPTS).loss

    leaves = [[t.clone().requires_grad_() for t in (d["h"], d["W"], d["bias"])] for _ in range(2)]
    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves[0]).backward()
    f(*leaves[1]).backward()
    for a, b in zip(*leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_default_chunk_size_and_errors():
    assert default_chunk_size(32768, 3584, 151936) == 4096  # TARGET_CHUNK (1024 rewrote the fp32 accumulator 4x as
    # often)
    assert default_chunk_size(500, 64, 1000) == 500  # never more than T
    assert default_chunk_size(1 << 20, 3584, 151936) == 32768  # ~ T * H elements of logits per chunk
    d = make()
    with pytest.raises(ValueError, match="same dtype"):
        fused_linear_decoupled_ppo_loss(d["h"].double(), d["W"], d["y"], d["b"], d["A"], d["m"])
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_decoupled_ppo_loss(d["h"], d["W"], d["y"], d["b"], d["A"], d["m"], chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_decoupled_ppo_loss(d["h"], d["W"][:, :5], d["y"], d["b"], d["A"], d["m"])
    with pytest.raises(ValueError, match="single_pass"):
        fused_linear_decoupled_ppo_loss(d["h"], d["W"], d["y"], d["b"], d["A"], d["m"], cu_seqlens=d["cu"],
                                        importance_level="sequence", single_pass=True)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fused_gpu_bf16_matches_materialised(level):
    d = make(T=3000, H=256, V=32003, dtype=torch.bfloat16, seed=6)
    d = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in d.items()}
    d["cu"] = torch.tensor([0, 1000, 2500, 3000], dtype=torch.int32, device="cuda")
    kw = TOKEN_OPTS if level == "token" else {}
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=1024, backend="triton", **kw)
    mat = run_fused(lambda h, W, *a, bias=None, **k: decoupled_ppo_loss(
        torch.nn.functional.linear(h, W, bias), *a, backend="triton", **k), d, **kw)
    torch.testing.assert_close(fused[0].loss, mat[0].loss, **BF16_GPU_SAME_GEMM_LOSS_TOL)
    for x, y in zip(fused[1:], mat[1:]):
        assert (x.float() - y.float()).abs().max() <= BF16_GRAD_REL_OF_MAX * y.float().abs().max()


@pytest.mark.parametrize("path", ["single_pass", "recompute", "sequence_mask_cap"])
def test_nonfinite_behaviour_and_gspo_mask_agree_with_reference(path):
    """Every path (single pass, recompute, GSPO with a mask-mode cap) drops a token whose behaviour
    log-prob is -inf exactly as the reference does, and keeps the loss finite."""
    d = make(seed=13)
    d["b"] = d["b"].clone()
    d["b"][int(torch.nonzero(d["m"])[1])] = float("-inf")
    if path == "sequence_mask_cap":
        kw = dict(importance_level="sequence", token_mis_upper=1.1)
    else:
        kw = dict(TOKEN_OPTS, token_mis_upper=None, single_pass=path == "single_pass")
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=4, backend="reference", **kw)
    kw.pop("single_pass", None)
    ref = run_fused(fused_linear_decoupled_ppo_loss_ref, d, **kw)
    assert torch.isfinite(fused[0].loss) and all(torch.isfinite(g).all() for g in fused[1:])
    assert_same(fused, ref)
    assert float(fused[0].stats["nonfinite_count"]) == float(ref[0].stats["nonfinite_count"]) >= 1.0


# token level, no entropy or KL term: a token with a NaN logit is dropped, the loss stays finite,
# and the bad value shows in the log-probs and in nonfinite_count
CLEAN_TOKEN_OPTS = dict(temperature=0.8, eps_clip=0.2, entropy_coef=0.0, kl_coef=0.0, importance_level="token",
                        loss_agg="token-mean")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("where", ["hidden", "weight"])
def test_nan_in_hidden_or_weight_shows_in_logprobs_and_nonfinite_count(where, single_pass, backend):
    """A diverging LM head: a NaN in one token's hidden state makes that token's logits all NaN; a
    NaN in one row of the weight (a vocabulary entry no label names) makes that logit NaN in every
    row. The fused paths must report it as the reference does: NaN log-prob and entropy for the
    rows concerned, each loss token among them counted in ``nonfinite_count``, the other rows'
    log-probs unchanged; the loss stays finite here (the tokens are dropped), and with an entropy
    term it is NaN, as in the reference."""
    d = make(seed=17)
    y = d["y"]
    loss_tok = int(torch.nonzero(d["m"])[2])
    if where == "hidden":
        d["h"] = d["h"].clone()
        d["h"][loss_tok, 3] = float("nan")
        bad = torch.zeros(len(y), dtype=torch.bool)
        bad[loss_tok] = True
    else:
        v = next(v for v in range(d["W"].shape[0]) if not (y == v).any())
        d["W"] = d["W"].clone()
        d["W"][v, 0] = float("nan")
        bad = torch.ones(len(y), dtype=torch.bool)
    kw = dict(CLEAN_TOKEN_OPTS, chunk_size=4, backend=backend, single_pass=single_pass)
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, **kw)[0]
    ref = run_fused(fused_linear_decoupled_ppo_loss_ref, d, **CLEAN_TOKEN_OPTS)[0]
    assert torch.equal(torch.isnan(fused.logprobs), bad) and torch.equal(torch.isnan(fused.entropy), bad)
    torch.testing.assert_close(fused.logprobs, ref.logprobs, equal_nan=True, **FP32_CHUNKED_GEMM_TOL)
    torch.testing.assert_close(fused.entropy, ref.entropy, equal_nan=True, **FP32_CHUNKED_GEMM_TOL)
    n_bad = float((bad & (d["m"] != 0)).sum())
    assert float(fused.stats["nonfinite_count"]) == float(ref.stats["nonfinite_count"]) == n_bad >= 1
    assert torch.isfinite(fused.loss)
    torch.testing.assert_close(fused.loss, ref.loss, **FP32_CHUNKED_GEMM_TOL)
    lp = fused_linear_token_logprobs(d["h"], d["W"], y, bias=d["bias"], temperature=0.8, chunk_size=4,
                                     backend=backend)
    assert torch.equal(torch.isnan(lp), bad)
    clean = make(seed=17)
    lp_clean = fused_linear_token_logprobs(clean["h"], clean["W"], y, bias=clean["bias"], temperature=0.8,
                                           chunk_size=4, backend=backend)
    torch.testing.assert_close(lp[~bad], lp_clean[~bad], **FP32_CHUNKED_GEMM_TOL)
    with_entropy = run_fused(fused_linear_decoupled_ppo_loss, d, **dict(kw, entropy_coef=0.05))[0]
    assert torch.isnan(with_entropy.loss)


def test_config_value_and_keyword_overrides_are_the_same_loss():
    """The options travel as one PPOLossConfig; keyword overrides replace single options."""
    d = make(seed=14)
    cfg = PPOLossConfig(**TOKEN_OPTS)
    by_value = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=4, backend="reference", config=cfg)
    by_keywords = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=4, backend="reference",
                            config=None, **TOKEN_OPTS)
    mixed = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=4, backend="reference",
                      config=PPOLossConfig(**dict(TOKEN_OPTS, eps_clip=0.3)), eps_clip=0.1)
    for other in (by_keywords, mixed):
        assert_same(by_value, other, tol=dict(atol=0, rtol=0))
    with pytest.raises(TypeError, match="eps_clipp"):
        fused_linear_decoupled_ppo_loss(d["h"], d["W"], d["y"], d["b"], d["A"], d["m"], eps_clipp=0.1)
    with pytest.raises(ValueError, match="eps_clip"):
        fused_linear_decoupled_ppo_loss(d["h"], d["W"], d["y"], d["b"], d["A"], d["m"], config=cfg, eps_clip=-1.0)


def test_loss_config_module_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from areal_fast.ops.loss_config import PPOLossConfig; PPOLossConfig(eps_clip=0.1); "
            "assert 'torch' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_weight_gradient_accumulates_in_fp32_inside_the_gemm():
    """bf16 inputs, many chunks: grad_weight now sums each chunk's product in fp32; rounding every
    chunk's [V, H] partial product to bf16 first (the previous scheme) was measurably worse."""
    from areal_fast.ops.custom_ops import _LinearGrads

    g = torch.Generator().manual_seed(0)
    T, H, V, chunk = 512, 32, 64, 8  # 64 chunks
    h = torch.randn(T, H, generator=g).to(torch.bfloat16)
    W = torch.randn(V, H, generator=g).to(torch.bfloat16)
    bias = torch.zeros(V, dtype=torch.bfloat16)
    dz = (torch.randn(T, V, generator=g) * 1e-2).to(torch.bfloat16)
    exact = dz.double().t() @ h.double()
    exact_b = dz.double().sum(0)
    grads = _LinearGrads(h, W, bias, False, True, True)
    old_gw = torch.zeros(V, H)
    for a in range(0, T, chunk):
        grads.add_chunk(a, a + chunk, h[a:a + chunk], dz[a:a + chunk])
        old_gw += (dz[a:a + chunk].t() @ h[a:a + chunk]).float()  # the previous per-chunk bf16 product
    err_new = (grads.gw.double() - exact).abs().max().item()
    err_old = (old_gw.double() - exact).abs().max().item()
    # fp32 accumulation of bf16 products: error ~ 2^-24 * sum |terms|; bf16-rounded partial sums
    # carry ~2^-9 relative error each, orders of magnitude more
    assert err_new < err_old / 100, (err_new, err_old)
    assert err_new <= FP32_ACCUM_OF_BF16_REL_OF_MAX * exact.abs().max().item()
    err_b = (grads.gb.double() - exact_b).abs().max().item()
    assert err_b <= FP32_ACCUM_OF_BF16_REL_OF_MAX * exact_b.abs().max().item()
    gh, gw, gb = grads.result()
    assert gw.dtype == torch.bfloat16 and gb.dtype == torch.bfloat16 and gh.numel() == 0


# ----------------------------------------------------------------------------- chunk size, fp32 GEMM path

GIB = 1 << 30


def test_chunk_size_is_bounded_by_free_memory():
    """4,096 rows (8 chunks at T = 32k, a quarter of the fp32 accumulator traffic of 1,024-row
    chunks) while a quarter of the free memory holds two bf16 chunks of logits; fewer otherwise,
    in multiples of 256 and never below 256."""
    from areal_fast.ops.fused_linear import CHUNK_BUFFERS, CHUNK_MEMORY_FRACTION, MIN_CHUNK, TARGET_CHUNK

    T, H, V = 32768, 3584, 151936
    assert default_chunk_size(T, H, V, free_bytes=60 * GIB) == TARGET_CHUNK == 4096
    per_row = CHUNK_BUFFERS * V * 2
    free = int(3000 * per_row / CHUNK_MEMORY_FRACTION)  # room for 3,000 rows: rounded down to 2,816
    assert default_chunk_size(T, H, V, free_bytes=free) == 2816
    assert default_chunk_size(T, H, V, itemsize=4, free_bytes=free) == 1280  # fp32 logits: half as many
    assert default_chunk_size(T, H, V, free_bytes=0) == MIN_CHUNK  # never below the floor
    assert default_chunk_size(100, H, V, free_bytes=0) == 100  # nor above T
    # huge T: Liger's T-proportional rule, still capped by memory (20 GB of 80 free -> 32,768 rows)
    assert default_chunk_size(1 << 20, H, V, free_bytes=80 * 10**9) == 32768
    assert default_chunk_size(1 << 20, H, V, free_bytes=20 * GIB) < 32768


def test_default_chunk_asks_the_device_for_free_memory(monkeypatch):
    from areal_fast.ops import fused_linear as FL

    assert FL.free_device_bytes(torch.device("cpu")) is None  # no device memory to ask about
    seen = []
    monkeypatch.setattr(FL, "free_device_bytes", lambda device: seen.append(device) or 0)
    d = make()
    FL._check_linear(d["h"], d["W"], None, d["y"], None)
    assert seen == [d["h"].device]


@pytest.fixture
def fresh_gemm_probe(monkeypatch):
    """The fp32-GEMM probe cache and the warned-once set emptied for the test (and restored)."""
    from areal_fast.ops import custom_ops

    monkeypatch.setattr(custom_ops, "_FP32_ADDMM_OK", {})
    monkeypatch.setattr(custom_ops, "_FP32_ADDMM_WHY", {})
    monkeypatch.setattr(custom_ops, "_FALLBACK_WARNED", set())
    monkeypatch.setattr(custom_ops, "_PATH_LOGGED", set())
    return custom_ops


def test_fp32_fallback_warns_once_and_stays_exact(fresh_gemm_probe, monkeypatch):
    """Where torch cannot accumulate bf16 GEMMs in fp32 (forced here), grad_weight upcasts and
    runs an fp32 GEMM: one loud warning per process and (device type, dtype), the result exact."""
    ops = fresh_gemm_probe
    monkeypatch.setitem(ops._FP32_ADDMM_OK, ("cpu", torch.bfloat16), False)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(16, 4, generator=g).bfloat16()
    acc = torch.zeros(8, 4)
    with pytest.warns(RuntimeWarning, match="cannot accumulate torch.bfloat16 GEMMs in fp32") as rec:
        ops.addmm_fp32_(acc, a, b)
        ops.addmm_fp32_(acc, a, b)
    assert len([w for w in rec if "cannot accumulate" in str(w.message)]) == 1
    torch.testing.assert_close(acc, 2 * (a.float() @ b.float()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.addmm_fp32_(acc, a, b)  # a third call: still silent
        ops.addmm_fp32_(acc, a.float(), b.float())  # fp32 inputs: no fallback, nothing to say
    assert ops.weight_grad_path(torch.device("cpu"), torch.bfloat16) == ops.PATH_UPCAST
    assert ops.weight_grad_path(torch.device("cpu"), torch.float32) == ops.PATH_FP32_INPUTS


def test_fp32_out_gemm_path_does_not_warn(fresh_gemm_probe, monkeypatch):
    ops = fresh_gemm_probe
    monkeypatch.setitem(ops._FP32_ADDMM_OK, ("cpu", torch.bfloat16), True)
    calls = []
    monkeypatch.setattr(ops.torch, "addmm", lambda acc, a, b, out_dtype, out: calls.append(out_dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = torch.ones(2, 2, dtype=torch.bfloat16)
        ops.addmm_fp32_(torch.zeros(2, 2), one, one)
    assert calls == [torch.float32]
    assert ops.weight_grad_path(torch.device("cpu"), torch.bfloat16) == ops.PATH_FP32_OUT


def test_fused_linear_backward_warns_once_on_the_fallback(fresh_gemm_probe):
    """The real path on this torch (CPU: no fp32-out bf16 GEMM in 2.13): a bf16 fused-linear loss
    backward over several chunks warns exactly once."""
    ops = fresh_gemm_probe
    if ops.weight_grad_path(torch.device("cpu"), torch.bfloat16) != ops.PATH_UPCAST:
        pytest.skip("this torch accumulates bf16 GEMMs in fp32 on CPU: no fallback to see")
    d = make()
    h, W = d["h"].bfloat16().requires_grad_(), d["W"].bfloat16().requires_grad_()
    with pytest.warns(RuntimeWarning, match="cannot accumulate") as rec:
        for _ in range(2):
            out = fused_linear_decoupled_ppo_loss(h, W, d["y"], d["b"], d["A"], d["m"], chunk_size=8,
                                                  backend="reference")
            out.loss.backward()
    assert len([w for w in rec if "cannot accumulate" in str(w.message)]) == 1


def test_fused_linear_grad_path_answers_for_this_torch(fresh_gemm_probe):
    """Which grad_weight GEMM runs, by name, with the reason: the probe's own answer on this torch
    (CPU torch 2.13 has no bf16 GEMM with an fp32 output: the fallback, saying what to install)."""
    from areal_fast.ops import fused_linear_grad_path

    ops = fresh_gemm_probe
    cpu = torch.device("cpu")
    path = fused_linear_grad_path(cpu, torch.bfloat16)
    expected = "addmm_out_dtype" if ops.fp32_addmm_supported(cpu, torch.bfloat16) else "fp32_fallback"
    assert path.name == expected and path.reason
    if expected == "fp32_fallback":
        assert "out_dtype" in path.reason and f"torch {torch.__version__}" in path.reason
        assert "torch >= 2.8" in path.reason  # what the fast path needs
    assert fused_linear_grad_path(cpu, torch.float32).name == "fp32_inputs"
    assert fused_linear_grad_path(cpu, torch.float64).name == "fp64_inputs"
    default = fused_linear_grad_path()  # the device training would use, bf16
    assert default.name in ("addmm_out_dtype", "fp32_fallback") and default.reason


@pytest.mark.parametrize("supported", [True, False])
def test_the_grad_path_is_logged_once_with_its_reason(supported, fresh_gemm_probe, monkeypatch, caplog):
    """The first grad_weight GEMM of a (device type, dtype) logs which path runs: info for the
    fp32-output GEMM, a warning with the reason and what to install for the fallback; once."""
    import logging

    ops = fresh_gemm_probe
    monkeypatch.setitem(ops._FP32_ADDMM_OK, ("cpu", torch.bfloat16), supported)
    if supported:  # CPU torch has no fp32-output bf16 GEMM: stand one in
        monkeypatch.setattr(ops.torch, "addmm", lambda acc, a, b, out_dtype, out: acc.add_(a.float() @ b.float()))
    one = torch.ones(2, 2, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=ops.__name__), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            ops.addmm_fp32_(torch.zeros(2, 2), one, one)
    records = [r for r in caplog.records if "grad_weight GEMM" in r.getMessage()]
    assert len(records) == 1
    if supported:
        assert records[0].levelno == logging.INFO and "addmm_out_dtype" in records[0].getMessage()
    else:
        assert records[0].levelno == logging.WARNING and "fp32_fallback" in records[0].getMessage()
        assert "torch >= 2.8" in records[0].getMessage()


def test_forced_fallback_accumulates_exactly_and_gives_the_reference_gradient(fresh_gemm_probe, monkeypatch):
    """With the capability check forced to fail, the fallback reports itself, warns once with the
    reason, sums the bf16 products exactly in fp32 (the accumulator vs fp64, over 64 chunks), and
    the fused bf16 loss gets the materialised reference's gradient."""
    from areal_fast.ops import fused_linear_grad_path
    from areal_fast.ops.custom_ops import _LinearGrads

    ops = fresh_gemm_probe
    cpu = torch.device("cpu")
    monkeypatch.setitem(ops._FP32_ADDMM_OK, ("cpu", torch.bfloat16), False)
    assert fused_linear_grad_path(cpu, torch.bfloat16).name == "fp32_fallback"
    g = torch.Generator().manual_seed(1)
    T, H, V, chunk = 512, 32, 64, 8
    h = torch.randn(T, H, generator=g).to(torch.bfloat16)
    W = torch.randn(V, H, generator=g).to(torch.bfloat16)
    dz = (torch.randn(T, V, generator=g) * 1e-2).to(torch.bfloat16)
    grads = _LinearGrads(h, W, None, False, True, False)
    scopes = []  # the fallback GEMM runs inside tf32_matmul (a no-op on a CPU)
    real_scope = ops.tf32_matmul

    @contextlib.contextmanager
    def spy(device):
        with real_scope(device) as on:
            scopes.append((device.type, on))
            yield on

    monkeypatch.setattr(ops, "tf32_matmul", spy)
    with pytest.warns(RuntimeWarning, match="cannot accumulate torch.bfloat16 GEMMs in fp32") as rec:
        for a in range(0, T, chunk):
            grads.add_chunk(a, a + chunk, h[a:a + chunk], dz[a:a + chunk])
    assert len([w for w in rec if "cannot accumulate" in str(w.message)]) == 1
    assert "fused_linear_grad_path" in str(rec[0].message)
    assert scopes == [("cpu", False)] * (T // chunk)
    torch.testing.assert_close(grads.gw.double(), dz.double().t() @ h.double(), **FP32_CHUNKED_GEMM_TOL)
    d = make(T=24, H=16, V=96, dtype=torch.bfloat16, seed=2)
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, chunk_size=5, backend="reference", **TOKEN_OPTS)
    mat = run_fused(lambda h, W, *a, bias=None, **k: decoupled_ppo_loss(
        torch.nn.functional.linear(h, W, bias), *a, backend="reference", **k), d, **TOKEN_OPTS)
    torch.testing.assert_close(fused[0].loss, mat[0].loss, **FP32_CHUNKED_GEMM_TOL)
    for x, y in zip(fused[1:], mat[1:]):  # bf16 logits gradient on both sides, as in the tests above
        assert (x.float() - y.float()).abs().max() <= BF16_GRAD_REL_OF_MAX * y.float().abs().max()


def _tf32_state():
    """(new-API value or None, legacy flag or 'mixed' where reading it raises)."""
    m = torch.backends.cuda.matmul
    try:
        legacy = m.allow_tf32
    except RuntimeError:  # set through the new API only: torch refuses to read the legacy flag
        legacy = "mixed"
    return getattr(m, "fp32_precision", None), legacy


@pytest.fixture
def restore_tf32():
    """The process-wide TF32 flags put back as they were, whatever the test set."""
    m = torch.backends.cuda.matmul
    new, legacy = _tf32_state()
    yield
    if legacy != "mixed":
        m.allow_tf32 = legacy
    if new is not None:
        m.fp32_precision = new


@pytest.mark.parametrize("user", ["default", "legacy_off", "legacy_on", "new_api_ieee", "new_api_tf32"])
def test_fallback_allows_tf32_for_its_gemm_only_and_restores_the_flags(user, restore_tf32):
    """The fallback's fp32 GEMM on CUDA runs with TF32 allowed (exact for bf16/fp16 inputs: their
    significands fit TF32's), inside a scope that leaves the process's TF32 setting as it was,
    whichever of torch's APIs set it (mixing the legacy and the new one makes torch raise)."""
    from areal_fast.ops.custom_ops import tf32_matmul

    m = torch.backends.cuda.matmul
    new_api = hasattr(m, "fp32_precision")
    if user.startswith("new_api") and not new_api:
        pytest.skip(f"torch {torch.__version__} has no torch.backends.cuda.matmul.fp32_precision")
    if user == "legacy_off":
        m.allow_tf32 = False
    elif user == "legacy_on":
        m.allow_tf32 = True
    elif user == "new_api_ieee":
        m.fp32_precision = "ieee"
    elif user == "new_api_tf32":
        m.fp32_precision = "tf32"
    before = _tf32_state()
    with tf32_matmul(torch.device("cuda")) as on:
        assert on
        if new_api:
            assert m.fp32_precision == "tf32"
        if before[1] != "mixed":
            assert m.allow_tf32  # the flag cuBLAS reads, consistent in both APIs
    assert _tf32_state() == before
    with tf32_matmul(torch.device("cpu")) as on:  # no TF32 on a CPU: nothing touched
        assert not on and _tf32_state() == before


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("single_pass", [True, False])
def test_fp64_inputs_give_an_fp64_loss_on_the_fused_paths(single_pass, backend):
    """fp64 hidden and weight: logits, loss, stats math and the weight-gradient accumulator in fp64
    (the Triton kernels are fp32-only: fp64 chunks take the reference formulas)."""
    d = {k: (v.double() if torch.is_tensor(v) and v.dtype.is_floating_point else v) for k, v in make(seed=3).items()}
    kw = dict(TOKEN_OPTS, single_pass=single_pass, chunk_size=4, backend=backend)
    fused = run_fused(fused_linear_decoupled_ppo_loss, d, **kw)
    kw = {k: v for k, v in kw.items() if k not in ("single_pass", "chunk_size", "backend")}
    ref = run_fused(fused_linear_decoupled_ppo_loss_ref, d, **kw)
    assert fused[0].loss.dtype == torch.float64 and all(g.dtype == torch.float64 for g in fused[1:])
    assert_same(fused, ref, tol=dict(atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL))
