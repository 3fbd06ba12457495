"""Pure-Python references for the planner: first-fit-decreasing bin packing,
Karmarkar-Karp k-way partitioning, and a plan built from the two.

They are the baseline of bench/bench_planner.py and the oracle of the planner tests: the
C++ planner must meet the same constraints with at most one micro-batch more per rank
than the bound, and balance ranks at least as well as Karmarkar-Karp does. The plan reference is
also what ``plan_microbatches(backend="reference")`` runs, and the fallback without the native
core, so it checks its inputs like the C++ planner, with the same messages.
"""

from __future__ import annotations

import heapq

import numpy as np

from areal_fast.packing.plan import Plan, as_lengths, lower_bound_mbs, resolve_attn_coef


def first_fit_decreasing_ref(lengths, capacity: int) -> list[list[int]]:
    """Bins of indices; each bin's length sum <= capacity. O(n * bins)."""
    lengths = [int(x) for x in lengths]
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has length {n}, longer than the capacity {capacity}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def karmarkar_karp_ref(costs, k: int) -> list[list[int]]:
    """Largest differencing method for k-way number partitioning.

    Each item starts as a k-tuple of subsets (itself plus k-1 empty ones); repeatedly merge
    the two tuples with the largest spread, pairing the heaviest subset of one with the
    lightest of the other.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    heap = []
    for i, c in enumerate(costs):
        sums = [float(c)] + [0.0] * (k - 1)
        parts = [[i]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c), i, sums, parts))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, i1, s1, p1 = heapq.heappop(heap)
        _, i2, s2, p2 = heapq.heappop(heap)
        o1 = sorted(range(k), key=lambda j: s1[j], reverse=True)
        o2 = sorted(range(k), key=lambda j: s2[j])
        sums = [s1[a] + s2[b] for a, b in zip(o1, o2)]
        parts = [p1[a] + p2[b] for a, b in zip(o1, o2)]
        order = sorted(range(k), key=lambda j: sums[j], reverse=True)
        sums = [sums[j] for j in order]
        parts = [parts[j] for j in order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), min(i1, i2), sums, parts))
    return heap[0][3]


def check_plan_inputs(arr: np.ndarray, max_tokens_per_mb: int, n_ranks: int, min_mbs: int, mbs_divisor: int) -> None:
    """The C++ planner's input checks, with its messages (the reference is also the fallback)."""
    f = "plan_microbatches"
    if arr.size == 0:
        raise ValueError(f"{f}: `lengths` is empty; there is nothing to pack")
    if max_tokens_per_mb <= 0:
        raise ValueError(f"{f}: max_tokens_per_mb must be > 0, got {max_tokens_per_mb}")
    for name, value in (("n_ranks", n_ranks), ("min_mbs", min_mbs), ("mbs_divisor", mbs_divisor)):
        if value < 1:
            raise ValueError(f"{f}: {name} must be >= 1, got {value}")
    bad = np.nonzero(arr <= 0)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{f}: sequence {i} has length {int(arr[i])}; lengths must be > 0")
    over = np.nonzero(arr > max_tokens_per_mb)[0]
    if over.size:
        i = int(over[0])
        raise ValueError(f"{f}: sequence {i} has length {int(arr[i])}, "
                         f"longer than max_tokens_per_mb={max_tokens_per_mb}")
    m = lower_bound_mbs(arr, max_tokens_per_mb, n_ranks, min_mbs, mbs_divisor)
    if arr.size < n_ranks * m:
        raise ValueError(f"{f}: {arr.size} sequences cannot fill {n_ranks} ranks x {m} micro-batches (every "
                         "micro-batch needs at least one sequence); lower min_mbs, mbs_divisor or n_ranks")


def plan_microbatches_ref(
    lengths,
    max_tokens_per_mb: int,
    *,
    n_ranks: int = 1,
    min_mbs: int = 1,
    mbs_divisor: int = 1,
    cost: str = "tokens",
    attn_coef: float | None = None,
) -> Plan:
    """Karmarkar-Karp over ranks by cost, FFD within each rank, then the largest micro-batches
    split until every rank has the same valid count."""
    coef = resolve_attn_coef(cost, attn_coef)
    arr = as_lengths(lengths)
    check_plan_inputs(arr, max_tokens_per_mb, n_ranks, min_mbs, mbs_divisor)
    lens = arr.tolist()
    costs = [n + coef * n * n for n in lens]
    ranks = karmarkar_karp_ref(costs, n_ranks)
    per_rank = []
    for members in ranks:
        bins = first_fit_decreasing_ref([lens[i] for i in members], max_tokens_per_mb)
        per_rank.append([[members[i] for i in b] for b in bins])
    m = max(max(len(b) for b in per_rank), min_mbs)
    m = -(-m // mbs_divisor) * mbs_divisor
    for bins in per_rank:
        while len(bins) < m:
            bins.sort(key=lambda b: (len(b) < 2, -sum(lens[i] for i in b)))
            if len(bins[0]) < 2:
                raise ValueError("plan_microbatches: too few sequences to fill every micro-batch")
            big = sorted(bins.pop(0), key=lambda i: -lens[i])
            bins += [big[0::2], big[1::2]]
    order, offsets, tokens = [], [0], []
    for bins in per_rank:
        for b in bins:
            order += sorted(b)
            offsets.append(len(order))
            tokens.append(sum(lens[i] for i in b))
    return Plan(
        n_ranks=n_ranks,
        mbs_per_rank=m,
        lower_bound=lower_bound_mbs(arr, max_tokens_per_mb, n_ranks, min_mbs, mbs_divisor),
        order=np.asarray(order, dtype=np.int64),
        mb_offsets=np.asarray(offsets, dtype=np.int64),
        mb_tokens=np.asarray(tokens, dtype=np.int64),
        rank_cost=np.asarray([sum(costs[i] for b in bins for i in b) for bins in per_rank]),
    )
