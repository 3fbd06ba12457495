"""The micro-batch plan record and the rules every planner shares: the cost coefficient, the
lengths' type, and the smallest valid micro-batch count.

Both planners (the C++ one behind :func:`areal_fast.packing.planner.plan_microbatches` and the pure
Python :func:`areal_fast.packing.planner_ref.plan_microbatches_ref`) build a :class:`Plan` under these
rules. They live here, below both: the planner imports its reference (the fallback without the
native core) and the reference imports only this module, so the two never import each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_HIDDEN_SIZE = 4096
DEFAULT_ATTN_COEF = 1.0 / (12 * DEFAULT_HIDDEN_SIZE)


@dataclass(frozen=True)
class Plan:
    """Where every sequence goes: ``microbatches[rank][mb]`` is a list of sequence indices.

    The flat arrays are what the planner produces; the nested lists are built on demand.
    """

    n_ranks: int
    mbs_per_rank: int
    lower_bound: int
    order: np.ndarray  # int64 [n]: sequence indices, rank-major then micro-batch-major
    mb_offsets: np.ndarray  # int64 [n_ranks * mbs_per_rank + 1]
    mb_tokens: np.ndarray  # int64 [n_ranks * mbs_per_rank]
    rank_cost: np.ndarray  # float64 [n_ranks]
    _nested: list = field(default=None, repr=False, compare=False)

    @property
    def microbatches(self) -> list[list[list[int]]]:
        if self._nested is None:
            order = self.order.tolist()
            off = self.mb_offsets.tolist()
            m = self.mbs_per_rank
            nested = [
                [order[off[r * m + b] : off[r * m + b + 1]] for b in range(m)] for r in range(self.n_ranks)
            ]
            object.__setattr__(self, "_nested", nested)
        return self._nested

    def rank_slice(self, rank: int) -> np.ndarray:
        """Sequence indices of ``rank`` in micro-batch order."""
        m = self.mbs_per_rank
        return self.order[self.mb_offsets[rank * m] : self.mb_offsets[(rank + 1) * m]]

    @property
    def imbalance(self) -> float:
        """max rank cost / mean rank cost (1.0 is perfect)."""
        mean = float(self.rank_cost.mean())
        return float(self.rank_cost.max()) / mean if mean > 0 else 1.0


def resolve_attn_coef(cost: str, attn_coef: float | None) -> float:
    if cost == "tokens":
        if attn_coef not in (None, 0, 0.0):
            raise ValueError("attn_coef is only used with cost='attention'")
        return 0.0
    if cost == "attention":
        coef = DEFAULT_ATTN_COEF if attn_coef is None else float(attn_coef)
        if not np.isfinite(coef) or coef < 0:
            raise ValueError(f"attn_coef must be a finite number >= 0, got {attn_coef!r}")
        return coef
    raise ValueError(f"cost must be 'tokens' or 'attention', got {cost!r}")


def as_lengths(lengths) -> np.ndarray:
    """Lengths as a contiguous int64 array (accepts lists, numpy arrays and torch tensors)."""
    if hasattr(lengths, "detach"):  # torch.Tensor without importing torch
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError("lengths must be integers")
    return np.ascontiguousarray(arr, dtype=np.int64)


def lower_bound_mbs(lengths, max_tokens_per_mb: int, n_ranks: int = 1, min_mbs: int = 1, mbs_divisor: int = 1) -> int:
    """Smallest valid micro-batch count per rank any plan can have.

    ``max(ceil(tokens / (ranks * budget)), ceil(#(len > budget/2) / ranks), min_mbs)``
    rounded up to ``mbs_divisor`` (two sequences longer than half the budget never share).
    """
    arr = as_lengths(lengths)
    total = int(arr.sum())
    n_big = int((2 * arr > max_tokens_per_mb).sum())
    lb = max(-(-total // (n_ranks * max_tokens_per_mb)), -(-n_big // n_ranks), min_mbs)
    return -(-lb // mbs_divisor) * mbs_divisor
