"""Micro-batch planner for dynamic sequence packing (the C++ core in csrc/packing/).

Cost model. ``cost="tokens"`` balances token counts. ``cost="attention"`` balances
``len + attn_coef * len**2``: per layer a token costs about ``24 d^2`` FLOPs in the dense
parts (QKV/O projections and a 4x MLP, forward) and causal attention about ``2 d len``
for a sequence of length ``len``, so the time of a sequence is proportional to
``len + len**2 / (12 d)``. The default ``attn_coef`` is ``1 / (12 * 4096)`` (d = 4096, a
7B-class model); pass ``1 / (12 * hidden_size)`` for your model, or fit it from measured
step times. It only changes the balance across ranks, never the budget check, which is
always in tokens.

Backends (:func:`areal_fast.dispatch.select`, op ``packing.plan``): ``native`` (the C++ planner,
about 10 ms for 64k sequences) and ``reference`` (:func:`plan_microbatches_ref`, pure Python,
the same guarantees but a different and slower algorithm, so plans may differ). Without the
native core the reference runs, with a warning that says why.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from areal_fast.dispatch import native, select
from areal_fast.packing.plan import (  # noqa: F401 - re-exported: the planner's public names
    DEFAULT_ATTN_COEF,
    DEFAULT_HIDDEN_SIZE,
    Plan,
    as_lengths,
    lower_bound_mbs,
    resolve_attn_coef,
)
from areal_fast.packing.planner_ref import plan_microbatches_ref  # the fallback without the native core


def plan_microbatches(
    lengths: Sequence[int] | np.ndarray,
    max_tokens_per_mb: int,
    *,
    n_ranks: int = 1,
    min_mbs: int = 1,
    mbs_divisor: int = 1,
    cost: str = "tokens",
    attn_coef: float | None = None,
    backend: str | None = None,
) -> Plan:
    """Assign sequences to (rank, micro-batch) under a token budget.

    Guarantees: every index appears exactly once; every micro-batch has at least one
    sequence and at most ``max_tokens_per_mb`` tokens; every rank has the same number of
    micro-batches, a multiple of ``mbs_divisor`` and at least ``min_mbs``. Ranks are
    balanced by ``cost`` (see the module docstring). Raises ValueError naming the offending
    sequence when one is longer than the budget. ``backend``: 'native', 'reference' or None (choose).
    """
    coef = resolve_attn_coef(cost, attn_coef)
    if select("packing.plan", None, backend=backend) == "reference":
        return plan_microbatches_ref(lengths, max_tokens_per_mb, n_ranks=n_ranks, min_mbs=min_mbs,
                                     mbs_divisor=mbs_divisor, cost=cost, attn_coef=attn_coef)
    arr = as_lengths(lengths)
    raw = native().plan_microbatches(arr, int(max_tokens_per_mb), int(n_ranks), int(min_mbs), int(mbs_divisor), coef)
    return Plan(**raw)
