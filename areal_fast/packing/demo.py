"""Packing demo: plan micro-batches for a long-tailed batch, then pack and unpack it.

    python -m areal_fast.packing.demo [--n 4096] [--ranks 8] [--budget 32768] [--cost attention]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from areal_fast.packing import lower_bound_mbs, plan_microbatches


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="number of sequences")
    ap.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    ap.add_argument("--budget", type=int, default=32768, help="max tokens per micro-batch")
    ap.add_argument("--cost", choices=["tokens", "attention"], default="attention")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(7.0, 1.2, args.n).astype(np.int64), 1, args.budget)
    t0 = time.perf_counter()
    plan = plan_microbatches(lengths, args.budget, n_ranks=args.ranks, cost=args.cost)
    dt = time.perf_counter() - t0
    print(f"{args.n} sequences, {int(lengths.sum()):,} tokens (median {int(np.median(lengths))}, "
          f"max {int(lengths.max())}) over {args.ranks} ranks, budget {args.budget:,} tokens/micro-batch")
    print(f"planned in {dt * 1e3:.2f} ms: {plan.mbs_per_rank} micro-batches per rank "
          f"(lower bound {lower_bound_mbs(lengths, args.budget, args.ranks)}), "
          f"rank imbalance max/mean = {plan.imbalance:.4f} ({args.cost} cost)")
    fill = plan.mb_tokens / args.budget
    print(f"micro-batch fill: mean {fill.mean():.1%}, min {fill.min():.1%}")
    try:
        from areal_fast.packing import pack, unpack
    except ImportError:  # pack/unpack land with the packing kernels
        return
    import torch

    b, width = min(args.n, 8), 16
    small = torch.as_tensor(np.minimum(lengths[:b], 64))
    padded = torch.randn(b, int(small.max()), width)
    packed, cu_seqlens, position_ids = pack(padded, small)
    back = unpack(packed, cu_seqlens, int(small.max()))
    mask = torch.arange(padded.shape[1])[None, :] < small[:, None]
    ok = torch.equal(back[mask], padded[mask])
    print(f"pack/unpack round trip of {b} sequences ({packed.shape[0]} tokens): {'ok' if ok else 'MISMATCH'}")


if __name__ == "__main__":
    main()
