"""Triton kernels of the decoupled-PPO loss vs the PyTorch reference (interpreter on CPU, real on GPU).

Accuracy rule (STYLE.md): against an fp64 evaluation on the same (rounded) logits, the kernel's
error is at most 2x the error of plain PyTorch computing in the same low precision, plus a floor.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from tolerances import (
    BF16_INPUT_KERNEL_LOGPROB_TOL,
    FP32_ERR_FLOOR,
    FP32_FEW_OPS_ATOL,
    FP32_GRAD_TOL,
    FP32_GRAD_VS_AUTOGRAD_TOL,
    FP32_REORDER_TOL,
    FP64_REORDER_TOL,
    TWO_DECIMALS_ATOL,
)

from areal_fast.ops import decoupled_ppo_loss, decoupled_ppo_loss_ref, ppo_objective, token_logprobs
from areal_fast.ops.objective import PPOLossConfig

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTS = dict(temperature=0.7, eps_clip=0.1, dual_clip=1.5, token_mis_upper=1.5, kl_coef=0.1,
            entropy_coef=0.05, importance_level="sequence", loss_agg="seq-mean-token-mean")


def make(T, V, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, V, generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    l_true = torch.log_softmax(z.double() / OPTS["temperature"], -1)[torch.arange(T), y].float()
    b = l_true + 0.3 * torch.randn(T, generator=g)
    p = b + 0.2 * torch.randn(T, generator=g)
    q = l_true + 0.3 * torch.randn(T, generator=g)
    A = torch.randn(T, generator=g)
    m = (torch.rand(T, generator=g) > 0.3).float()
    m[0] = 1.0
    if T > 2:
        m[T // 2] = 0.0
        y[T // 2] = -100  # an ignored prompt label on a masked row
    cu = torch.tensor(sorted({0, T // 3, T}), dtype=torch.int32)
    d = dict(z=z, y=y, b=b, p=p, q=q, A=A, m=m, cu=cu)
    return {k: v.to(device) for k, v in d.items()}


def run(fn, d, backend=None, **kw):
    z = d["z"].clone().requires_grad_()
    kwargs = dict(prox_logprobs=d["p"], ref_logprobs=d["q"], cu_seqlens=d["cu"], **OPTS) | kw
    if backend is not None:
        kwargs["backend"] = backend
    out = fn(z, d["y"], d["b"], d["A"], d["m"], **kwargs)
    out.loss.backward()
    return out, z.grad


def torch_lowp(d):
    """What plain PyTorch gives computing log-softmax and entropy in the logits' own dtype."""
    z = d["z"].clone().requires_grad_()
    V = z.shape[1]
    logP = F.log_softmax(z / OPTS["temperature"], -1)
    ent = -(logP.exp() * logP).sum(-1)
    valid = (d["y"] >= 0) & (d["y"] < V)
    logp = logP.gather(1, d["y"].clamp(0, V - 1)[:, None])[:, 0] * valid
    cfg = PPOLossConfig(**OPTS)
    loss, _ = ppo_objective(logp.float(), ent.float(), d["b"], d["A"], d["m"], prox=d["p"], ref=d["q"],
                            cu_seqlens=d["cu"], normalizer=None, cfg=cfg)
    loss.backward()
    return loss, logp.float(), ent.float(), z.grad


def check_accuracy(d, backend):
    out, grad = run(decoupled_ppo_loss, d, backend)
    ref64, grad64 = run(decoupled_ppo_loss_ref, {**d, "z": d["z"].double()})
    lp_loss, lp_logp, lp_ent, lp_grad = torch_lowp(d)
    m = d["m"] != 0
    pairs = [
        ("loss", out.loss, lp_loss, ref64.loss),
        ("logprobs", out.logprobs[m], lp_logp[m], ref64.logprobs[m]),
        ("entropy", out.entropy, lp_ent, ref64.entropy),
        ("grad", grad, lp_grad, grad64),
    ]
    for name, mine, theirs, truth in pairs:
        err = (mine.double() - truth.double()).abs().max().item()
        err_torch = (theirs.double() - truth.double()).abs().max().item()
        assert err <= 2 * err_torch + FP32_ERR_FLOOR, (name, d["z"].dtype, err, err_torch)
    assert grad.dtype == d["z"].dtype
    assert torch.all(grad[~m] == 0)  # masked rows: exactly zero
    return out, grad


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,V", [(7, 1000), (13, 197), (1, 200)])
def test_kernel_accuracy_interpreter(T, V, dtype):
    d = make(T, V, dtype, seed=T)
    out, grad = check_accuracy(d, "interpret")
    # and against the reference backend (fp32 math on the same inputs)
    ref, grad_ref = run(decoupled_ppo_loss, d, "reference")
    torch.testing.assert_close(out.logprobs, ref.logprobs, **FP32_REORDER_TOL)
    torch.testing.assert_close(out.entropy, ref.entropy, **FP32_REORDER_TOL)
    torch.testing.assert_close(out.loss, ref.loss, **FP32_REORDER_TOL)
    assert set(out.stats) == set(ref.stats)


