"""The C++ micro-batch planner: constraints (property tests), quality, errors, and agreement
with the pure-Python references that sit in the package."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fast.packing import (
    first_fit_decreasing_ref,
    karmarkar_karp_ref,
    lower_bound_mbs,
    plan_microbatches,
    plan_microbatches_ref,
)

# Quality targets of the planner (docs/architecture.md): micro-batches per rank <= the next valid count after the
# lower bound, and max/mean rank cost <= 1.02 with >= 64 sequences per rank.
MAX_IMBALANCE = 1.02


def check_plan(plan, lengths, budget, n_ranks, min_mbs, mbs_divisor):
    lengths = np.asarray(lengths)
    mbs = plan.microbatches
    assert len(mbs) == n_ranks
    counts = {len(r) for r in mbs}
    assert counts == {plan.mbs_per_rank}, "every rank must have the same number of micro-batches"
    assert plan.mbs_per_rank % mbs_divisor == 0
    assert plan.mbs_per_rank >= min_mbs
    seen = sorted(i for r in mbs for mb in r for i in mb)
    assert seen == list(range(len(lengths))), "every sequence exactly once"
    for r in mbs:
        for mb in r:
            assert mb, "no empty micro-batch"
            assert int(lengths[mb].sum()) <= budget
    # The flat arrays agree with the nested view.
    sums = [int(lengths[mb].sum()) for r in mbs for mb in r]
    assert sums == plan.mb_tokens.tolist()


@st.composite
def planner_inputs(draw):
    budget = draw(st.integers(1, 5000))
    n_ranks = draw(st.integers(1, 6))
    min_mbs = draw(st.integers(1, 3))
    mbs_divisor = draw(st.integers(1, 3))
    lb_seqs = n_ranks * -(-min_mbs // mbs_divisor) * mbs_divisor
    n = draw(st.integers(lb_seqs, lb_seqs + 150))
    lengths = draw(st.lists(st.integers(1, budget), min_size=n, max_size=n))
    cost = draw(st.sampled_from(["tokens", "attention"]))
    return lengths, budget, n_ranks, min_mbs, mbs_divisor, cost


@settings(max_examples=300, deadline=None)
@given(planner_inputs())
def test_plan_constraints_hold(args):
    lengths, budget, n_ranks, min_mbs, mbs_divisor, cost = args
    try:
        plan = plan_microbatches(
            lengths, budget, n_ranks=n_ranks, min_mbs=min_mbs, mbs_divisor=mbs_divisor, cost=cost, attn_coef=1e-3
            if cost == "attention" else None,
        )
    except ValueError as e:
        # Only legitimate refusal: too few sequences to give every micro-batch one.
        assert "micro-batch" in str(e)
        return
    check_plan(plan, lengths, budget, n_ranks, min_mbs, mbs_divisor)
    lb = lower_bound_mbs(lengths, budget, n_ranks, min_mbs, mbs_divisor)
    assert plan.lower_bound == lb
    assert plan.mbs_per_rank >= lb


def lognormal_lengths(n, seed, max_len=32768, mu=7.0, sigma=1.2):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mu, sigma, n).astype(np.int64), 1, max_len)


@pytest.mark.parametrize("n_ranks", [1, 2, 8, 16])
@pytest.mark.parametrize("cost", ["tokens", "attention"])
@pytest.mark.parametrize("budget", [32768, 65536])
def test_quality_on_realistic_batches(n_ranks, cost, budget):
    lengths = lognormal_lengths(128 * n_ranks, seed=n_ranks)
    plan = plan_microbatches(lengths, budget, n_ranks=n_ranks, cost=cost)
    check_plan(plan, lengths, budget, n_ranks, 1, 1)
    assert plan.mbs_per_rank <= plan.lower_bound + 1
    assert plan.imbalance <= MAX_IMBALANCE, plan.rank_cost


def test_balance_at_least_as_good_as_karmarkar_karp_plan():
    lengths = lognormal_lengths(64 * 8, seed=3)
    fast = plan_microbatches(lengths, 65536, n_ranks=8)
    ref = plan_microbatches_ref(lengths, 65536, n_ranks=8)
    check_plan(ref, lengths, 65536, 8, 1, 1)
    assert fast.mbs_per_rank <= ref.mbs_per_rank
    assert fast.imbalance <= max(ref.imbalance, 1.0 + 1e-3)


def test_divisor_and_min_mbs():
    lengths = lognormal_lengths(300, seed=5)
    plan = plan_microbatches(lengths, 65536, n_ranks=3, min_mbs=5, mbs_divisor=4)
    check_plan(plan, lengths, 65536, 3, 5, 4)
    assert plan.mbs_per_rank == 8


def test_attention_cost_uses_square():
    # One long sequence and many short ones: balancing tokens would put the long one with few
    # short ones; under attention cost its rank must get far fewer tokens.
    lengths = [8000] + [100] * 160
    tok = plan_microbatches(lengths, 8192, n_ranks=2, cost="tokens")
    att = plan_microbatches(lengths, 8192, n_ranks=2, cost="attention", attn_coef=1e-3)
    rank_of_long_tok = next(r for r in range(2) if 0 in tok.rank_slice(r))
    rank_of_long_att = next(r for r in range(2) if 0 in att.rank_slice(r))
    tokens_tok = sum(lengths[i] for i in tok.rank_slice(rank_of_long_tok))
    tokens_att = sum(lengths[i] for i in att.rank_slice(rank_of_long_att))
    assert tokens_att < tokens_tok
    # 8000 + 0.001 * 8000^2 = 72,000 > all 160 short ones (17,600): the long sequence's rank
    # gets only the short ones it needs so that none of its micro-batches is empty.
    assert tokens_att == 8000 + 100 * (att.mbs_per_rank - 1)


def test_deterministic():
    lengths = lognormal_lengths(1000, seed=9)
    a = plan_microbatches(lengths, 40000, n_ranks=4, cost="attention")
    b = plan_microbatches(lengths, 40000, n_ranks=4, cost="attention")
    assert a.order.tolist() == b.order.tolist()
    assert a.mb_offsets.tolist() == b.mb_offsets.tolist()


def test_accepts_torch_and_numpy_lengths():
    lengths = [5, 3, 9, 1]
    p1 = plan_microbatches(torch.tensor(lengths), 10)
    p2 = plan_microbatches(np.array(lengths, dtype=np.int32), 10)
    assert p1.microbatches == p2.microbatches


@pytest.mark.parametrize(
    "lengths, budget, kwargs, match",
    [
        ([10, 50, 20], 40, {}, r"sequence 1 has length 50, longer than max_tokens_per_mb=40"),
        ([], 40, {}, r"empty"),
        ([3, 0, 2], 40, {}, r"sequence 1 has length 0"),
        ([3, -4], 40, {}, r"sequence 1 has length -4"),
        ([3, 4], 0, {}, r"max_tokens_per_mb must be > 0"),
        ([3, 4], -5, {}, r"max_tokens_per_mb must be > 0"),
        ([3, 4], 10, {"n_ranks": 0}, r"n_ranks must be >= 1"),
        ([3, 4], 10, {"min_mbs": 0}, r"min_mbs must be >= 1"),
        ([3, 4], 10, {"mbs_divisor": 0}, r"mbs_divisor must be >= 1"),
        ([3, 4, 5], 10, {"n_ranks": 4}, r"cannot fill 4 ranks"),
        ([3, 4], 10, {"cost": "flops"}, r"cost must be 'tokens' or 'attention'"),
        ([3, 4], 10, {"cost": "attention", "attn_coef": -1.0}, r"attn_coef must be"),
        ([3, 4], 10, {"attn_coef": 0.5}, r"only used with cost='attention'"),
        ([[3, 4]], 10, {}, r"1-D"),
        ([1.5, 2], 10, {}, r"integers"),
    ],
)
@pytest.mark.parametrize("backend", ["native", "reference"])  # the reference is also the fallback
def test_bad_input_is_a_clear_error(lengths, budget, kwargs, match, backend):
    with pytest.raises(ValueError, match=match):
        plan_microbatches(lengths, budget, backend=backend, **kwargs)


def test_ffd_ref():
    lengths = [7, 5, 5, 4, 3, 2, 2, 1, 1]
    bins = first_fit_decreasing_ref(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens, capacity 10: optimal
    with pytest.raises(ValueError, match="sequence 0 has length 11"):
        first_fit_decreasing_ref([11], 10)


def test_karmarkar_karp_ref():
    # The classic example: {8,7,6,5,4} into 2 -> KK finds 16/14 (optimal is 15/15; KK is a heuristic).
    parts = karmarkar_karp_ref([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]
    parts = karmarkar_karp_ref(list(range(1, 31)), 3)
    assert sorted(i for p in parts for i in p) == list(range(30))
    assert {sum(i + 1 for i in p) for p in parts} == {155}


def test_plan_ref_meets_constraints():
    lengths = lognormal_lengths(200, seed=1, max_len=4000)
    plan = plan_microbatches_ref(lengths, 4096, n_ranks=4, min_mbs=2, mbs_divisor=2)
    check_plan(plan, lengths, 4096, 4, 2, 2)
