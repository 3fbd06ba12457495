"""The ``reward`` section of a run config (:class:`RewardConfig`). Torch-free; the loader
(``areal_fast.config``) resolves ``name`` against the registry when the config is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from areal_fast.configutil import check_rules, option

__all__ = ["RewardConfig"]


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The verifiable reward (``areal_fast.reward``)."""

    name: str = option("math", nonempty=True)
    """'math', 'code', or 'package.module:function' for a custom reward (resolved when the config
    is loaded)."""
    timeout: float = option(10.0, gt=0)
    """Seconds per call; a timeout scores 0 and is counted."""
    workers: int | None = option(None, ge=1)
    """Processes of the reward pool (None = from the CPU count)."""

    def __post_init__(self):
        check_rules(self)