@pytest.mark.interpreter
def test_kernel_larger_odd_shape_fp32(monkeypatch):
    from areal_fast.kernels import ppo_loss as K

    monkeypatch.setattr(K, "INTERPRET_BLOCK_V", 1024)  # 5 blocks per row, the last one partial (5003)
    d = make(33, 5003, torch.float32, seed=1)
    out, grad = run(decoupled_ppo_loss, d, "interpret")
    ref, grad_ref = run(decoupled_ppo_loss, d, "reference")
    torch.testing.assert_close(out.loss, ref.loss, **FP32_REORDER_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_GRAD_TOL)


@pytest.mark.interpreter
def test_kernel_all_masked_and_token_level():
    d = make(5, 150, torch.float32)
    d["m"] = torch.zeros(5)
    out, grad = run(decoupled_ppo_loss, d, "interpret", importance_level="token", loss_agg="token-mean")
    assert float(out.loss.detach()) == 0.0 and torch.all(grad == 0)
    d = make(6, 150, torch.float32, seed=2)
    out, grad = run(decoupled_ppo_loss, d, "interpret", importance_level="token", loss_agg="token-mean")
    ref, grad_ref = run(decoupled_ppo_loss_ref, d, importance_level="token", loss_agg="token-mean")
    torch.testing.assert_close(grad, grad_ref, **FP32_GRAD_VS_AUTOGRAD_TOL)


@pytest.mark.interpreter
def test_kernel_neg_inf_logits():
    """Vocabulary masking with -inf logits: finite log-probs, entropy and gradient (0 there)."""
    d = make(4, 150, torch.float32, seed=3)
    z = d["z"].clone()
    z[:, 100:] = float("-inf")
    z[1, :] = float("-inf")  # a row with a single finite logit: P is one-hot, H = 0
    z[1, 5] = 1.0
    d["y"] = torch.tensor([3, 5, 7, 9])
    d["z"] = z
    out, grad = run(decoupled_ppo_loss, d, "interpret")
    ref, grad_ref = run(decoupled_ppo_loss_ref, d)
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.entropy).all() and torch.isfinite(grad).all()
    # one-hot row
    assert abs(float(out.logprobs[1])) < FP32_FEW_OPS_ATOL and abs(float(out.entropy[1])) < FP32_FEW_OPS_ATOL
    torch.testing.assert_close(out.logprobs, ref.logprobs, **FP32_REORDER_TOL)
    torch.testing.assert_close(out.entropy, ref.entropy, **FP32_REORDER_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_GRAD_VS_AUTOGRAD_TOL)
    assert torch.all(grad[:, 100:] == 0)


