"""The per-token decoupled-PPO objective on [T] vectors, shared by every backend.

Every backend (reference, Triton, fused-linear) first produces two differentiable [T] vectors,
the label log-probability ``l_t`` and the entropy ``H_t``; this module turns them into the loss
and the stats defined in ``docs/objective.md``. It is plain PyTorch on [T]-sized tensors (a few
hundred kilobytes at T = 32768), so autograd gives ``g_t = dloss/dl_t`` and ``e_t = dloss/dH_t``
for free and the [T, V] kernels only need those two numbers per row.

Choices written down in ``docs/objective.md`` (and implemented here only):
  * ``rho_t = l_t - p_t``: non-finite values become 0, then it is clamped to [-20, 20] (zero
    gradient outside).
  * A loss token whose behaviour weight ``exp(p_t - b_t)`` cannot be formed (``b_t`` or ``p_t``
    non-finite, or ``p_t - b_t > LOG_BEHAV_WEIGHT_MAX`` = 20: the weight overflows, or is so large
    that the weight times the surrogate would) is *dropped*: ``w_t = 0`` and it leaves the
    sequence statistics, like a token masked by MIS or M2PO. ``nonfinite_count`` counts the loss
    tokens with a dropped weight or a non-finite log-ratio.
  * Sequence level: ``rho_s`` and ``A_s`` are means over the sequence's *kept* loss tokens (not
    masked by a behaviour-weight option, not dropped as non-finite).
  * The KL estimators are evaluated exactly as written (no clamp of ``d_t``); a KL term needs
    ``ref_logprobs`` (an error otherwise).
  * Stats are means over the masked tokens of *this call* (the trainer aggregates across
    micro-batches); ``ratio_mean``/``clip_fraction`` use the ratio that entered the surrogate
    (``r_s`` broadcast to its tokens at sequence level); ``approx_kl`` is the mean of the
    cleaned, unclamped ``l - p``; ``*_fraction`` count the loss tokens each option truncated or
    masked;
    ``behav_weight_mean``/``behav_kl`` count a dropped token as weight 0 / log-ratio 0. The means
    are summed in float64, so a mean of finite per-token values is finite (an fp32 sum of a few
    values near 3e38 is not).
  * Masked-out tokens contribute exactly zero (``torch.where``, so NaN/inf there cannot leak).
  * A zero denominator is replaced by 1 (an empty micro-batch gives loss 0, not NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .loss_config import PPOLossConfig

# exp(20) = 4.9e8: far beyond any clip range, and exp stays finite in fp32.
LOG_RATIO_CLAMP = 20.0
# A behaviour weight exp(p - b) above exp(20) = 4.9e8 drops its token, as one that overflows does:
# a finite weight up to fp32's 3.4e38 (p - b = 88.7) times a clipped surrogate of a few units
# overflows, and no correction is meant at such a ratio (the trainer gives the sampled token 4.9e8
# times the probability the server reported: the behaviour record is broken, as with b = -inf).
# Below it, |w pg| <= e^20 e^20 |A| stays far inside fp32 and fp64 alike, so every dtype drops the
# same tokens. The lower side needs no bound (w -> 0 is harmless).
LOG_BEHAV_WEIGHT_MAX = LOG_RATIO_CLAMP

STAT_NAMES = (
    "n_tokens",
    "ratio_mean",
    "clip_fraction",
    "dual_clip_fraction",
    "approx_kl",
    "behav_kl",
    "behav_weight_mean",
    "tis_truncated_fraction",
    "token_mis_masked_fraction",
    "seq_mis_masked_fraction",
    "m2po_masked_fraction",
    "entropy_mean",
    "nonfinite_count",
)


def check_token_inputs(T: int, device, labels, behav_logprobs, adv, mask, prox, ref, cu_seqlens, cfg) -> None:
    """Shape checks with messages that name the bad input (no device syncs)."""
    for name, t in (("labels", labels), ("behav_logprobs", behav_logprobs), ("advantages", adv), ("loss_mask", mask),
                    ("prox_logprobs", prox), ("ref_logprobs", ref)):
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != T:
            raise ValueError(f"{name} must have shape [{T}] (one per token), got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the logits are on {device}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if cfg.kl_coef > 0 and ref is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if cfg.needs_segments:
        if cu_seqlens is None:
            raise ValueError(
                f"cu_seqlens is required for importance_level={cfg.importance_level!r}, loss_agg={cfg.loss_agg!r}"
            )
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"cu_seqlens must be an integer [S+1] tensor, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
            # Value checks only where they cost no device sync.
            if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T or bool((cu_seqlens.diff() < 0).any()):
                raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, "
                                 f"got {cu_seqlens.tolist()[:8]}...")


def segment_ids(cu_seqlens: Tensor, T: int, device) -> Tensor:
    """Sequence index of every token (static shape [T], so it traces under torch.compile)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    return torch.searchsorted(cu[1:], torch.arange(T, device=device), right=True)


