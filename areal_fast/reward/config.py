"""The ``reward`` section of a run config (:class:`RewardConfig`). Torch-free; the loader
(``areal_fast.config``) resolves ``name`` against the registry when the config is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from areal_fast.configutil import positive_seconds

__all__ = ["RewardConfig"]


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The verifiable reward (``areal_fast.reward``)."""

    name: str = "math"
    """'math', 'code', or 'package.module:function' for a custom reward (resolved when the config
    is loaded)."""
    timeout: float = 10.0
    """Seconds per call; a timeout scores 0 and is counted."""
    workers: int | None = None
    """Processes of the reward pool (None = from the CPU count)."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: must not be empty")
        positive_seconds("timeout", self.timeout)
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers: must be >= 1 or null, got {self.workers!r}")