@pytest.mark.interpreter
def test_kernel_per_lane_statistics_when_the_max_moves_late():
    """The forward keeps per-lane running maxima and rescales once at the end: rows whose first
    vocabulary blocks are all -inf, whose maximum sits in the last (partial) block, or whose logits
    span a huge range must still match the reference (V = 400: several 128-wide interpreter blocks)."""
    d = make(4, 400, torch.float32, seed=9)
    z = d["z"].clone()
    z[0, :256] = float("-inf")  # lanes start at the floor, then see real values
    z[1, 390] = 60.0  # the max in the tail block, far above the rest
    z[2] = torch.linspace(-3000.0, 30.0, 400)  # exp underflows for most of the row
    z[3, ::2] = float("-inf")  # every other lane -inf throughout
    d["z"] = z
    d["y"] = torch.tensor([300, 390, 399, 1])
    out, grad = run(decoupled_ppo_loss, d, "interpret")
    ref, grad_ref = run(decoupled_ppo_loss_ref, d)
    torch.testing.assert_close(out.logprobs, ref.logprobs, **FP32_REORDER_TOL)
    torch.testing.assert_close(out.entropy, ref.entropy, **FP32_REORDER_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_GRAD_VS_AUTOGRAD_TOL)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_inplace_overwrites_logits(dtype):
    d = make(5, 130, dtype, seed=4)
    _, grad = run(decoupled_ppo_loss, d, "interpret")
    z = d["z"].clone()
    leaf = z.clone().requires_grad_()
    buf = leaf * 1.0  # a non-leaf buffer, as logits out of a matmul would be
    out = decoupled_ppo_loss(buf, d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"], ref_logprobs=d["q"],
                             cu_seqlens=d["cu"], grad_inplace=True, backend="interpret", **OPTS)
    out.loss.backward()
    assert torch.equal(leaf.grad, grad)
    assert torch.equal(buf.detach(), grad)  # the logits buffer now holds the gradient


@pytest.mark.interpreter
def test_strided_logits_interpreter():
    """Rows with a stride larger than V (a slice of a wider buffer) and a column-strided view."""
    d = make(6, 140, torch.float32, seed=10)
    ref, grad_ref = run(decoupled_ppo_loss_ref, d)
    wide = torch.randn(6, 160)
    wide[:, :140] = d["z"]
    for base, take in ((wide, lambda x: x[:, :140]), (d["z"].t().contiguous(), lambda x: x.t())):
        leaf = base.clone().requires_grad_()
        view = take(leaf)
        assert view.stride() != (140, 1)
        out = decoupled_ppo_loss(view, d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"], ref_logprobs=d["q"],
                                 cu_seqlens=d["cu"], backend="interpret", **OPTS)
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, **FP32_REORDER_TOL)
        torch.testing.assert_close(take(leaf.grad), grad_ref, **FP32_GRAD_VS_AUTOGRAD_TOL)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_logprobs_interpreter(dtype):
    d = make(9, 333, dtype, seed=5)
    lp, ent = token_logprobs(d["z"], d["y"], temperature=0.7, return_entropy=True, backend="interpret")
    lp_r, ent_r = token_logprobs(d["z"], d["y"], temperature=0.7, return_entropy=True, backend="reference")
    assert lp.dtype == torch.float32 and not lp.requires_grad
    torch.testing.assert_close(lp, lp_r, **FP32_REORDER_TOL)
    torch.testing.assert_close(ent, ent_r, **FP32_REORDER_TOL)
    assert float(lp[9 // 2]) == 0.0  # label -100


def _opcheck_args(T, V, backend):
    d = make(T, V, torch.float32, seed=6)
    return d, (d["z"].clone().requires_grad_(), d["y"], 0.9, False, backend)


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=pytest.mark.interpreter)])
def test_opcheck_token_stats(backend):
    _, args = _opcheck_args(3, 40, backend)
    torch.library.opcheck(torch.ops.areal_fast.ppo_token_stats, args)


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=pytest.mark.interpreter)])
def test_opcheck_token_stats_bwd(backend):
    d, _ = _opcheck_args(3, 40, backend)
    lp, ent, lse = torch.ops.areal_fast.ppo_token_stats(d["z"], d["y"], 0.9, False, backend)
    g, e = torch.randn(3), torch.randn(3)
    grad_out = torch.empty_like(d["z"])
    torch.library.opcheck(torch.ops.areal_fast.ppo_token_stats_bwd,
                          (grad_out, d["z"], d["y"], lse, ent, g, e, 0.9, backend))


def test_reference_backend_grad_matches_autograd_reference():
    """The formula dz = (g (onehot - P) - e P (log P + H)) / tau of the op equals autograd's."""
    d = make(10, 77, torch.float32, seed=7)
    out, grad = run(decoupled_ppo_loss, d, "reference")
    ref, grad_ref = run(decoupled_ppo_loss_ref, d)
    torch.testing.assert_close(out.loss, ref.loss, **FP32_REORDER_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_GRAD_TOL)
    for k in ref.stats:
        torch.testing.assert_close(out.stats[k], ref.stats[k], **FP32_REORDER_TOL)


