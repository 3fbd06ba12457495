"""ns per token to turn one /generate answer into a Segment: the reference (orjson decode of the
whole answer, then the columns picked from the decoded lists) and the native scanner (one C++ pass
for output_ids and output_token_logprobs, orjson for the small rest), on the same answers, in the
same run. Answers have SGLang's shape with return_logprob ([logprob, id, null] per token).

    python bench/bench_answer_parse.py --no-results   # table only
    python bench/bench_answer_parse.py                # and a row per length in bench/results/answer_parse.jsonl
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import orjson

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.rollout import answer  # noqa: E402
from bench.common import add_harness_args, print_table, save  # noqa: E402

LENGTHS = (100, 1_000, 4_000, 32_000)


def sglang_answer(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    ids = [rng.randrange(0, 151_936) for _ in range(n)]
    meta = {"id": f"bench-{seed}", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 512,
            "weight_version": "12", "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 12.5,
            "output_token_logprobs": [[-rng.expovariate(2.0), t, None] for t in ids]}
    return orjson.dumps({"text": "", "output_ids": ids, "meta_info": meta})


def ns_per_token(fn, raws: list[bytes], n: int, reps: int) -> float:
    """Best of ``reps`` passes over the answers (the least disturbed by the other processes)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for raw in raws:
            fn(memoryview(raw), "bench")
        best = min(best, (time.perf_counter_ns() - t0) / (n * len(raws)))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_harness_args(ap, dry_run=None)
    ap.add_argument("--tokens", type=int, default=2_000_000, help="tokens parsed per pass and length")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if answer._scan is None:
        raise SystemExit("the native scanner is not built (or AREAL_FAST_ANSWER_PARSER=python): nothing to compare")
    gc.collect()
    rows = []
    for n in LENGTHS:
        raws = [sglang_answer(n, seed) for seed in range(max(1, args.tokens // n))]
        answer.FALLBACKS.clear()
        ref = ns_per_token(answer._parse_reference, raws, n, args.reps)
        nat = ns_per_token(answer.parse_generate, raws, n, args.reps)
        if answer.FALLBACKS:
            raise SystemExit(f"the scanner left answers to the reference: {answer.FALLBACKS}")
        rows.append({"tokens": n, "answers": len(raws), "bytes_per_token": round(len(raws[0]) / n, 1),
                     "reference_ns_per_token": round(ref, 1), "native_ns_per_token": round(nat, 1),
                     "speedup": round(ref / nat, 2)})
    print_table(rows)
    save("answer_parse", rows, args)


if __name__ == "__main__":
    main()