def _segsum(x: Tensor, seg: Tensor, S: int) -> Tensor:
    return torch.zeros(S, dtype=x.dtype, device=x.device).index_add(0, seg, x)


def _surrogate(r: Tensor, A: Tensor, cfg: PPOLossConfig):
    """Clipped surrogate max(-A r, -A clamp(r)), with the optional dual clip."""
    rc = r.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.eps_high)
    s1, s2 = -A * r, -A * rc
    pg = torch.maximum(s1, s2)
    clipped = s2 > s1
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * A
        neg = A < 0
        dual = neg & (bound < pg)
        pg = torch.where(neg, torch.minimum(pg, bound), pg)
    return pg, clipped, dual


class TokenConstants(NamedTuple):
    """The constant per-token inputs, cleaned: zero on unmasked tokens, in the math dtype."""

    m: Tensor  # bool loss mask
    behav_logprobs: Tensor  # b, 0 where dropped
    A: Tensor
    p: Tensor  # proximal log-probs (b without prox), 0 where dropped
    q: Tensor | None
    w_raw: Tensor  # behaviour weight exp(p - b) before any option (1 without prox; 0 where dropped)
    w: Tensor  # after the options (0 where masked by an option or dropped)
    dropped: Tensor  # bool: loss token whose behaviour weight is not finite
    kept: Tensor  # bool: loss token that enters the sequence statistics (not dropped, not masked)
    tis_truncated: Tensor  # bool: kept token whose weight TIS truncated
    token_mis_masked: Tensor  # bool: masked by token MIS (IcePop band)
    m2po_masked: Tensor  # bool: masked by M2PO
    seq_mis_masked: Tensor  # bool: masked because its sequence left the sequence-MIS band

    def slice(self, a: int, b: int) -> TokenConstants:
        return TokenConstants(*(None if x is None else x[a:b] for x in self))


def _outside(x: Tensor, lo: float | None, hi: float | None) -> Tensor:
    """x < lo or x > hi (a bound of None is absent); the band itself is closed."""
    out = torch.zeros_like(x, dtype=torch.bool)
    if lo is not None:
        out = out | (x < lo)
    if hi is not None:
        out = out | (x > hi)
    return out


def m2po_select(sq: Tensor, valid: Tensor, tau: float) -> Tensor:
    """M2PO's batch-global selection: bool [T], True on the tokens to mask.

    Among the ``valid`` tokens, mask the k largest ``sq`` (squared log behaviour weights), k the
    smallest count such that the mean of the remaining ones is < ``tau`` (all of them when even the
    smallest alone is >= tau: an empty set, no policy gradient). Deterministic: a stable
    descending sort, so among equal values the earlier token is masked first. Static shapes (no
    host sync, no boolean indexing): O(T log T) time for the sort, O(T) memory; the sums are in
    float64 so a suffix mean over 10^6 tokens does not lose the small values.
    """
    T = sq.shape[0]
    key = torch.where(valid, sq.double(), torch.full_like(sq, -1.0, dtype=torch.float64))  # invalid last
    vals, order = torch.sort(key, descending=True, stable=True)
    vals = vals.clamp_min(0.0)
    n = valid.sum()
    idx = torch.arange(T, device=sq.device)
    # mean of the sorted values i..n-1 (what remains after masking the first i)
    suffix = vals.sum() - (vals.cumsum(0) - vals)
    mean = suffix / (n - idx).clamp_min(1).double()
    ok = (idx < n) & (mean < tau)
    k = torch.where(ok, idx, n.expand_as(idx)).min() if T > 0 else n
    out = torch.zeros(T, dtype=torch.bool, device=sq.device)
    return out.scatter(0, order, idx < k)


