"""The options of the decoupled-PPO loss, as one value (no torch import: configs load without it).

:class:`PPOLossConfig` is what every loss entry point takes (``config=``), what the trainer's
``ppo.loss`` section holds, and what the custom ops receive (``custom_ops.op_args`` is the one
place that flattens it into op arguments). The formulas behind each option are in
``docs/objective.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from areal_fast.configutil import check_rules, option

IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
# The options that act on the behaviour weight w = exp(p - b) (all > 0 when set).
BEHAVIOUR_WEIGHT_OPTIONS = ("tis_cap", "token_mis_lower", "token_mis_upper", "seq_mis_lower", "seq_mis_upper",
                            "m2po_tau")


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOLossConfig:
    """Scalar options of the decoupled-PPO objective (``docs/objective.md``). Frozen and hashable,
    so it can be shared between calls and used as a cache key."""

    temperature: float = option(1.0, gt=0)
    """Sampling temperature tau > 0 of the rollouts: P = softmax(logits / tau). The trainer sets it
    from the rollout's sampling temperature; never set it independently of how the samples were drawn."""
    eps_clip: float = option(0.2, ge=0)
    """Lower clip range of the ratio, r clipped to [1 - eps_clip, 1 + eps_high]."""
    eps_clip_higher: float | None = option(None, ge=0)
    """Upper clip range eps_high (clip-higher, as in DAPO); None means ``eps_clip``."""
    dual_clip: float | None = option(None, gt=1)
    """Dual-clip bound c > 1: for negative advantages the surrogate is at most -c A. None disables it."""
    tis_cap: float | None = option(None, gt=0)
    """Token-level truncated importance sampling (TIS): the behaviour weight w_t = exp(p_t - b_t)
    becomes min(w_t, C) with C = ``tis_cap`` > 0. None disables it. In a synchronous step (eta = 0)
    p is the trainer's recompute of the behaviour weights, so w_t is exactly the train/inference
    mismatch ratio; with staleness it also carries the policy lag (``docs/objective.md``)."""
    token_mis_lower: float | None = option(None, gt=0)
    """Token-level masked importance sampling (MIS), lower bound: a loss token with
    w_t = exp(p_t - b_t) < ``token_mis_lower`` is masked (w_t = 0, it stays in the normaliser).
    With ``token_mis_upper`` this is IcePop's two-sided band [alpha, beta]. None: no lower bound."""
    token_mis_upper: float | None = option(None, gt=0)
    """Token-level MIS, upper bound: a loss token with w_t > ``token_mis_upper`` is masked (IcePop's
    beta). None: no upper bound."""
    seq_mis_lower: float | None = option(None, gt=0)
    """Sequence-level MIS, lower bound on the sequence weight w_s = exp(mean of p_t - b_t over the
    sequence's kept loss tokens), the geometric mean of its token weights. A sequence with
    w_s < ``seq_mis_lower`` is masked whole; a kept sequence's tokens get w_t = w_s. Needs
    ``cu_seqlens``. None: no lower bound."""
    seq_mis_upper: float | None = option(None, gt=0)
    """Sequence-level MIS, upper bound on w_s (see ``seq_mis_lower``). None: no upper bound."""
    m2po_tau: float | None = option(None, gt=0)
    """M2PO: mask the loss tokens with the largest (p_t - b_t)^2 until the mean of (p_t - b_t)^2
    over the remaining ones (the second moment of the log behaviour weight) is < tau. The selection
    spans every loss token of the call. None disables it."""
    importance_level: str = option("token", choices=IMPORTANCE_LEVELS)
    """Level of the PPO ratio r = exp(l - p) (current over proximal, not the behaviour weight):
    'token' (one ratio per token) or 'sequence' (GSPO: the mean log-ratio of the sequence's kept
    tokens gives one ratio per sequence; needs ``cu_seqlens``)."""
    kl_coef: float = option(0.0, ge=0)
    """Coefficient >= 0 of the KL term to the reference policy (> 0 needs ``ref_logprobs``)."""
    kl_estimator: str = option("k3", choices=KL_ESTIMATORS)
    """KL estimator of d = l - q: 'k1' (d), 'k2' (d^2 / 2) or 'k3' (exp(-d) + d - 1)."""
    entropy_coef: float = option(0.0, ge=0)
    """Coefficient >= 0 of the entropy bonus (L_t -= entropy_coef * H_t)."""
    loss_agg: str = option("token-mean", choices=LOSS_AGGS)
    """'token-mean' (sum over loss tokens / their global count) or 'seq-mean-token-mean' (mean over
    sequences of each sequence's token mean; needs ``cu_seqlens``)."""

    def __post_init__(self):
        check_rules(self)
        for lo, hi in (("token_mis_lower", "token_mis_upper"), ("seq_mis_lower", "seq_mis_upper")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{lo} ({a!r}) must be <= {hi} ({b!r})")

    @property
    def eps_high(self) -> float:
        """The upper clip range actually used."""
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher

    @property
    def seq_mis(self) -> bool:
        """Whether sequence-level MIS is on (either bound set)."""
        return self.seq_mis_lower is not None or self.seq_mis_upper is not None

    @property
    def needs_segments(self) -> bool:
        """Whether the loss needs ``cu_seqlens`` (sequence-level importance, MIS or aggregation)."""
        return self.importance_level == "sequence" or self.loss_agg == "seq-mean-token-mean" or self.seq_mis


LOSS_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PPOLossConfig))


def resolve_loss_config(config: PPOLossConfig | None, overrides: dict[str, Any]) -> PPOLossConfig:
    """``config`` (default: all defaults) with keyword ``overrides`` applied, validated.

    What lets someone who uses only the loss write ``decoupled_ppo_loss(..., eps_clip=0.3)``."""
    if config is not None and not isinstance(config, PPOLossConfig):
        raise TypeError(f"config must be a PPOLossConfig, got {type(config).__name__}")
    unknown = sorted(set(overrides) - set(LOSS_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown loss option(s) {unknown}; the options are {list(LOSS_OPTION_NAMES)}")
    if config is None:
        return PPOLossConfig(**overrides)
    return dataclasses.replace(config, **overrides) if overrides else config