def test_traces_under_torch_compile():
    d = make(6, 50, torch.float32, seed=8)

    def f(z):
        return decoupled_ppo_loss(z, d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"], ref_logprobs=d["q"],
                                  cu_seqlens=d["cu"], backend="reference", **OPTS).loss

    z1 = d["z"].clone().requires_grad_()
    z2 = d["z"].clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(z1).backward()
    f(z2).backward()
    torch.testing.assert_close(z1.grad, z2.grad)


def test_long_T_reference_backend():
    """T = 70,000 rows (past the 65,535 limit of a grid's y/z dimensions) through the op."""
    T, V = 70_000, 16
    z = torch.randn(T, V)
    y = torch.randint(0, V, (T,))
    lp = token_logprobs(z, y, backend="reference")
    torch.testing.assert_close(lp, torch.log_softmax(z, -1)[torch.arange(T), y], **FP32_REORDER_TOL)


def test_backend_errors_are_clear():
    from areal_fast.dispatch import BackendUnavailable

    d = make(3, 20, torch.float32)
    with pytest.raises(BackendUnavailable, match="ppo_loss"):
        decoupled_ppo_loss(d["z"], d["y"], d["b"], d["A"], d["m"], backend="cuda")
    with pytest.raises(ValueError, match="logits"):
        decoupled_ppo_loss(d["z"][None], d["y"], d["b"], d["A"], d["m"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_accuracy_gpu(dtype):
    d = make(257, 32003, dtype, seed=9, device="cuda")
    check_accuracy(d, "triton")


@pytest.mark.gpu
def test_kernel_long_T_gpu():
    """T = 70,000 rows (beyond a 65,535 grid-dimension limit) on a 1-D grid."""
    T, V = 70_000, 512
    z = torch.randn(T, V, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, V, (T,), device="cuda")
    lp, ent = token_logprobs(z, y, return_entropy=True, backend="triton")
    lp_r = torch.log_softmax(z.float(), -1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(lp, lp_r, **BF16_INPUT_KERNEL_LOGPROB_TOL)
    zz = z.clone().requires_grad_()
    out = decoupled_ppo_loss(zz, y, lp_r.detach(), torch.ones(T, device="cuda"), torch.ones(T, device="cuda"),
                             backend="triton")
    out.loss.backward()
    assert torch.isfinite(zz.grad).all() and zz.grad[-1].abs().sum() > 0


_AOT_SCRIPT = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from areal_fast.kernels import ppo_loss as K

try:
    target = GPUTarget("cuda", 90, 32)
except Exception as e:  # API of another Triton version
    print("SKIP", e); sys.exit(0)
out = []
for dt in ("bf16", "fp16", "fp32"):
    fwd = dict(Z=f"*{dt}", stride_z="i64", LABELS="*i64", LOGP="*fp32", ENT="*fp32", LSE="*fp32", V="i32",
               inv_tau="fp32", BLOCK_V="constexpr")
    bwd = dict(Z=f"*{dt}", stride_z="i64", G=f"*{dt}", stride_g="i64", LABELS="*i64", LSE="*fp32", ENT="*fp32",
               GRAD_LOGP="*fp32", GRAD_ENT="*fp32", V="i32", inv_tau="fp32", BLOCK_V="constexpr")
    for name, fn, sig in (("fwd", K._ppo_token_stats_fwd_kernel, fwd), ("bwd", K._ppo_token_stats_bwd_kernel, bwd)):
        # what the JIT specialises to when the row stride is a multiple of 16 (V = 151936, 152064, 32000)
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig) - 1)}
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs={"BLOCK_V": 4096}, attrs=attrs)
        except TypeError as e:
            print("SKIP", e); sys.exit(0)
        try:
            c = triton.compile(src, target=target, options={"num_warps": 8})
        except Exception as e:
            if "ptxas" in str(e).lower():
                print("SKIP", e); sys.exit(0)
            raise
        ptx = c.asm["ptx"]
        ops = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)))
        # barriers inside the vocabulary loop (the body between a label and the branch back to it)
        lines = ptx.splitlines()
        labels = {l.strip().split(":")[0]: i for i, l in enumerate(lines) if re.match(r"^\$L__\w+:", l.strip())}
        loop_bars = 0
        for i, l in enumerate(lines):
            m = re.search(r"bra\S*\s+(\$L__\w+);", l)
            if m and labels.get(m.group(1), i) < i:
                loop_bars += sum("bar.sync" in x or "barrier.sync" in x for x in lines[labels[m.group(1)]:i])
        out.append(f"{dt} {name} loop_barriers={loop_bars} {' '.join(ops)}")