def token_constants(behav_logprobs, adv, mask, prox, ref, dt, dev, cfg: PPOLossConfig,
                    cu_seqlens: Tensor | None = None) -> TokenConstants:
    """Detached, cleaned constants. Values of unmasked tokens (prompt, padding) may hold anything
    (NaN advantages, -inf log-probs); they are zeroed, since a NaN there would leak through
    0 * NaN in the backward. A loss token whose behaviour weight is not finite is dropped
    (``docs/objective.md``, "Non-finite inputs"). Then the behaviour-weight options, in this
    order (``docs/objective.md``, "Train/inference mismatch and staleness corrections"): token
    MIS and M2PO mask tokens, sequence MIS masks whole sequences (geometric mean over the tokens
    still kept) and gives their kept tokens the sequence weight, TIS truncates what remains."""
    with torch.no_grad():
        m = mask.detach().to(dev) != 0
        zero = torch.zeros((), dtype=dt, device=dev)

        def const(x):
            return torch.where(m, x.detach().to(dt), zero)

        behav_logprobs = const(behav_logprobs)
        A = const(adv)
        p = behav_logprobs if prox is None else const(prox)
        q = None if ref is None else const(ref)
        w_raw = torch.ones_like(behav_logprobs) if prox is None else torch.exp(p - behav_logprobs)
        usable = torch.isfinite(w_raw) & (p - behav_logprobs <= LOG_BEHAV_WEIGHT_MAX)
        dropped = m & ~(torch.isfinite(behav_logprobs) & torch.isfinite(p) & usable)
        behav_logprobs = torch.where(dropped, zero, behav_logprobs)
        p = torch.where(dropped, zero, p) if prox is not None else behav_logprobs
        w_raw = torch.where(dropped, zero, w_raw)
        valid = m & ~dropped
        log_w = p - behav_logprobs  # 0 on dropped and unmasked tokens
        no = torch.zeros_like(m)
        token_mis = valid & _outside(w_raw, cfg.token_mis_lower, cfg.token_mis_upper)
        m2po = no if cfg.m2po_tau is None else valid & m2po_select(log_w * log_w, valid, cfg.m2po_tau)
        kept = valid & ~token_mis & ~m2po
        w = torch.where(kept, w_raw, zero)
        seq_mis = no
        if cfg.seq_mis:
            S = cu_seqlens.shape[0] - 1
            seg = segment_ids(cu_seqlens, m.shape[0], dev)
            n_kept = _segsum(kept.to(dt), seg, S)
            w_s = torch.exp(_segsum(torch.where(kept, log_w, zero), seg, S) / n_kept.clamp_min(1.0))
            seq_mis = kept & _outside(w_s, cfg.seq_mis_lower, cfg.seq_mis_upper)[seg]
            kept = kept & ~seq_mis
            w = torch.where(kept, w_s[seg], zero)
        tis = no
        if cfg.tis_cap is not None:
            tis = kept & (w > cfg.tis_cap)
            w = w.clamp(max=cfg.tis_cap)
    return TokenConstants(m, behav_logprobs, A, p, q, w_raw, w, dropped, kept, tis, token_mis, m2po, seq_mis)


def _log_ratio(logp: Tensor, C: TokenConstants):
    """(rho clamped, rho cleaned, finite): a dropped token's log-ratio counts as non-finite (0)."""
    rho_raw = logp - C.p
    finite = torch.isfinite(rho_raw) & ~C.dropped
    rho_clean = torch.where(finite, rho_raw, torch.zeros_like(rho_raw))
    return rho_clean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), rho_clean, finite


def per_token_loss(logp: Tensor, entropy: Tensor, C: TokenConstants, cfg: PPOLossConfig, pg=None):
    """L_t = w_t pg_t + kl_coef KL_t - entropy_coef H_t on masked tokens, 0 elsewhere.

    ``pg`` (the surrogate) is computed here at token level; at sequence level the caller passes
    it. Elementwise in every input, so it can be evaluated on any slice of tokens (the fused
    single-pass path evaluates it one chunk at a time). Returns (L, kl or None, aux) where aux is
    (r, clipped, dual, rho_clean, finite) at token level, else None.
    """
    aux = None
    if pg is None:
        rho, rho_clean, finite = _log_ratio(logp, C)
        r = torch.exp(rho)
        pg, clipped, dual = _surrogate(r, C.A, cfg)
        aux = (r, clipped, dual, rho_clean, finite)
    L = C.w * pg
    kl = None
    if cfg.kl_coef > 0:
        d = logp - C.q
        if cfg.kl_estimator == "k1":
            kl = d
        elif cfg.kl_estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = torch.exp(-d) + d - 1.0
        L = L + cfg.kl_coef * kl
    if cfg.entropy_coef != 0:
        L = L - cfg.entropy_coef * entropy
    return torch.where(C.m, L, torch.zeros_like(L)), kl, aux


