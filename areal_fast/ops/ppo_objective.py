"""The per-token decoupled-PPO objective on [T] vectors, shared by every backend.

Every backend (reference, Triton, fused-linear) first produces two differentiable [T] vectors,
the label log-probability ``l_t`` and the entropy ``H_t``; this module turns them into the loss
and the stats of ``shared/spec/decoupled_ppo.md``. It is plain PyTorch on [T]-sized tensors
(a few hundred kilobytes at T = 32768), so autograd gives ``g_t = dloss/dl_t`` and
``e_t = dloss/dH_t`` for free and the [T, V] kernels only need those two numbers per row.

Choices the spec leaves open (written down here as the spec asks):
  * ``rho_t = l_t - p_t``: non-finite values become 0 (counted in ``nonfinite_count`` over masked
    tokens), then it is clamped to [-20, 20] (zero gradient outside).
  * Sequence level: ``rho_s`` is the masked mean of that cleaned, clamped ``rho_t``.
  * The KL estimators are evaluated exactly as written (no clamp of ``d_t``); a KL term needs
    ``ref_logprobs`` (an error otherwise).
  * Stats are means over the masked tokens of *this call* (the trainer aggregates across
    micro-batches); ``ratio_mean``/``clip_fraction`` use the ratio that entered the surrogate
    (``r_s`` broadcast to its tokens at sequence level); ``approx_kl`` is the mean of the
    cleaned, unclamped ``l - p``; ``behav_capped_fraction`` counts tokens with ``w_t > U``.
  * Masked-out tokens contribute exactly zero (``torch.where``, so NaN/inf there cannot leak).
  * A zero denominator is replaced by 1 (an empty micro-batch gives loss 0, not NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# exp(20) = 4.9e8: far beyond any clip range, and exp stays finite in fp32 (spec).
LOG_RATIO_CLAMP = 20.0

STAT_NAMES = (
    "n_tokens",
    "ratio_mean",
    "clip_fraction",
    "dual_clip_fraction",
    "approx_kl",
    "behav_kl",
    "behav_weight_mean",
    "behav_capped_fraction",
    "entropy_mean",
    "nonfinite_count",
)

_MODES = ("mask", "clamp")
_LEVELS = ("token", "sequence")
_ESTIMATORS = ("k1", "k2", "k3")
_AGGS = ("token-mean", "seq-mean-token-mean")


@dataclass(frozen=True, kw_only=True)
class PPOLossConfig:
    """Scalar options of the objective (see the spec for their meaning)."""

    temperature: float = 1.0
    """Sampling temperature tau > 0; P = softmax(z / tau)."""
    eps_clip: float = 0.2
    """Lower (and, without ``eps_clip_higher``, upper) clip range of the ratio."""
    eps_clip_higher: float | None = None
    """Upper clip range (clip-higher / DAPO); None means ``eps_clip``."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages; None disables it."""
    behav_weight_cap: float | None = None
    """Cap U on the behaviour weight exp(p - b); None disables it."""
    behav_weight_mode: str = "mask"
    """'mask' (w = 0 above the cap) or 'clamp' (w = min(w, U))."""
    importance_level: str = "token"
    """'token' or 'sequence' (GSPO-style; needs cu_seqlens)."""
    kl_coef: float = 0.0
    """Coefficient of the KL term to the reference policy (needs ref_logprobs when > 0)."""
    kl_estimator: str = "k3"
    """'k1', 'k2' or 'k3'."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (L_t -= entropy_coef * H_t)."""
    loss_agg: str = "token-mean"
    """'token-mean' or 'seq-mean-token-mean' (needs cu_seqlens)."""

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not self.eps_clip >= 0:
            raise ValueError(f"eps_clip must be >= 0, got {self.eps_clip}")
        if self.eps_clip_higher is not None and not self.eps_clip_higher >= 0:
            raise ValueError(f"eps_clip_higher must be >= 0, got {self.eps_clip_higher}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.behav_weight_cap is not None and not self.behav_weight_cap > 0:
            raise ValueError(f"behav_weight_cap must be > 0, got {self.behav_weight_cap}")
        for name, value, allowed in (
            ("behav_weight_mode", self.behav_weight_mode, _MODES),
            ("importance_level", self.importance_level, _LEVELS),
            ("kl_estimator", self.kl_estimator, _ESTIMATORS),
            ("loss_agg", self.loss_agg, _AGGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")

    @property
    def needs_segments(self) -> bool:
        return self.importance_level == "sequence" or self.loss_agg == "seq-mean-token-mean"


def check_token_inputs(T: int, device, labels, behav, adv, mask, prox, ref, cu_seqlens, cfg) -> None:
    """Shape checks with messages that name the bad input (no device syncs)."""
    for name, t in (("labels", labels), ("behav_logprobs", behav), ("advantages", adv), ("loss_mask", mask),
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
    eps_high = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    rc = r.clamp(1.0 - cfg.eps_clip, 1.0 + eps_high)
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


def ppo_objective(
    logp: Tensor,
    entropy: Tensor,
    behav: Tensor,
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
    m = mask.detach().to(dev) != 0
    mf = m.to(dt)
    b = behav.detach().to(dt)
    A = adv.detach().to(dt)
    p = b if prox is None else prox.detach().to(dt)

    rho_raw = logp - p
    finite = torch.isfinite(rho_raw)
    rho_clean = torch.where(finite, rho_raw, torch.zeros_like(rho_raw))
    rho = rho_clean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    seg = S = n_s = None
    if cfg.needs_segments:
        S = cu_seqlens.shape[0] - 1
        seg = segment_ids(cu_seqlens, T, dev)
        n_s = _segsum(mf, seg, S)

    if cfg.importance_level == "token":
        r = torch.exp(rho)
        pg, clipped, dual = _surrogate(r, A, cfg)
    else:
        denom = n_s.clamp_min(1.0)
        zero = torch.zeros_like(rho)
        rho_s = _segsum(torch.where(m, rho, zero), seg, S) / denom
        A_s = _segsum(torch.where(m, A, zero), seg, S) / denom
        r_s = torch.exp(rho_s)
        pg_s, clipped_s, dual_s = _surrogate(r_s, A_s, cfg)
        r, pg, clipped, dual = r_s[seg], pg_s[seg], clipped_s[seg], dual_s[seg]

    with torch.no_grad():
        if prox is None:
            w_raw = torch.ones_like(b)
        else:
            w_raw = torch.exp(p - b)
        w = w_raw
        capped = torch.zeros_like(m)
        if cfg.behav_weight_cap is not None:
            capped = w_raw > cfg.behav_weight_cap
            if cfg.behav_weight_mode == "mask":
                w = torch.where(capped, torch.zeros_like(w_raw), w_raw)
            else:
                w = w_raw.clamp(max=cfg.behav_weight_cap)

    L = w * pg
    kl = None
    if cfg.kl_coef > 0:
        d = logp - ref.detach().to(dt)
        if cfg.kl_estimator == "k1":
            kl = d
        elif cfg.kl_estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = torch.exp(-d) + d - 1.0
        L = L + cfg.kl_coef * kl
    if cfg.entropy_coef != 0:
        L = L - cfg.entropy_coef * entropy
    L = torch.where(m, L, torch.zeros_like(L))

    if cfg.loss_agg == "token-mean":
        D = mf.sum().clamp_min(1.0) if normalizer is None else normalizer
        loss = L.sum() / D
    else:
        per_seq = _segsum(L, seg, S) / n_s.clamp_min(1.0)
        Sp = (n_s > 0).to(dt).sum().clamp_min(1.0) if normalizer is None else normalizer
        loss = per_seq.sum() / Sp

    with torch.no_grad():
        n = mf.sum()
        nd = n.clamp_min(1.0)

        def mean(x):
            return torch.where(m, x.to(dt), torch.zeros((), dtype=dt, device=dev)).sum() / nd

        stats = {
            "n_tokens": n,
            "ratio_mean": mean(r),
            "clip_fraction": mean(clipped),
            "dual_clip_fraction": mean(dual),
            "approx_kl": mean(rho_clean),
            "behav_kl": mean(p - b),
            "behav_weight_mean": mean(w_raw),
            "behav_capped_fraction": mean(capped),
            "entropy_mean": mean(entropy),
            "nonfinite_count": (m & ~finite).to(dt).sum(),
        }
        if kl is not None:
            stats["kl_mean"] = mean(kl)
        stats = {k: v.detach().float() for k, v in stats.items()}
    return loss, stats