print("\n".join(out))
"""


def test_kernels_compile_for_sm90_with_vector_loads():
    """Compile both kernels ahead of time for an H100 (no GPU needed): catches what the interpreter
    does not (typing of loop-carried scalars, scalar branches), checks 128-bit loads/stores
    when the row stride is a multiple of 16 (scalar 2-byte loads would cap bandwidth), and that the
    vocabulary loops hold no barrier (the forward reduces across lanes once, after its loop)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    if res.stdout.startswith("SKIP"):
        pytest.skip(f"this Triton cannot compile ahead of time here: {res.stdout[:200]}")
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 6, res.stdout
    for line in lines:
        assert "ld.global.v4.b32" in line, line  # 16-byte vector loads of the logits
        # per-lane accumulators: no block-wide reduction (barrier) per vocabulary block
        assert "loop_barriers=0" in line, line
        if " bwd " in line:
            assert "st.global.v4.b32" in line, line  # and 16-byte vector stores of the gradient


@pytest.mark.interpreter
def test_kernel_path_drops_nonfinite_behaviour_like_the_reference():
    """GSPO with a mask-mode cap and a -inf behaviour log-prob: the Triton path (interpreter) gives
    the reference's finite loss, gradient and counts."""
    d = make(9, 300, torch.float32, seed=12)
    d["b"] = d["b"].clone()
    d["b"][int(torch.nonzero(d["m"])[1])] = float("-inf")
    out, grad = run(decoupled_ppo_loss, d, "interpret")
    ref, grad_ref = run(decoupled_ppo_loss_ref, d)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(out.loss, ref.loss, **FP32_REORDER_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_GRAD_VS_AUTOGRAD_TOL)
    assert float(out.stats["nonfinite_count"]) == float(ref.stats["nonfinite_count"]) >= 1.0


# ----------------------------------------------------------------------------- NaN and inf logits

NAN, INF = float("nan"), float("inf")
# What each row of ``nonfinite_logits`` holds (V = 300: three 128-wide interpreter blocks, so a bad
# value can sit in a later block, or share a lane with another one).
BAD_ROWS = {
    1: "NaN, not the target, in the last block",
    2: "NaN at the target",
    3: "+inf twice in one lane, not the target",
    4: "+inf at the target",
    6: "-inf at the target",
    7: "NaN in a row that is otherwise -inf",
    8: "NaN and +inf in one row",
    10: "-inf only (no distribution: lse -inf, log-prob and entropy NaN)",
}
# Rows that stay finite: 0 and 9 plain, 5 a -inf logit that is not the target (probability 0, legitimate).


def nonfinite_logits(seed=21):
    d = make(11, 300, torch.float32, seed=seed)
    z = d["z"].clone()
    y = torch.tensor([3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23])
    z[1, 290] = NAN
    z[2, 7] = NAN
    z[3, 40], z[3, 168] = INF, INF
    z[4, 11] = INF
    z[5, 40] = -INF
    z[6, 15] = -INF
    z[7] = -INF
    z[7, 17], z[7, 100] = 1.0, NAN
    z[8, 30], z[8, 200] = INF, NAN
    z[10] = -INF
    d.update(z=z, y=y, m=torch.ones(11))
    return d


# token level, no entropy or KL term: a bad row's token is dropped (non-finite log-ratio) and the
# loss stays finite, so what the kernels say about the row shows in the logprobs and the count only
CLEAN_TOKEN_OPTS = dict(temperature=0.7, eps_clip=0.2, entropy_coef=0.0, kl_coef=0.0, importance_level="token",
                        loss_agg="token-mean")


def _same(a, b, tol=FP32_REORDER_TOL):
    torch.testing.assert_close(a, b, equal_nan=True, **tol)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.interpreter
