"""The train/inference mismatch and staleness options of the loss (token TIS, token/sequence MIS,
IcePop, M2PO; docs/objective.md) on small hand-computable cases, their gradients, odd shapes and
fully masked rows in the reference, the Triton kernels (interpreter on CPU) and the fused-linear
path, the deprecated aliases, and the mismatch dashboard's formulas.

The expected values here are written from the formulas, not from ``areal_fast.ops.objective``.
"""

import math

import pytest
import torch
from tolerances import (
    FP32_CHUNKED_GEMM_TOL,
    FP32_FEW_ROUNDINGS_RTOL,
    FP32_GRAD_TOL,
    FP32_LARGE_EXP_RTOL,
    FP32_REORDER_TOL,
    FP64_REORDER_TOL,
)

from areal_fast.ops import (
    PPOLossConfig,
    decoupled_ppo_loss,
    decoupled_ppo_loss_ref,
    fused_linear_decoupled_ppo_loss,
    fused_linear_decoupled_ppo_loss_ref,
)
from areal_fast.ops.objective import m2po_select, mismatch_stats

# one config per option (and a combination); bands chosen so the random data below hits them
OPTIONS = {
    "tis": dict(tis_cap=1.1),
    "token_mis": dict(token_mis_lower=0.8, token_mis_upper=1.2),
    "icepop": dict(token_mis_lower=0.5, token_mis_upper=1.1),
    "seq_mis": dict(seq_mis_lower=0.9, seq_mis_upper=1.1),
    "m2po": dict(m2po_tau=0.02),
    "all": dict(tis_cap=1.05, token_mis_lower=0.7, m2po_tau=0.03, seq_mis_upper=1.15),
}


def _w_loss(w, A, n):
    """token-mean loss of the policy term with r = 1 (l = p): sum_t -w_t A_t / n."""
    return -sum(wi * float(ai) for wi, ai in zip(w, A)) / n


