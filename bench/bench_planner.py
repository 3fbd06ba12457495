"""Micro-batch planner benchmark: the C++ planner against the pure-Python references
(Karmarkar-Karp over ranks + first-fit-decreasing per rank) in the same run.

    python bench/bench_planner.py                       # 65,536 lognormal lengths, 1..32k tokens
    python bench/bench_planner.py --dry-run             # list the cases, run nothing

Goals: <= 20 ms single-threaded for 65,536 sequences and >= 50x the references;
reports micro-batches per rank vs the lower bound and the rank imbalance (max/mean cost).
Rows are appended to bench/results/planner.jsonl with provenance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.packing import plan_microbatches, plan_microbatches_ref  # noqa: E402
from bench.common import add_harness_args, print_dry_run, print_table, provenance, save, time_fn  # noqa: E402


def long_tailed_lengths(n: int, seed: int = 0, max_len: int = 32768) -> np.ndarray:
    """Lognormal(7, 1.2) clipped to [1, max_len]: median ~1.1k, mean ~2.2k, p99 ~18k tokens,
    the shape of reasoning-model rollouts with a long tail."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(7.0, 1.2, n).astype(np.int64), 1, max_len)


def time_call(fn, reps: int) -> float:
    """Median seconds of ``fn()`` (wall clock: the planner runs on the CPU)."""
    return time_fn(fn, warmup=1 if reps > 1 else 0, reps=reps, cuda=False).median_ms / 1e3


def run(n: int, ranks: list[int], budget: int, reps: int, ref_reps: int) -> list[dict]:
    lengths = long_tailed_lengths(n)
    rows = []
    for n_ranks in ranks:
        for cost in ("tokens", "attention"):
            kw = dict(n_ranks=n_ranks, cost=cost)
            plan = plan_microbatches(lengths, budget, **kw)
            t_cpp = time_call(lambda kw=kw: plan_microbatches(lengths, budget, **kw), reps)
            ref = plan_microbatches_ref(lengths, budget, **kw)
            t_ref = time_call(lambda kw=kw: plan_microbatches_ref(lengths, budget, **kw), ref_reps)
            rows.append({
                "n_seqs": n, "ranks": n_ranks, "cost": cost, "budget": budget,
                "cpp_ms": t_cpp * 1e3, "ref_ms": t_ref * 1e3, "speedup": t_ref / t_cpp,
                "mbs/rank": plan.mbs_per_rank, "lower_bound": plan.lower_bound,
                "ref_mbs/rank": ref.mbs_per_rank, "imbalance": plan.imbalance, "ref_imbalance": ref.imbalance,
            })
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536, help="number of sequences (default 65,536)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64], help="data-parallel ranks")
    ap.add_argument("--budget", type=int, default=32768, help="max tokens per micro-batch")
    ap.add_argument("--reps", type=int, default=20, help="timed runs of the C++ planner (median)")
    ap.add_argument("--ref-reps", type=int, default=1, help="timed runs of the Python reference")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    if args.dry_run:
        print_dry_run("planner", [dict(n_seqs=args.n, ranks=r, cost=c, budget=args.budget)
                                  for r in args.ranks for c in ("tokens", "attention")])
        return
    prov = provenance()
    rows = run(args.n, args.ranks, args.budget, args.reps, args.ref_reps)
    print_table(rows)
    save("planner", rows, args, prov)


if __name__ == "__main__":
    main()
