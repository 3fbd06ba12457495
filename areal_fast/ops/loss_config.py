"""The options of the decoupled-PPO loss, as one value (no torch import: configs load without it).

:class:`PPOLossConfig` is what every loss entry point takes (``config=``), what the trainer's
``ppo.loss`` section holds, and what the custom ops receive (``custom_ops.op_args`` is the one
place that flattens it into op arguments). The formulas behind each option are in
``docs/objective.md``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
# The options that act on the behaviour weight w = exp(p - b) (all > 0 when set).
BEHAVIOUR_WEIGHT_OPTIONS = ("tis_cap", "token_mis_lower", "token_mis_upper", "seq_mis_lower", "seq_mis_upper",
                            "m2po_tau")


def check_finite(name: str, value: Any) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOLossConfig:
    """Scalar options of the decoupled-PPO objective (``docs/objective.md``). Frozen and hashable,
    so it can be shared between calls and used as a cache key."""

    temperature: float = 1.0
    """Sampling temperature tau > 0 of the rollouts: P = softmax(logits / tau). The trainer sets it
    from the rollout's sampling temperature; never set it independently of how the samples were drawn."""
    eps_clip: float = 0.2
    """Lower clip range of the ratio, r clipped to [1 - eps_clip, 1 + eps_high]."""
    eps_clip_higher: float | None = None
    """Upper clip range eps_high (clip-higher, as in DAPO); None means ``eps_clip``."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1: for negative advantages the surrogate is at most -c A. None disables it."""
    tis_cap: float | None = None
    """Token-level truncated importance sampling (TIS): the behaviour weight w_t = exp(p_t - b_t)
    becomes min(w_t, C) with C = ``tis_cap`` > 0. None disables it. In a synchronous step (eta = 0)
    p is the trainer's recompute of the behaviour weights, so w_t is exactly the train/inference
    mismatch ratio; with staleness it also carries the policy lag (``docs/objective.md``)."""
    token_mis_lower: float | None = None
    """Token-level masked importance sampling (MIS), lower bound: a loss token with
    w_t = exp(p_t - b_t) < ``token_mis_lower`` is masked (w_t = 0, it stays in the normaliser).
    With ``token_mis_upper`` this is IcePop's two-sided band [alpha, beta]. None: no lower bound."""
    token_mis_upper: float | None = None
    """Token-level MIS, upper bound: a loss token with w_t > ``token_mis_upper`` is masked (IcePop's
    beta). Replaces ``behav_weight_cap`` with ``behav_weight_mode='mask'``. None: no upper bound."""
    seq_mis_lower: float | None = None
    """Sequence-level MIS, lower bound on the sequence weight w_s = exp(mean of p_t - b_t over the
    sequence's kept loss tokens), the geometric mean of its token weights. A sequence with
    w_s < ``seq_mis_lower`` is masked whole; a kept sequence's tokens get w_t = w_s. Needs
    ``cu_seqlens``. None: no lower bound."""
    seq_mis_upper: float | None = None
    """Sequence-level MIS, upper bound on w_s (see ``seq_mis_lower``). None: no upper bound."""
    m2po_tau: float | None = None
    """M2PO: mask the loss tokens with the largest (p_t - b_t)^2 until the mean of (p_t - b_t)^2
    over the remaining ones (the second moment of the log behaviour weight) is < tau. The selection
    spans every loss token of the call. None disables it."""
    importance_level: str = "token"
    """Level of the PPO ratio r = exp(l - p) (current over proximal, not the behaviour weight):
    'token' (one ratio per token) or 'sequence' (GSPO: the mean log-ratio of the sequence's kept
    tokens gives one ratio per sequence; needs ``cu_seqlens``)."""
    kl_coef: float = 0.0
    """Coefficient >= 0 of the KL term to the reference policy (> 0 needs ``ref_logprobs``)."""
    kl_estimator: str = "k3"
    """KL estimator of d = l - q: 'k1' (d), 'k2' (d^2 / 2) or 'k3' (exp(-d) + d - 1)."""
    entropy_coef: float = 0.0
    """Coefficient >= 0 of the entropy bonus (L_t -= entropy_coef * H_t)."""
    loss_agg: str = "token-mean"
    """'token-mean' (sum over loss tokens / their global count) or 'seq-mean-token-mean' (mean over
    sequences of each sequence's token mean; needs ``cu_seqlens``)."""

    def __post_init__(self):
        for name in ("temperature", "eps_clip", "kl_coef", "entropy_coef"):
            check_finite(name, getattr(self, name))
        for name in ("eps_clip_higher", "dual_clip") + BEHAVIOUR_WEIGHT_OPTIONS:
            if getattr(self, name) is not None:
                check_finite(name, getattr(self, name))
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not self.eps_clip >= 0:
            raise ValueError(f"eps_clip must be >= 0, got {self.eps_clip!r}")
        if self.eps_clip_higher is not None and not self.eps_clip_higher >= 0:
            raise ValueError(f"eps_clip_higher must be >= 0, got {self.eps_clip_higher!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip!r}")
        for name in BEHAVIOUR_WEIGHT_OPTIONS:
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for lo, hi in (("token_mis_lower", "token_mis_upper"), ("seq_mis_lower", "seq_mis_upper")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{lo} ({a!r}) must be <= {hi} ({b!r})")
        for name, allowed in (("importance_level", IMPORTANCE_LEVELS),
                              ("kl_estimator", KL_ESTIMATORS), ("loss_agg", LOSS_AGGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef!r}")

    @staticmethod
    def migrate_options(options: dict[str, Any], where: str = "") -> dict[str, Any]:
        """A mapping of options with the deprecated aliases replaced (:func:`migrate_deprecated_options`)."""
        return migrate_deprecated_options(options, where)

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

# The old spelling of the behaviour-weight cap: behav_weight_cap U with behav_weight_mode 'mask'
# (the default) is token MIS with upper bound U; with 'clamp' it is token TIS at U. Kept as aliases
# so existing run configs load; each use warns (FutureWarning: shown to users by default) with the new
# spelling. Run-config loaders call ``PPOLossConfig.migrate_options`` on the section's mapping.
DEPRECATED_OPTIONS = ("behav_weight_cap", "behav_weight_mode")
_OLD_MODES = {"mask": "token_mis_upper", "clamp": "tis_cap"}


def migrate_deprecated_options(options: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``options`` with the deprecated ``behav_weight_cap``/``behav_weight_mode`` replaced by
    ``token_mis_upper`` (mode 'mask') or ``tis_cap`` (mode 'clamp'); a warning names the
    replacement (a FutureWarning). Raises a ValueError for an unknown mode or when the new key is also given."""
    if not any(k in options for k in DEPRECATED_OPTIONS):
        return options
    out = dict(options)
    cap, mode = out.pop("behav_weight_cap", None), out.pop("behav_weight_mode", "mask")
    if mode not in _OLD_MODES:
        raise ValueError(f"{where}behav_weight_mode must be one of {tuple(_OLD_MODES)}, got {mode!r} "
                         "(deprecated: use tis_cap or token_mis_upper)")
    if cap is None:
        return out
    new = _OLD_MODES[mode]
    if out.get(new) is not None:
        raise ValueError(f"{where}behav_weight_cap (deprecated) and {new} are both set; keep only {new}")
    warnings.warn(f"{where}behav_weight_cap={cap!r} with behav_weight_mode={mode!r} is deprecated: "
                  f"write {new}: {cap!r} (docs/objective.md)", FutureWarning, stacklevel=3)
    out[new] = cap
    return out


def resolve_loss_config(config: PPOLossConfig | None, overrides: dict[str, Any]) -> PPOLossConfig:
    """``config`` (default: all defaults) with keyword ``overrides`` applied, validated.

    What lets someone who uses only the loss write ``decoupled_ppo_loss(..., eps_clip=0.3)``."""
    if config is not None and not isinstance(config, PPOLossConfig):
        raise TypeError(f"config must be a PPOLossConfig, got {type(config).__name__}")
    overrides = migrate_deprecated_options(overrides)
    unknown = sorted(set(overrides) - set(LOSS_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown loss option(s) {unknown}; the options are {list(LOSS_OPTION_NAMES)}")
    if config is None:
        return PPOLossConfig(**overrides)
    return dataclasses.replace(config, **overrides) if overrides else config