def _one_hot_logits(l_target: torch.Tensor, V: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, V] whose label (0) has exactly log-prob ``l_target[t]`` at temperature 1."""
    T = l_target.shape[0]
    P0 = l_target.exp()
    rest = ((1 - P0) / (V - 1)).clamp_min(1e-30)
    z = torch.log(torch.cat([P0[:, None], rest[:, None].expand(T, V - 1)], 1))
    return z, torch.zeros(T, dtype=torch.long)


def _hand_case(**opts):
    """Four loss tokens in two sequences with l = p (ratio 1, no clipping), chosen log weights."""
    log_w = torch.tensor([0.0, math.log(1.5), math.log(0.5), math.log(1.1)], dtype=torch.float64)
    p = torch.log(torch.tensor([0.5, 0.4, 0.3, 0.2], dtype=torch.float64))
    b = p - log_w
    A = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    z, y = _one_hot_logits(p)
    out = decoupled_ppo_loss_ref(z, y, b, A, torch.ones(4), prox_logprobs=p, cu_seqlens=torch.tensor([0, 2, 4]),
                                 eps_clip=10.0, **opts)
    return out, A


def test_tis_truncates_the_behaviour_weight_at_c():
    out, A = _hand_case(tis_cap=1.2)
    expect = _w_loss([1.0, 1.2, 0.5, 1.1], A, 4)  # exp(p - b) = 1, 1.5 -> 1.2, 0.5, 1.1
    assert float(out.loss) == pytest.approx(expect, abs=FP64_REORDER_TOL)
    assert float(out.stats["tis_truncated_fraction"]) == 0.25


def test_token_mis_and_icepop_mask_outside_the_two_sided_band():
    out, A = _hand_case(token_mis_lower=0.6, token_mis_upper=1.2)
    assert float(out.loss) == pytest.approx(_w_loss([1.0, 0.0, 0.0, 1.1], A, 4), abs=FP64_REORDER_TOL)
    assert float(out.stats["token_mis_masked_fraction"]) == 0.5
    # the band is closed: a weight exactly on a bound is kept
    out, A = _hand_case(token_mis_lower=0.5, token_mis_upper=1.5)
    assert float(out.stats["token_mis_masked_fraction"]) == 0.0


def test_sequence_mis_uses_the_geometric_mean_of_the_kept_tokens():
    # sequence 0: w = (1, 1.5), geometric mean sqrt(1.5) = 1.2247; sequence 1: (0.5, 1.1) -> 0.7416
    out, A = _hand_case(seq_mis_lower=0.8, seq_mis_upper=1.3)
    g0 = math.sqrt(1.5)
    assert float(out.loss) == pytest.approx(_w_loss([g0, g0, 0.0, 0.0], A, 4), abs=FP64_REORDER_TOL)
    assert float(out.stats["seq_mis_masked_fraction"]) == 0.5
    # with token MIS first, sequence 1 keeps only 1.1 (0.5 is masked): its geometric mean is 1.1
    out, A = _hand_case(token_mis_lower=0.6, seq_mis_lower=0.8, seq_mis_upper=1.3)
    assert float(out.loss) == pytest.approx(_w_loss([g0, g0, 0.0, 1.1], A, 4), abs=FP64_REORDER_TOL)


def test_m2po_masks_the_largest_squared_log_weights_until_the_second_moment_is_under_tau():
    # (p - b)^2 = 0, 0.1644, 0.4805, 0.0091: mean 0.1635; without 0.4805: 0.0578; without 0.1644 too: 0.0045
    out, A = _hand_case(m2po_tau=0.05)
    assert float(out.loss) == pytest.approx(_w_loss([1.0, 0.0, 0.0, 1.1], A, 4), abs=FP64_REORDER_TOL)
    assert float(out.stats["m2po_masked_fraction"]) == 0.5
    out, _ = _hand_case(m2po_tau=0.06)  # 0.0578 < 0.06: one token is enough
    assert float(out.stats["m2po_masked_fraction"]) == 0.25
    out, _ = _hand_case(m2po_tau=1.0)
    assert float(out.stats["m2po_masked_fraction"]) == 0.0


def test_m2po_selection_is_deterministic_on_ties_and_can_mask_everything():
    sq = torch.tensor([4.0, 1.0, 4.0, 4.0, 0.0])
    valid = torch.tensor([True, True, True, False, True])
    # valid values 4, 1, 4, 0: mean 2.25; masking one 4 -> 5/3; both 4s -> 0.5 < 1: the two 4s, earliest first
    assert m2po_select(sq, valid, 1.0).tolist() == [True, False, True, False, False]
    assert m2po_select(sq, valid, 2.0).tolist() == [True, False, False, False, False]  # 5/3 < 2: the first 4
    everything = torch.tensor([1.0, 1.0])
    assert m2po_select(everything, torch.ones(2, dtype=torch.bool), 0.5).tolist() == [True, True]
    assert m2po_select(torch.zeros(0), torch.zeros(0, dtype=torch.bool), 0.5).tolist() == []


def make(T, V=13, S=None, seed=0, dtype=torch.float64):
    """Random packed batch, ~6 tokens a sequence (so sequence weights still spread), log weights ~0.2."""
    S = max(3, T // 6) if S is None else S
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, V, (T,), generator=g)
    l_true = torch.log_softmax(z, -1)[torch.arange(T), y]
    b = l_true + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    p = b + 0.2 * torch.randn(T, generator=g, dtype=torch.float64)
    A = torch.randn(T, generator=g, dtype=torch.float64)
    m = (torch.rand(T, generator=g) > 0.25).double()
    m[0] = 1.0
    cuts = sorted({0, T, *torch.randint(0, T + 1, (S - 1,), generator=g).tolist()})
    return dict(z=z.to(dtype), y=y, b=b, p=p, A=A, m=m, cu=torch.tensor(cuts, dtype=torch.int32))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_gradcheck_fp64_each_option(name):
    d = make(T=9, V=5, seed=1)
    for level in ("token", "sequence"):
        def f(z, level=level):
            return decoupled_ppo_loss_ref(z, d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"],
                                          cu_seqlens=d["cu"], importance_level=level, eps_clip=0.3,
                                          **OPTIONS[name]).loss

        assert torch.autograd.gradcheck(f, (d["z"].clone().requires_grad_(),))


def test_the_options_fire_on_the_random_data():
    """Else the path comparisons below prove little."""
    for name, opts in OPTIONS.items():
        d = make(T=257, seed=2)
        out = decoupled_ppo_loss_ref(d["z"], d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"],
                                     cu_seqlens=d["cu"], **opts)
        fired = [k for k in ("tis_truncated_fraction", "token_mis_masked_fraction", "seq_mis_masked_fraction",
                             "m2po_masked_fraction") if float(out.stats[k]) > 0]
        assert fired, name


def _fully_masked(d):
    """The data with its first sequence entirely out of the loss mask."""
    m = d["m"].clone()
    m[: int(d["cu"][1])] = 0
    m[0] = 0
    return m


@pytest.mark.interpreter
@pytest.mark.parametrize("T", [1, 7, pytest.param(257, marks=pytest.mark.slow)])  # 257: ~10 s each, interpreted
@pytest.mark.parametrize("name", list(OPTIONS))
def test_triton_kernels_match_the_reference(T, name, monkeypatch):
    d = make(T=T, seed=T, dtype=torch.float32)
    results = []
    for mask in (d["m"], _fully_masked(d)):
        for backend in ("interpret", None):
            z = d["z"].clone().requires_grad_()
            fn = decoupled_ppo_loss if backend else decoupled_ppo_loss_ref
            kw = dict(backend=backend) if backend else {}
            out = fn(z, d["y"], d["b"].float(), d["A"].float(), mask, prox_logprobs=d["p"].float(),
                     cu_seqlens=d["cu"], **OPTIONS[name], **kw)
            out.loss.backward()
            assert torch.all(z.grad[mask == 0] == 0)
            results.append((out, z.grad))
    for (o1, g1), (o2, g2) in (results[0:2], results[2:4]):
        torch.testing.assert_close(o1.loss, o2.loss, **FP32_REORDER_TOL)
        torch.testing.assert_close(g1, g2, **FP32_GRAD_TOL)
        for k in o2.stats:
            torch.testing.assert_close(o1.stats[k], o2.stats[k], **FP32_REORDER_TOL)


@pytest.mark.parametrize("T", [1, 7, 257])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_fused_linear_single_and_two_pass_match_the_reference(T, name):
    g = torch.Generator().manual_seed(T)
    d = make(T=T, seed=T + 1, dtype=torch.float32)
    H, V = 8, 13
    hidden, W = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    for mask in (d["m"], _fully_masked(d)):
        outs = []
        for fn, kw in ((fused_linear_decoupled_ppo_loss_ref, {}),
                       (fused_linear_decoupled_ppo_loss, dict(single_pass=True, chunk_size=5, backend="reference")),
                       (fused_linear_decoupled_ppo_loss, dict(single_pass=False, chunk_size=5, backend="reference"))):
            h, w = hidden.clone().requires_grad_(), W.clone().requires_grad_()
            out = fn(h, w, d["y"], d["b"].float(), d["A"].float(), mask, prox_logprobs=d["p"].float(),
                     cu_seqlens=d["cu"], **OPTIONS[name], **kw)
            out.loss.backward()
            outs.append((out, h.grad, w.grad))
        for out, gh, gw in outs[1:]:
            torch.testing.assert_close(out.loss, outs[0][0].loss, **FP32_CHUNKED_GEMM_TOL)
            torch.testing.assert_close(gh, outs[0][1], **FP32_CHUNKED_GEMM_TOL)
            torch.testing.assert_close(gw, outs[0][2], **FP32_CHUNKED_GEMM_TOL)
            for k in ("tis_truncated_fraction", "token_mis_masked_fraction", "seq_mis_masked_fraction",
                      "m2po_masked_fraction"):
                assert float(out.stats[k]) == float(outs[0][0].stats[k])


def test_sequence_mis_needs_cu_seqlens_and_bounds_are_checked():
    d = make(T=7)
    with pytest.raises(ValueError, match="cu_seqlens"):
        decoupled_ppo_loss_ref(d["z"], d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"], seq_mis_upper=2.0)
    with pytest.raises(ValueError, match="token_mis_lower"):
        PPOLossConfig(token_mis_lower=2.0, token_mis_upper=1.5)
    for name in ("tis_cap", "m2po_tau", "seq_mis_lower"):
        with pytest.raises(ValueError, match=name):
            PPOLossConfig(**{name: 0.0})


def test_mismatch_stats_formulas():
    b = torch.log(torch.tensor([0.5, 0.5, 0.25, 0.1]))
    p = torch.log(torch.tensor([0.5, 0.25, 0.5, 0.9]))  # the last token is outside the loss mask
    cur = p + torch.tensor([0.0, math.log(2.0), 0.0, 5.0])
    m = torch.tensor([1, 1, 1, 0])
    s = mismatch_stats(b, p, cur, m)
    w = [1.0, 0.5, 2.0]  # exp(p - b) on the loss tokens
    assert s["mismatch_k1"] == pytest.approx(sum(-math.log(x) for x in w) / 3)
    assert s["mismatch_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 3)
    assert s["mismatch_ratio_p50"] == pytest.approx(1.0) and s["mismatch_ratio_max"] == pytest.approx(2.0)
    assert s["ratio_max"] == pytest.approx(2.0) and s["ratio_p50"] == pytest.approx(1.0)
    assert mismatch_stats(b, p, cur, torch.zeros(4)) == {}


DASHBOARD_KEYS = ("mismatch_k1", "mismatch_k3", "mismatch_ratio_p50", "mismatch_ratio_p90", "mismatch_ratio_p99",
                  "mismatch_ratio_max", "ratio_p50", "ratio_p90", "ratio_p99", "ratio_max", "tis_truncated_fraction",
                  "token_mis_masked_fraction", "seq_mis_masked_fraction", "m2po_masked_fraction",
                  "staleness_p50", "staleness_p90", "staleness_max")


def test_the_actor_reports_the_dashboard_per_step(tmp_path):
    """A tiny actor, 2 minibatches, behaviour log-probs off the trainer's: every dashboard key is
    there and sane (KL >= 0 with k3 >= 0, quantiles ordered, fractions in [0, 1], staleness)."""
    import test_trainer_actor as ta  # the tiny model and batch of the actor tests

    ta.make_tiny_model(tmp_path)
    actor = ta.actor_for(str(tmp_path), ppo={"ppo_n_minibatches": 2, "loss": dict(
        tis_cap=2.0, token_mis_lower=0.05, m2po_tau=1.0, seq_mis_upper=50.0)})
    actor.version = 3
    batch = ta.make_batch(8, seed=2, version=1)
    m = actor.train_batch(batch)
    missing = [k for k in DASHBOARD_KEYS if k not in m]
    assert not missing, missing
    assert m["mismatch_k3"] >= 0 and all(math.isfinite(m[k]) for k in DASHBOARD_KEYS)
    for name in ("mismatch_ratio", "ratio"):
        qs = [m[f"{name}_{q}"] for q in ("p50", "p90", "p99", "max")]
        assert qs == sorted(qs) and qs[0] > 0
    assert all(0 <= m[k] <= 1 for k in DASHBOARD_KEYS if k.endswith("_fraction"))
    assert m["token_mis_masked_fraction"] > 0 and m["m2po_masked_fraction"] > 0  # random b: far from p
    assert m["staleness_p50"] == m["staleness_max"] == 2


def _huge_weight_case(dtype=torch.float32):
    """Random fp32 data whose loss tokens 1 and 3 carry a finite behaviour weight of e^88.6
    (3.0e38, just under fp32's largest number) and a large advantage."""
    d = make(T=7, seed=5, dtype=dtype)
    d["m"][:] = 1.0
    b, A = d["b"].clone(), d["A"].clone()
    for t in (1, 3):
        b[t] = d["p"][t] - 88.6
        A[t] = 2.0
    assert torch.isfinite(torch.exp(d["p"].float() - b.float())).all()  # finite in fp32: no overflow to drop
    return {**d, "b": b, "A": A}


def _huge_weight_runs(d, **opts):
    """(name, output, gradient) of the reference, the Triton kernels (interpreter) and both fused
    paths on the same fp32 inputs."""
    g = torch.Generator().manual_seed(1)
    T, V = d["z"].shape
    H = 6
    hidden, W = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    args = (d["y"], d["b"].float(), d["A"].float(), d["m"])
    kw = dict(prox_logprobs=d["p"].float(), cu_seqlens=d["cu"], **opts)
    runs = []
    for name, fn, extra in (("reference", decoupled_ppo_loss_ref, {}),
                            ("interpret", decoupled_ppo_loss, dict(backend="interpret"))):
        z = d["z"].float().clone().requires_grad_()
        out = fn(z, *args, **kw, **extra)
        out.loss.backward()
        runs.append((name, out, z.grad))
    for single in (True, False):
        h = hidden.clone().requires_grad_()
        out = fused_linear_decoupled_ppo_loss(h, W, *args, **kw, single_pass=single, chunk_size=3,
                                              backend="interpret")
        out.loss.backward()
        runs.append((f"fused single_pass={single}", out, h.grad))
    return runs


@pytest.mark.interpreter
@pytest.mark.parametrize("opts", [{}, dict(tis_cap=2.0)], ids=["raw", "tis_cap"])
def test_a_huge_finite_behaviour_weight_drops_the_token_and_keeps_loss_and_stats_finite(opts):
    """w = e^88.6 is finite in fp32, but w times the surrogate is not (the loss was inf, and
    behav_weight_mean inf even with tis_cap): a weight above e^20 drops its token, like one that
    overflows, on every path; the loss is the one with those tokens' behaviour log-probs at -inf."""
    d = _huge_weight_case()
    broken = {**d, "b": d["b"].clone()}
    broken["b"][[1, 3]] = float("-inf")  # the existing rule: dropped
    for (name, out, grad), (_, want, want_grad) in zip(_huge_weight_runs(d, **opts),
                                                       _huge_weight_runs(broken, **opts)):
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all(), name
        assert all(math.isfinite(float(v)) for v in out.stats.values()), (name, out.stats)
        assert float(out.stats["nonfinite_count"]) == 2.0, name
        torch.testing.assert_close(out.loss, want.loss, **FP32_REORDER_TOL)
        torch.testing.assert_close(grad, want_grad, **FP32_GRAD_TOL)
        for k in want.stats:
            if k != "behav_kl":  # a dropped token counts 0 there; -inf vs a finite b differs only in that
                torch.testing.assert_close(out.stats[k], want.stats[k], **FP32_REORDER_TOL)


def test_a_weight_at_e20_is_kept_and_just_above_it_is_dropped():
    """The bound is the log-ratio clamp's, 20 (w = 4.85e8), on the upper side only; the fp64 path
    draws it at the same place."""
    for dtype in (torch.float32, torch.float64):
        p = torch.tensor([-1.0, -1.0, -1.0], dtype=dtype)
        b = p - torch.tensor([20.0, 20.01, -40.0], dtype=dtype)
        z, y = _one_hot_logits(p.double())
        out = decoupled_ppo_loss_ref(z.to(dtype), y, b, torch.ones(3, dtype=dtype), torch.ones(3), prox_logprobs=p)
        assert float(out.stats["nonfinite_count"]) == 1.0, dtype
        assert float(out.stats["behav_weight_mean"]) == pytest.approx((math.exp(20.0) + math.exp(-40.0)) / 3,
                                                                       rel=FP32_FEW_ROUNDINGS_RTOL)


def test_stat_means_are_finite_when_their_fp32_sum_would_overflow():
    """kl_mean of six tokens with k3 = e^87 each (6.1e37): the fp32 sum is 3.6e38 = inf; the mean is not."""
    l = torch.full((6,), -87.0, dtype=torch.float64)  # noqa: E741  (l_t of docs/objective.md)
    z, y = _one_hot_logits(l)
    out = decoupled_ppo_loss_ref(z.float(), y, l.float(), torch.ones(6), torch.ones(6), ref_logprobs=torch.zeros(6),
                                 kl_coef=1e-6, kl_estimator="k3")
    assert torch.isfinite(out.loss)
    kl = float(out.stats["kl_mean"])
    assert math.isfinite(kl) and kl == pytest.approx(math.exp(87.0) + 86.0, rel=FP32_LARGE_EXP_RTOL)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_with_prox_none_only_a_cap_or_band_that_excludes_one_acts(level):
    """prox_mode none: w_t = 1. M2PO never masks (p - b = 0), a cap or band holding 1 changes
    nothing, but tis_cap < 1 scales every token's policy term by the cap, and a token- or
    sequence-MIS band that excludes 1 masks every token."""
    d = make(T=13, seed=3)
    args = (d["z"], d["y"], d["b"], d["A"], d["m"])
    kw = dict(cu_seqlens=d["cu"], importance_level=level)
    base = decoupled_ppo_loss_ref(*args, **kw)
    zero = decoupled_ppo_loss_ref(*args, **kw, token_mis_upper=0.0 + 0.5, token_mis_lower=0.1)  # excludes 1
    for opts in (dict(m2po_tau=1e-9), dict(tis_cap=1.0), dict(tis_cap=3.0), dict(token_mis_lower=0.5,
                 token_mis_upper=2.0), dict(seq_mis_lower=1.0, seq_mis_upper=1.0)):
        out = decoupled_ppo_loss_ref(*args, **kw, **opts)
        assert float(out.loss) == pytest.approx(float(base.loss), abs=FP64_REORDER_TOL), opts
        assert all(float(out.stats[k]) == 0.0 for k in ("tis_truncated_fraction", "token_mis_masked_fraction",
                                                          "seq_mis_masked_fraction", "m2po_masked_fraction")), opts
    # the policy term alone (no KL, no entropy here): scaled by the cap, or gone
    out = decoupled_ppo_loss_ref(*args, **kw, tis_cap=0.25)
    assert float(out.loss) == pytest.approx(0.25 * float(base.loss), abs=FP64_REORDER_TOL)
    assert float(out.stats["tis_truncated_fraction"]) == float(base.stats["n_tokens"] > 0)
    assert float(zero.loss) == 0.0 and float(zero.stats["token_mis_masked_fraction"]) == 1.0
    for opts in (dict(seq_mis_lower=1.5), dict(seq_mis_upper=0.5)):
        out = decoupled_ppo_loss_ref(*args, **kw, **opts)
        assert float(out.loss) == 0.0 and float(out.stats["seq_mis_masked_fraction"]) == 1.0, opts


def test_m2po_stops_strictly_below_tau_and_keeps_ppo_clipping():
    # a remaining mean exactly at tau is not enough: one more token is masked
    sq = torch.tensor([2.0, 0.0], dtype=torch.float64)
    valid = torch.ones(2, dtype=torch.bool)
    assert m2po_select(sq, valid, 1.0).tolist() == [True, False]  # mean 1.0 == tau: mask the 2
    assert m2po_select(sq, valid, 1.0 + 1e-9).tolist() == [False, False]
    # M2PO only masks: the kept tokens are clipped exactly as without it (here like the token-MIS
    # band that masks the same two tokens, weights 1.5 and 0.5)
    log_w = torch.tensor([0.0, math.log(1.5), math.log(0.5), math.log(1.1)], dtype=torch.float64)
    l_true = torch.log(torch.tensor([0.5, 0.4, 0.3, 0.2], dtype=torch.float64))
    p = l_true - torch.tensor([0.3, -0.3, 0.25, -0.4], dtype=torch.float64)  # ratios e^0.3, e^-0.3, ...
    b = p - log_w
    A = torch.tensor([1.0, 2.0, -1.0, -0.5], dtype=torch.float64)
    z, y = _one_hot_logits(l_true)
    kw = dict(prox_logprobs=p, eps_clip=0.2)
    m2po = decoupled_ppo_loss_ref(z, y, b, A, torch.ones(4), m2po_tau=0.05, **kw)
    band = decoupled_ppo_loss_ref(z, y, b, A, torch.ones(4), token_mis_lower=0.6, token_mis_upper=1.2, **kw)
    assert float(m2po.stats["m2po_masked_fraction"]) == 0.5
    assert float(m2po.stats["clip_fraction"]) == float(band.stats["clip_fraction"]) > 0
    r = torch.exp(l_true - p)
    pg = torch.maximum(-A * r, -A * r.clamp(0.8, 1.2))
    expect = float((torch.exp(log_w) * pg)[[0, 3]].sum()) / 4
    assert float(m2po.loss) == pytest.approx(expect, abs=FP64_REORDER_TOL)
    assert float(band.loss) == pytest.approx(expect, abs=FP64_REORDER_TOL)
