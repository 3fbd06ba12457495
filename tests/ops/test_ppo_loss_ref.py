"""The PyTorch reference of the decoupled-PPO loss against a direct fp64 evaluation of its definition.

``spec_eval`` below is written independently of ``areal_fast.ops.objective``: token by token
and sequence by sequence, with Python control flow, straight from docs/objective.md.
"""

import math

import pytest
import torch
from tolerances import FP32_FEW_ROUNDINGS_RTOL, FP32_STAT_ATOL, FP64_REORDER_TOL

from areal_fast.ops import STAT_NAMES, decoupled_ppo_loss_ref, token_logprobs_ref


def _f(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def behaviour_weights(b, pt, m, cu, w_raw, dropped, o):
    """Per docs/objective.md, one token at a time: the weight of every token after token MIS, M2PO,
    sequence MIS and TIS, and the flags (lists of bools) of what each option did."""
    T = len(w_raw)
    out = {k: [False] * T for k in ("tis_truncated", "token_mis_masked", "seq_mis_masked", "m2po_masked")}
    valid = [bool(m[t] != 0) and not dropped[t] for t in range(T)]
    lo, hi = o.get("token_mis_lower"), o.get("token_mis_upper")
    for t in range(T):
        out["token_mis_masked"][t] = valid[t] and ((lo is not None and w_raw[t] < lo) or
                                                   (hi is not None and w_raw[t] > hi))
    tau = o.get("m2po_tau")
    if tau is not None:
        # greedy, one token at a time: mask the largest (p - b)^2 (the earliest on ties) while the
        # mean over the remaining valid tokens is >= tau
        left = [t for t in range(T) if valid[t]]
        sq = {t: (_f(pt[t]) - _f(b[t])) ** 2 for t in left}
        while left and sum(sq[t] for t in left) / len(left) >= tau:
            worst = max(left, key=lambda t: (sq[t], -t))
            out["m2po_masked"][worst] = True
            left.remove(worst)
    kept = [valid[t] and not out["token_mis_masked"][t] and not out["m2po_masked"][t] for t in range(T)]
    w = [w_raw[t] if kept[t] else 0.0 for t in range(T)]
    slo, shi = o.get("seq_mis_lower"), o.get("seq_mis_upper")
    if slo is not None or shi is not None:
        for i in range(len(cu) - 1):
            idx = [t for t in range(int(cu[i]), int(cu[i + 1])) if kept[t]]
            if not idx:
                continue
            ws = math.exp(sum(_f(pt[t]) - _f(b[t]) for t in idx) / len(idx))  # geometric mean of the w_t
            out_of_band = (slo is not None and ws < slo) or (shi is not None and ws > shi)
            for t in idx:
                out["seq_mis_masked"][t] = out_of_band
                kept[t] = not out_of_band
                w[t] = 0.0 if out_of_band else ws
    C = o.get("tis_cap")
    if C is not None:
        for t in range(T):
            out["tis_truncated"][t] = kept[t] and w[t] > C
            w[t] = min(w[t], C)
    out["kept"] = kept
    return w, out


def spec_eval(z, y, b, A, m, p, q, cu, normalizer, o):
    """Loss (autograd-differentiable in z) and stats, per docs/objective.md, in fp64."""
    tau = o.get("temperature", 1.0)
    eps = o.get("eps_clip", 0.2)
    eps_h = o.get("eps_clip_higher") or eps
    c = o.get("dual_clip")
    x = z.double() / tau
    logP = x - torch.logsumexp(x, -1, keepdim=True)
    P = logP.exp()
    T = z.shape[0]
    l = [logP[t, y[t]] for t in range(T)]  # noqa: E741  (the name in docs/objective.md)
    H = [-(P[t] * logP[t]).sum() for t in range(T)]
    pt = b if p is None else p
    # behaviour weight; a loss token whose weight cannot be formed (b or p not finite, overflow, or
    # p - b above 20) is dropped: weight 0, log-ratio 0, out of the sequence statistics, counted as
    # non-finite
    w_raw, dropped = [], []
    for t in range(T):
        ok = math.isfinite(_f(b[t])) and math.isfinite(_f(pt[t])) and _f(pt[t]) - _f(b[t]) <= 20.0
        w = (1.0 if p is None else math.exp(min(_f(p[t]) - _f(b[t]), 800.0))) if ok else math.inf
        drop = bool(m[t] != 0) and not math.isfinite(w)
        dropped.append(drop)
        w_raw.append(0.0 if drop else w)
    rho, rho_unclamped, nonfinite = [], [], 0
    for t in range(T):
        d = l[t] - (0.0 if dropped[t] else _f(pt[t]))
        if dropped[t] or not math.isfinite(_f(d)):
            nonfinite += int(m[t] != 0)
            d = d * 0.0 if math.isnan(_f(d)) else torch.zeros((), dtype=torch.float64)
        rho_unclamped.append(d)
        rho.append(torch.clamp(d, -20.0, 20.0))
    weight, flags = behaviour_weights(b, pt, m, cu, w_raw, dropped, o)
    rejected = [not flags["kept"][t] for t in range(T)]

    def surr(r, a):
        rc = torch.clamp(r, 1 - eps, 1 + eps_h)
        clipped = _f(-a * rc) > _f(-a * r)
        pg = -a * rc if clipped else -a * r
        dual = False
        if c is not None and a < 0 and _f(-c * a) < _f(pg):
            pg, dual = -c * a + 0.0 * pg, True
        return pg, clipped, dual

    segs = [(0, T)] if cu is None else [(int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    pg, ratio, clip, dualf = [None] * T, [0.0] * T, [False] * T, [False] * T
    if o.get("importance_level", "token") == "token":
        for t in range(T):
            r = torch.exp(rho[t])
            pg[t], clip[t], dualf[t] = surr(r, _f(A[t]))
            ratio[t] = _f(r)
    else:
        for s, e in segs:
            # the sequence's ratio and advantage are means over its kept tokens only
            idx = [t for t in range(s, e) if m[t] and not dropped[t] and not rejected[t]]
            n = max(len(idx), 1)
            rs = torch.exp(sum((rho[t] for t in idx), torch.zeros((), dtype=torch.float64)) / n)
            As = sum(_f(A[t]) for t in idx) / n
            pgs, cl, du = surr(rs, As)
            for t in range(s, e):
                pg[t], clip[t], dualf[t], ratio[t] = pgs, cl, du, _f(rs)
    L = []
    stat = {k: [] for k in ("w_raw", "kl")}
    for t in range(T):
        w = weight[t]
        stat["w_raw"].append(w_raw[t])
        Lt = w * pg[t]
        if o.get("kl_coef", 0.0) > 0:
            d = l[t] - _f(q[t])
            k = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) + d - 1}[o.get("kl_estimator", "k3")]
            stat["kl"].append(_f(k))
            Lt = Lt + o["kl_coef"] * k
        Lt = Lt - o.get("entropy_coef", 0.0) * H[t]
        L.append(Lt)
    masked = [t for t in range(T) if m[t]]
    zero = torch.zeros((), dtype=torch.float64)
    if o.get("loss_agg", "token-mean") == "token-mean":
        D = normalizer if normalizer is not None else max(len(masked), 1)
        loss = sum((L[t] for t in masked), zero) / D
    else:
        per_seq, nonempty = [], 0
        for s, e in segs:
            idx = [t for t in range(s, e) if m[t]]
            nonempty += bool(idx)
            per_seq.append(sum((L[t] for t in idx), zero) / max(len(idx), 1))
        loss = sum(per_seq, zero) / (normalizer if normalizer is not None else max(nonempty, 1))
    n = max(len(masked), 1)

    def mean(v):
        return sum(_f(v[t]) for t in masked) / n

    stats = {
        "n_tokens": len(masked), "ratio_mean": mean(ratio), "clip_fraction": mean(clip),
        "dual_clip_fraction": mean(dualf), "approx_kl": mean([_f(rho_unclamped[t]) for t in range(T)]),
        "behav_kl": mean([0.0 if dropped[t] else _f(pt[t]) - _f(b[t]) for t in range(T)]),
        "behav_weight_mean": mean(stat["w_raw"]),
        **{f"{k}_fraction": mean(flags[k]) for k in ("tis_truncated", "token_mis_masked", "seq_mis_masked",
                                                     "m2po_masked")},
        "entropy_mean": mean([_f(h) for h in H]), "nonfinite_count": nonfinite,
    }
    if stat["kl"]:
        stats["kl_mean"] = mean(stat["kl"])
    return loss, stats


def make_inputs(T=12, V=11, S=3, seed=0, dtype=torch.float64, temperature=1.0):
    """Random packed batch whose ratios straddle the clip range (log-ratio noise ~0.3)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, V, (T,), generator=g)
    l_true = torch.log_softmax(z / temperature, -1)[torch.arange(T), y]
    b = l_true + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    p = b + 0.2 * torch.randn(T, generator=g, dtype=torch.float64)
    q = l_true + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    A = torch.randn(T, generator=g, dtype=torch.float64)
    m = (torch.rand(T, generator=g) > 0.25).float()
    m[0] = 1.0
    cuts = sorted(torch.randperm(T - 1, generator=g)[: S - 1].add(1).tolist())
    cu = torch.tensor([0, *cuts, T], dtype=torch.int32)
    return dict(z=z.to(dtype), y=y, b=b, A=A, m=m, p=p, q=q, cu=cu)


OPTIONS = {
    "default": {},
    "clip_higher": dict(eps_clip=0.1, eps_clip_higher=0.28),
    "dual_clip": dict(eps_clip=0.05, dual_clip=1.1),
    "cap_mask": dict(token_mis_upper=1.1),
    "cap_clamp": dict(tis_cap=1.1),
    "no_prox": dict(_no_prox=True),
    "sequence": dict(importance_level="sequence", eps_clip=0.05),
    "sequence_dual_seqmean": dict(importance_level="sequence", eps_clip=0.05, dual_clip=1.05,
                                  loss_agg="seq-mean-token-mean"),
    "sequence_cap_mask": dict(importance_level="sequence", eps_clip=0.05, token_mis_upper=1.05),
    "sequence_cap_clamp": dict(importance_level="sequence", eps_clip=0.05, tis_cap=1.05,
                               loss_agg="seq-mean-token-mean"),
    "kl_k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "entropy": dict(entropy_coef=0.01),
    "seq_mean": dict(loss_agg="seq-mean-token-mean"),
    "normalizer": dict(_normalizer=50.0),
    "seq_mean_normalizer": dict(loss_agg="seq-mean-token-mean", _normalizer=7.0),
    "temperature": dict(temperature=0.7),
    "everything": dict(temperature=0.8, eps_clip=0.1, eps_clip_higher=0.2, dual_clip=1.2, tis_cap=1.15,
                       importance_level="sequence", kl_coef=0.05, kl_estimator="k3",
                       entropy_coef=0.02, loss_agg="seq-mean-token-mean"),
    # the train/inference mismatch options (docs/objective.md), appended so the seeds above stay
    "tis": dict(tis_cap=1.1),
    "icepop": dict(token_mis_lower=0.9, token_mis_upper=1.1),
    "seq_mis": dict(seq_mis_lower=0.9, seq_mis_upper=1.1),
    "m2po": dict(m2po_tau=0.015),
    "m2po_tis_seq_mis": dict(eps_clip=0.5, m2po_tau=0.02, tis_cap=1.02, seq_mis_lower=0.9, seq_mis_upper=1.05,
                             token_mis_lower=0.85),
    "sequence_m2po_seq_mis": dict(importance_level="sequence", eps_clip=0.5, m2po_tau=0.02, seq_mis_upper=1.05),
}


def split_options(opts):
    opts = dict(opts)
    no_prox = opts.pop("_no_prox", False)
    normalizer = opts.pop("_normalizer", None)
    return opts, no_prox, normalizer


@pytest.mark.parametrize("name", list(OPTIONS))
def test_reference_matches_spec_fp64(name):
    opts, no_prox, normalizer = split_options(OPTIONS[name])
    d = make_inputs(seed=list(OPTIONS).index(name), temperature=opts.get("temperature", 1.0))
    p = None if no_prox else d["p"]
    needs_cu = (opts.get("importance_level") == "sequence" or opts.get("loss_agg") == "seq-mean-token-mean"
                or "seq_mis_lower" in opts or "seq_mis_upper" in opts)
    cu = d["cu"] if needs_cu else None
    z1 = d["z"].clone().requires_grad_()
    out = decoupled_ppo_loss_ref(z1, d["y"], d["b"], d["A"], d["m"], prox_logprobs=p, ref_logprobs=d["q"],
                                 cu_seqlens=cu, normalizer=normalizer, **opts)
    out.loss.backward()
    z2 = d["z"].clone().requires_grad_()
    loss, stats = spec_eval(z2, d["y"], d["b"], d["A"], d["m"], p, d["q"], cu, normalizer, opts)
    loss.backward()
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, loss, atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL)
    torch.testing.assert_close(z1.grad, z2.grad, atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL)
    assert z1.grad.abs().sum() > 0
    # masked-out tokens have exactly zero gradient
    assert torch.all(z1.grad[d["m"] == 0] == 0)
    assert set(STAT_NAMES) <= set(out.stats)
    assert ("kl_mean" in out.stats) == ("kl_mean" in stats)
    for k, v in stats.items():
        assert out.stats[k].dtype == torch.float32 and out.stats[k].dim() == 0
        assert abs(float(out.stats[k]) - v) < FP32_STAT_ATOL, (k, float(out.stats[k]), v)


def test_option_data_exercises_branches():
    """The random data above must actually clip, dual-clip and cap, else the tests prove little."""
    for name, key in (("default", "clip_fraction"), ("dual_clip", "dual_clip_fraction"),
                      ("cap_mask", "token_mis_masked_fraction"),
                      ("sequence_cap_mask", "token_mis_masked_fraction"), ("tis", "tis_truncated_fraction"),
                      ("icepop", "token_mis_masked_fraction"), ("seq_mis", "seq_mis_masked_fraction"),
                      ("m2po", "m2po_masked_fraction"), ("m2po_tis_seq_mis", "m2po_masked_fraction"),
                      ("m2po_tis_seq_mis", "seq_mis_masked_fraction"),
                      ("m2po_tis_seq_mis", "tis_truncated_fraction"),
                      ("m2po_tis_seq_mis", "token_mis_masked_fraction"),
                      ("sequence_m2po_seq_mis", "m2po_masked_fraction"),
                      ("sequence_dual_seqmean", "clip_fraction"),
                      ("sequence_dual_seqmean", "dual_clip_fraction")):
        opts, _, _ = split_options(OPTIONS[name])
        d = make_inputs(seed=list(OPTIONS).index(name))
        _, stats = spec_eval(d["z"], d["y"], d["b"], d["A"], d["m"], d["p"], d["q"], d["cu"], None, opts)
        assert 0 < stats[key] < 1, (name, key, stats[key])


def test_gradcheck_fp64():
    d = make_inputs(T=6, V=5, S=2, seed=3)
    opts = dict(temperature=0.9, importance_level="sequence", kl_coef=0.1, entropy_coef=0.05, eps_clip=0.3,
                tis_cap=1.3)

    def f(z):
        return decoupled_ppo_loss_ref(z, d["y"], d["b"], d["A"], d["m"], prox_logprobs=d["p"], ref_logprobs=d["q"],
                                      cu_seqlens=d["cu"], **opts).loss

    assert torch.autograd.gradcheck(f, (d["z"].clone().requires_grad_(),))


def test_nonfinite_log_ratio_is_zeroed_and_counted():
    d = make_inputs(seed=5)
    p = d["p"].clone()
    t = int(torch.nonzero(d["m"])[1])
    p[t] = float("inf")  # rho = -inf for a masked token
    A = d["A"].clone()
    A[d["m"] == 0] = float("nan")  # garbage on unmasked tokens must not leak
    z = d["z"].clone().requires_grad_()
    out = decoupled_ppo_loss_ref(z, d["y"], d["b"], A, d["m"], prox_logprobs=p, token_mis_upper=2.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(z.grad).all()
    assert float(out.stats["nonfinite_count"]) == 1.0
    assert torch.all(z.grad[t] == 0)  # rho became a constant 0: no gradient through the ratio


def test_log_ratio_clamp_zeroes_gradient():
    d = make_inputs(seed=6)
    b = d["b"].clone() - 30.0  # rho ~ +30 > 20 on every token: clamped, so the ratio term is constant
    z = d["z"].clone().requires_grad_()
    out = decoupled_ppo_loss_ref(z, d["y"], b, d["A"], d["m"], eps_clip=1e9)
    out.loss.backward()
    assert torch.all(z.grad == 0)
    assert abs(float(out.stats["ratio_mean"]) - math.exp(20.0)) / math.exp(20.0) < FP32_FEW_ROUNDINGS_RTOL


def test_fully_masked_batch_gives_zero_loss_and_grad():
    d = make_inputs(seed=7)
    z = d["z"].clone().requires_grad_()
    out = decoupled_ppo_loss_ref(z, d["y"], d["b"], d["A"], torch.zeros(12), cu_seqlens=d["cu"],
                                 loss_agg="seq-mean-token-mean")
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.all(z.grad == 0)
    assert float(out.stats["n_tokens"]) == 0.0


def test_token_logprobs_ref_ignore_label():
    d = make_inputs(seed=8)
    y = d["y"].clone()
    y[2] = -100
    lp, ent = token_logprobs_ref(d["z"], y, return_entropy=True)
    assert lp.dtype == torch.float32 and float(lp[2]) == 0.0 and torch.all(lp[y >= 0] < 0)
    assert torch.all(ent > 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(importance_level="sequence"), "cu_seqlens"),
        (dict(loss_agg="seq-mean-token-mean"), "cu_seqlens"),
        (dict(kl_coef=0.1), "ref_logprobs"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(temperature=0.0), "temperature"),
        (dict(cu_seqlens=torch.tensor([0, 5, 11])), "cu_seqlens"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, match):
    d = make_inputs()
    with pytest.raises(ValueError, match=match):
        decoupled_ppo_loss_ref(d["z"], d["y"], d["b"], d["A"], d["m"], **kwargs)


def test_bad_shapes_name_the_input():
    d = make_inputs()
    with pytest.raises(ValueError, match="advantages"):
        decoupled_ppo_loss_ref(d["z"], d["y"], d["b"], d["A"][:5], d["m"])


def test_sequence_mask_cap_leaves_rejected_tokens_out_of_the_sequence_statistics():
    """GSPO with a mask-mode cap: a rejected token does not pull its sequence's mean log-ratio or
    mean advantage (computed here by hand for one sequence)."""
    d = make_inputs(T=6, V=7, S=1, seed=11)
    m = torch.ones(6)
    p = d["b"].clone()
    p[2] = d["b"][2] + 1.0  # w = e = 2.7 > cap: rejected
    A = torch.tensor([1.0, 1.0, -50.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    cu = torch.tensor([0, 6])
    opts = dict(importance_level="sequence", token_mis_upper=2.0, eps_clip=10.0)  # no clipping
    z = d["z"].clone().requires_grad_()
    out = decoupled_ppo_loss_ref(z, d["y"], d["b"], A, m, prox_logprobs=p, cu_seqlens=cu, **opts)
    out.loss.backward()
    logp = torch.log_softmax(d["z"], -1)[torch.arange(6), d["y"]]
    kept = [0, 1, 3, 4, 5]
    rho_s = (logp[kept] - p[kept]).mean()
    A_s = A[kept].mean()  # 1.0: the rejected token's -50 does not enter
    w = torch.exp(p - d["b"])
    expect = sum(-A_s * torch.exp(rho_s) * w[t] for t in kept) / 6  # the rejected token stays in D
    torch.testing.assert_close(out.loss, expect, atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL)
    assert float(out.stats["token_mis_masked_fraction"]) == pytest.approx(1 / 6)
    assert torch.all(z.grad[2] == 0)  # no gradient through the rejected token's log-prob


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("with_prox", [True, False])
@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), float("inf")])
def test_nonfinite_behaviour_logprob_never_poisons_the_loss(level, with_prox, bad):
    """A -inf/NaN/inf behaviour log-prob on a loss token (no cap set) drops that token: finite loss
    and gradient, equal to the loss without it (it stays in the normaliser), counted in the stats."""
    d = make_inputs(seed=12)
    t = int(torch.nonzero(d["m"])[2])
    b = d["b"].clone()
    b[t] = bad
    kw = dict(prox_logprobs=d["p"] if with_prox else None, cu_seqlens=d["cu"], importance_level=level)
    z = d["z"].clone().requires_grad_()
    out = decoupled_ppo_loss_ref(z, d["y"], b, d["A"], d["m"], **kw)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(z.grad).all()
    assert float(out.stats["nonfinite_count"]) == 1.0
    assert all(math.isfinite(float(v)) for v in out.stats.values())
    assert torch.all(z.grad[t] == 0)
    # the same as masking the token's policy-gradient term out by hand (same normaliser)
    loss, _ = spec_eval(d["z"], d["y"], b, d["A"], d["m"], kw["prox_logprobs"], d["q"], d["cu"], None,
                        dict(importance_level=level))
    torch.testing.assert_close(out.loss, loss, atol=FP64_REORDER_TOL, rtol=FP64_REORDER_TOL)


def test_an_unknown_loss_option_is_refused_naming_it():
    d = make_inputs()
    with pytest.raises(TypeError, match="behav_weight_cap"):
        decoupled_ppo_loss_ref(d["z"], d["y"], d["b"], d["A"], d["m"], behav_weight_cap=5.0)