@pytest.mark.parametrize("opts", ["sequence_entropy_kl", "token_clean"])
def test_nan_and_inf_logits_give_the_references_logprobs_entropy_loss_and_count(opts):
    """A NaN logit (at the target or not) makes the row's log-prob and entropy NaN on the Triton
    path exactly as in the reference (the floor ``max(u, -1e30)`` used to drop it: probability 0, a
    finite log-prob, nothing counted); a +inf logit gives log-sum-exp +inf (log-prob -inf, or NaN at
    the +inf target; entropy NaN); a -inf logit that is not the target stays legitimate. The loss and
    ``nonfinite_count`` agree with the reference, and the other rows are untouched."""
    d = nonfinite_logits()
    kw = OPTS if opts == "sequence_entropy_kl" else CLEAN_TOKEN_OPTS
    out, _ = run(decoupled_ppo_loss, d, "interpret", **kw)
    ref, _ = run(decoupled_ppo_loss_ref, d, **kw)
    for name in ("logprobs", "entropy"):
        _same(getattr(out, name), getattr(ref, name))
    _same(out.loss, ref.loss)
    assert float(out.stats["nonfinite_count"]) == float(ref.stats["nonfinite_count"]) == len(BAD_ROWS)
    bad = torch.zeros(11, dtype=torch.bool)
    bad[list(BAD_ROWS)] = True
    assert torch.equal(~torch.isfinite(out.logprobs), bad), out.logprobs
    assert torch.isnan(out.logprobs[[1, 2, 4, 7, 8, 10]]).all()
    assert torch.equal(out.logprobs[[3, 6]], torch.full((2,), -INF))
    assert torch.isnan(out.entropy[[1, 2, 3, 4, 7, 8, 10]]).all() and torch.isfinite(out.entropy[[0, 5, 6, 9]]).all()
    if opts == "token_clean":
        assert torch.isfinite(out.loss)
    else:  # the entropy and KL terms of a NaN row make the loss NaN, as in the reference
        assert torch.isnan(out.loss)
    # the rows without a bad value: the same numbers as in a batch without any bad row
    clean = make(11, 300, torch.float32, seed=21)
    lp = token_logprobs(d["z"], d["y"], temperature=0.7, backend="interpret")
    lp_clean = token_logprobs(clean["z"], d["y"], temperature=0.7, backend="interpret")
    assert torch.equal(lp[~bad], lp_clean[~bad])
    _same(lp, token_logprobs(d["z"], d["y"], temperature=0.7, backend="reference"))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.interpreter
def test_nan_logits_leave_the_gradient_of_finite_rows_unchanged():
    """Token level without entropy or KL term: a bad row's token is dropped (g = e = 0), so the loss
    and every gradient stay finite, the bad rows get a zero gradient on both backends of the op, and
    the finite rows get exactly the gradient they get in a batch without bad rows."""
    d = nonfinite_logits()
    out, grad = run(decoupled_ppo_loss, d, "interpret", **CLEAN_TOKEN_OPTS)
    ref_op, grad_ref_op = run(decoupled_ppo_loss, d, "reference", **CLEAN_TOKEN_OPTS)
    ref, grad_ref = run(decoupled_ppo_loss_ref, d, **CLEAN_TOKEN_OPTS)
    bad = list(BAD_ROWS)
    good = [r for r in range(11) if r not in BAD_ROWS]
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and torch.isfinite(grad_ref_op).all()
    assert torch.all(grad[bad] == 0) and torch.all(grad_ref_op[bad] == 0)
    torch.testing.assert_close(grad[good], grad_ref[good], **FP32_GRAD_VS_AUTOGRAD_TOL)
    torch.testing.assert_close(grad, grad_ref_op, **FP32_GRAD_TOL)
    clean = {**d, "z": d["z"].clone()}
    clean["z"][bad] = make(11, 300, torch.float32, seed=21)["z"][bad]
    clean["m"] = d["m"].clone()
    _, grad_clean = run(decoupled_ppo_loss, clean, "interpret", **CLEAN_TOKEN_OPTS)
    assert torch.equal(grad[good], grad_clean[good])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.interpreter
def test_nan_logits_give_a_nonfinite_gradient_row_where_the_loss_is_nan():
    """With entropy and KL terms the bad rows make the loss NaN; their gradient rows are then not
    finite on every backend (no finite-looking gradient from a NaN logit), the others are finite."""
    d = nonfinite_logits()
    kw = dict(OPTS, importance_level="token", loss_agg="token-mean")
    _, grad = run(decoupled_ppo_loss, d, "interpret", **kw)
    _, grad_ref_op = run(decoupled_ppo_loss, d, "reference", **kw)
    _, grad_ref = run(decoupled_ppo_loss_ref, d, **kw)
    finite_rows = torch.isfinite(grad_ref).all(1)
    assert torch.equal(torch.isfinite(grad).all(1), finite_rows)
    assert torch.equal(torch.isfinite(grad_ref_op).all(1), finite_rows)
    assert not finite_rows[[1, 2, 7, 8]].any()


