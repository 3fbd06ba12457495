"""The options of the decoupled-PPO loss, as one value (no torch import: configs load without it).

:class:`PPOLossConfig` is what every loss entry point takes (``config=``), what the trainer's
``ppo.loss`` section holds, and what the custom ops receive (``custom_ops.op_args`` is the one
place that flattens it into op arguments). The formulas behind each option are in
``docs/objective.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

BEHAV_WEIGHT_MODES = ("mask", "clamp")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


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
    behav_weight_cap: float | None = None
    """Cap U > 0 on the behaviour weight w = exp(p - b); None disables it."""
    behav_weight_mode: str = "mask"
    """What the cap does: 'mask' (w = 0 above U; the token stays in the normaliser and leaves the
    sequence statistics of sequence-level importance) or 'clamp' (w = min(w, U))."""
    importance_level: str = "token"
    """'token' (one ratio per token) or 'sequence' (GSPO-style: the mean log-ratio of the sequence's
    kept tokens gives one ratio per sequence; needs ``cu_seqlens``)."""
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
        for name in ("eps_clip_higher", "dual_clip", "behav_weight_cap"):
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
        if self.behav_weight_cap is not None and not self.behav_weight_cap > 0:
            raise ValueError(f"behav_weight_cap must be > 0, got {self.behav_weight_cap!r}")
        for name, allowed in (("behav_weight_mode", BEHAV_WEIGHT_MODES), ("importance_level", IMPORTANCE_LEVELS),
                              ("kl_estimator", KL_ESTIMATORS), ("loss_agg", LOSS_AGGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef!r}")

    @property
    def eps_high(self) -> float:
        """The upper clip range actually used."""
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher

    @property
    def needs_segments(self) -> bool:
        """Whether the loss needs ``cu_seqlens`` (sequence-level importance or aggregation)."""
        return self.importance_level == "sequence" or self.loss_agg == "seq-mean-token-mean"


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