def per_token_grads(logp: Tensor, entropy: Tensor, C: TokenConstants, cfg: PPOLossConfig):
    """(dL_t/dl_t, dL_t/dH_t) of :func:`per_token_loss` at token level, in closed form.

    Used by the fused single-pass path, whose custom op runs below autograd. It follows
    PyTorch's own derivative conventions so it equals autograd of ``per_token_loss`` exactly:
    clamp passes the gradient on its closed interval, maximum/minimum split it at ties, and
    ``where`` blocks it on the branch not taken (checked in tests/ops/test_ppo_loss_fused_linear.py).
    """
    dt = logp.dtype
    zero = torch.zeros((), dtype=dt, device=logp.device)
    rho_raw = logp - C.p
    finite = torch.isfinite(rho_raw) & ~C.dropped
    rho_clean = torch.where(finite, rho_raw, zero)
    drho = finite & (rho_clean >= -LOG_RATIO_CLAMP) & (rho_clean <= LOG_RATIO_CLAMP)
    r = torch.exp(rho_clean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    lo = 1.0 - cfg.eps_clip
    hi = 1.0 + cfg.eps_high
    rc = r.clamp(lo, hi)
    drc = ((r >= lo) & (r <= hi)).to(dt)
    A = C.A
    s1, s2 = -A * r, -A * rc
    d1, d2 = -A, -A * drc  # d s / d r
    dpg = torch.where(s1 > s2, d1, torch.where(s2 > s1, d2, 0.5 * (d1 + d2)))
    if cfg.dual_clip is not None:
        pg = torch.maximum(s1, s2)
        bound = -cfg.dual_clip * A
        dmin = torch.where(pg < bound, dpg, torch.where(pg > bound, zero, 0.5 * dpg))
        dpg = torch.where(A < 0, dmin, dpg)
    g = torch.where(drho, C.w * dpg * r, zero)  # where, not * 0: w may be NaN where p is
    if cfg.kl_coef > 0:
        d = logp - C.q
        if cfg.kl_estimator == "k1":
            dk = torch.ones_like(d)
        elif cfg.kl_estimator == "k2":
            dk = d
        else:
            dk = 1.0 - torch.exp(-d)
        g = g + cfg.kl_coef * dk
    e = torch.full_like(entropy, -cfg.entropy_coef)
    return torch.where(C.m, g, zero), torch.where(C.m, e, zero)


def aggregation_weights(mask: Tensor, cu_seqlens: Tensor | None, normalizer, cfg: PPOLossConfig, dt, dev) -> Tensor:
    """Constant c_t with loss = sum_t c_t L_t: m_t / D (token-mean) or m_t / (max(n_s, 1) S')."""
    with torch.no_grad():
        mf = (mask.detach().to(dev) != 0).to(dt)
        T = mf.shape[0]
        if cfg.loss_agg == "token-mean":
            D = mf.sum().clamp_min(1.0) if normalizer is None else normalizer
            return mf / D
        S = cu_seqlens.shape[0] - 1
        seg = segment_ids(cu_seqlens, T, dev)
        n_s = _segsum(mf, seg, S)
        Sp = (n_s > 0).to(dt).sum().clamp_min(1.0) if normalizer is None else normalizer
        return mf / (n_s.clamp_min(1.0)[seg] * Sp)


def ppo_objective(
    logp: Tensor,
    entropy: Tensor,
    behav_logprobs: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    prox: Tensor | None,
    ref: Tensor | None,
    cu_seqlens: Tensor | None,
    normalizer,
    cfg: PPOLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss (0-dim, differentiable in ``logp`` and ``entropy``) and detached stats.

    ``logp``/``entropy`` are [T] fp32 (or fp64 for gradchecks); the other per-token inputs are
    constants (detached here) and are computed in the dtype of ``logp``.
    """
    T = logp.shape[0]
    dt, dev = logp.dtype, logp.device
    C = token_constants(behav_logprobs, adv, mask, prox, ref, dt, dev, cfg, cu_seqlens)
    m = C.m
    zero = torch.zeros((), dtype=dt, device=dev)

    if cfg.importance_level == "token":
        L, kl, (r, clipped, dual, rho_clean, finite) = per_token_loss(logp, entropy, C, cfg)
    else:
        rho, rho_clean, finite = _log_ratio(logp, C)
        S = cu_seqlens.shape[0] - 1
        seg = segment_ids(cu_seqlens, T, dev)
        # means over the kept tokens only: a token masked by a behaviour-weight option or dropped
        # as non-finite would otherwise still pull the sequence's ratio and advantage
        kept = C.kept
        denom = _segsum(kept.to(dt), seg, S).clamp_min(1.0)
        rho_s = _segsum(torch.where(kept, rho, zero), seg, S) / denom
        A_s = _segsum(torch.where(kept, C.A, zero), seg, S) / denom
        r_s = torch.exp(rho_s)
        pg_s, clipped_s, dual_s = _surrogate(r_s, A_s, cfg)
        r, clipped, dual = r_s[seg], clipped_s[seg], dual_s[seg]
        L, kl, _ = per_token_loss(logp, entropy, C, cfg, pg=pg_s[seg])

    c = aggregation_weights(mask, cu_seqlens, normalizer, cfg, dt, dev)
    loss = (c * L).sum()

    with torch.no_grad():
        n = m.to(dt).sum()
        nd = m.sum().to(torch.float64).clamp_min(1.0)

        def mean(x):  # summed in float64: finite per-token values (< 3.4e38 each) give a finite mean
            return torch.where(m, x.to(torch.float64), 0.0).sum() / nd

        stats = {
            "n_tokens": n,
            "ratio_mean": mean(r),
            "clip_fraction": mean(clipped),
            "dual_clip_fraction": mean(dual),
            "approx_kl": mean(rho_clean),
            "behav_kl": mean(C.p - C.behav_logprobs),
            "behav_weight_mean": mean(C.w_raw),
            "tis_truncated_fraction": mean(C.tis_truncated),
            "token_mis_masked_fraction": mean(C.token_mis_masked),
            "seq_mis_masked_fraction": mean(C.seq_mis_masked),
            "m2po_masked_fraction": mean(C.m2po_masked),
            "entropy_mean": mean(entropy),
            "nonfinite_count": (m & ~finite).to(dt).sum(),
        }
        if kl is not None:
            stats["kl_mean"] = mean(kl)
        stats = {k: v.detach().float() for k, v in stats.items()}
    return loss, stats


def mismatch_stats(behav_logprobs: Tensor, prox: Tensor, logp: Tensor, mask: Tensor) -> dict[str, float]:
    """The train/inference mismatch dashboard of one step (``docs/objective.md``, "Dashboard").

    On the loss tokens where b, p and l are finite: KL(inference || train) estimated from samples
    of the inference policy, k1 = mean(b - p) and k3 = mean(w - 1 - log w) with w = exp(p - b)
    (unbiased, always >= 0), and the quantiles p50/p90/p99/max of w (``mismatch_ratio_*``) and of
    the current ratio exp(l - p) (``ratio_*``). Host floats; empty dict without loss tokens."""
    with torch.no_grad():
        b, p, cur = (x.detach().double().flatten() for x in (behav_logprobs, prox, logp))
        ok = (mask.detach().flatten() != 0) & torch.isfinite(b) & torch.isfinite(p) & torch.isfinite(cur)
        if not bool(ok.any()):
            return {}
        log_w, log_r = (p - b)[ok], (cur - p)[ok]
        out = {"mismatch_k1": float((-log_w).mean()), "mismatch_k3": float((torch.expm1(log_w) - log_w).mean())}
        for name, x in (("mismatch_ratio", log_w), ("ratio", log_r)):
            # quantiles of the log-ratio, exponentiated (exp is monotone; nearest-rank, no interpolation)
            srt = torch.sort(x).values
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = float(torch.exp(srt[min(len(srt) - 1, (q * len(srt)) // 100)]))
            out[f"{name}_max"] = float(torch.exp(srt[-1]))
    return out