# ----------------------------------------------------------------------------- more than 2**31 logits


def int32_row_offsets(source: str) -> list[str]:
    """What in the kernels of ``source`` could index past 2**31 - 1 elements in int32: a
    ``tl.program_id`` not turned into int64 at once, and a product with a row stride whose other
    factor is not such an int64 row index. Empty when every row offset is computed in int64."""
    import ast

    problems = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue
        int64_rows = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                text = ast.unparse(node.value)
                if "tl.program_id" in text:
                    if text.replace(" ", "").endswith(".to(tl.int64)"):
                        int64_rows.add(node.targets[0].id)
                    else:
                        problems.append(f"{fn.name}: {node.targets[0].id} = {text} is int32")
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                names = [x.id for x in (node.left, node.right) if isinstance(x, ast.Name)]
                if any(n.startswith("stride") for n in names) and not any(n in int64_rows for n in names):
                    problems.append(f"{fn.name}: {ast.unparse(node)} is not an int64 row index times a stride")
    return problems


def test_row_offsets_of_the_loss_kernels_are_int64():
    """T x V passes 2**31 at T = 14,124 for V = 152,064 (and T = 16,384 for V = 131,072): the row
    offset ``row * stride`` must be computed in int64, in both kernels. The check itself flags an
    int32 row index (the mutated source below)."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "kernels" / "ppo_loss.py").read_text()
    assert src.count("row = tl.program_id(0).to(tl.int64)") == 2
    assert int32_row_offsets(src) == []
    broken = src.replace("row = tl.program_id(0).to(tl.int64)", "row = tl.program_id(0)")
    assert len(int32_row_offsets(broken)) >= 4  # two int32 rows, each times a stride


def check_rows_alone_equal_rows_in_the_batch(T, V, dtype, device, backend, rows):
    """Log-probs, entropy and the gradient of ``rows`` of a [T, V] batch equal those of the same
    rows computed alone (the kernels are row-local, so bit for bit): a wrong row offset (int32
    overflow of ``row * V``) reads or writes another row's logits. Token level with a fixed
    normaliser, so each row's gradient depends on that row only."""
    g = torch.Generator(device=device).manual_seed(0)
    z = torch.randn(T, V, device=device, dtype=dtype, generator=g)
    y = torch.randint(0, V, (T,), device=device, generator=g)
    ones = torch.ones(T, device=device)
    idx = torch.tensor(rows, device=device)
    kw = dict(importance_level="token", loss_agg="token-mean", normalizer=float(T), backend=backend)

    def loss_and_grad(logits, labels, n):
        b = torch.zeros(n, device=device) - 5.0
        leaf = logits.requires_grad_()
        out = decoupled_ppo_loss(leaf, labels, b, ones[:n], ones[:n], **kw)
        out.loss.backward()
        return out, leaf.grad

    out, grad = loss_and_grad(z, y, T)
    part = z[idx].detach().clone()
    out_p, grad_p = loss_and_grad(part, y[idx], len(rows))
    assert torch.equal(out.logprobs[idx], out_p.logprobs) and torch.equal(out.entropy[idx], out_p.entropy)
    assert torch.equal(grad[idx], grad_p)
    lp_torch = torch.log_softmax(part.float(), -1).gather(1, y[idx][:, None])[:, 0]
    torch.testing.assert_close(out_p.logprobs, lp_torch, **BF16_INPUT_KERNEL_LOGPROB_TOL)
    assert torch.isfinite(grad[idx]).all() and (grad[idx].abs().sum(1) > 0).all()


@pytest.mark.interpreter
def test_rows_alone_equal_rows_in_the_batch_interpreter():
    """The check of the > 2**31 GPU test below, on a small batch (interpreter)."""
    check_rows_alone_equal_rows_in_the_batch(9, 300, torch.bfloat16, "cpu", "interpret", [0, 4, 7, 8])


@pytest.mark.gpu
def test_more_than_2_pow_31_logits_in_one_call_gpu():
    """T x V = 17,000 x 131,072 = 2.23e9 bf16 logits (4.5 GB, 8.9 GB with the gradient): the rows
    past 2**31 / V = 16,384 get the log-probs, entropy and gradient they get alone."""
    T, V = 17_000, 131_072
    assert T * V > 2**31
    rows = [0, 1, 16_383, 16_384, 16_385, T - 2, T - 1]
    check_rows_alone_equal_rows_in_the_batch(T, V, torch.bfloat16, "cuda", "triton", rows)


# ----------------------------------------------------------------------------- benchmark inputs


def _bench_ppo_loss():
    from bench import bench_ppo_loss

    return bench_ppo_loss


def test_benchmark_inputs_are_realistic_and_bytes_are_counted():
    """The loss benchmark's batches mask prompt tokens only (10-20%), keep importance ratios near 1
    (few clipped tokens), and count the bytes the kernels really move: rows with a zero gradient
    are written but not read (the old inputs had ~50% of such rows and counted 3 full passes)."""
    B = _bench_ppo_loss()
    m = B.realistic_mask(10_000, "cpu")
    assert 0.10 <= 1.0 - float(m.mean()) <= 0.20
    assert m[0] == 0 and m[B.SEQ_LEN - 1] == 1 and m[B.SEQ_LEN] == 0  # each sequence starts with its prompt
    T, V = 256, 1000
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(T, V, generator=g), torch.randint(0, V, (T,), generator=g)
    b, p, A, m = B.realistic_batch(z, y, g)
    act = B.active_rows(B.loss_step(decoupled_ppo_loss_ref, z, y, b, p, A, m)())
    assert act <= int(m.sum()) and act >= 0.95 * float(m.sum()), (act, float(m.sum()))
    assert B.logits_bytes_moved(T, V, act) == (2 * T + act) * V * 2
    # 32k x 151,936 bf16: 3 passes of 9.96 GB ~ 10 ms at 3 TB/s
    assert abs(B.roofline_3pass_ms(32768, 151936, 3000.0) - 9.96) < TWO_DECIMALS_ATOL


def test_benchmark_records_the_weight_gradient_path(monkeypatch):
    """The fused-linear rows say which grad_weight GEMM ran; on CPU torch 2.13 the fp32-upcast
    fallback, which warns once."""
    from areal_fast.ops import custom_ops

    monkeypatch.setattr(custom_ops, "_FALLBACK_WARNED", set())
    B = _bench_ppo_loss()
    expected = custom_ops.weight_grad_path(torch.device("cpu"), torch.bfloat16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        row = B.fused_cpu_row(T=32, H=16, V=64)
    assert row["weight_grad_path"] == expected and row["table"] == "fused_linear_cpu"
    n_warned = sum("cannot accumulate" in str(w.message) for w in rec)
    assert n_warned == (1 if expected == custom_ops.PATH_UPCAST else 0)


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=pytest.mark.interpreter)])
def test_fp64_logits_give_an_fp64_loss_and_gradient_on_every_backend(backend):
    """docs/objective.md: fp64 for fp64 inputs. The Triton kernels compute in fp32 only, so fp64
    logits take the reference formulas (row chunks) whatever the backend asked for."""
    d = {k: (v.double() if v.dtype.is_floating_point else v) for k, v in make(9, 40, torch.float32, seed=4).items()}
    out, grad = run(decoupled_ppo_loss, d, backend)
    ref, grad_ref = run(decoupled_ppo_loss_ref, d)
    assert out.loss.dtype == grad.dtype == torch.float64
    torch.testing.assert_close(out.loss, ref.loss, atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL)
    torch.testing.assert_close(grad, grad_ref, atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL)
    lp = token_logprobs(d["z"], d["y"], temperature=OPTS["temperature"], backend=backend)
    assert lp.dtype == torch.float32  # log-probs for the trainer's buffers stay fp32, as token_logprobs_ref's


def test_gradcheck_fp64_through_the_custom_op():
    d = {k: (v.double() if v.dtype.is_floating_point else v) for k, v in make(6, 11, torch.float32, seed=9).items()}

    def f(z):
        return decoupled_ppo_loss(z, d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"], ref_logprobs=d["q"],
                                  cu_seqlens=d["cu"], backend="reference", **OPTS).loss

    assert torch.autograd.gradcheck(f, (d["z"].clone().requires_grad_(),))
