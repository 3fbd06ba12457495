"""areal_fast (asynchronous, and synchronous: max_staleness 0) against TRL's GRPOTrainer on the tiny
recipe: RL wall time for the steps and time to held-out exact match ``--target``, per seed, with the
machine's load (tools/trl_arm.py runs the arms; TRL comes with the ``trl`` extra).

    python -m bench.bench_vs_trl --seeds 1,2,3 --steps 120     # -> bench/results/vs_trl.jsonl
"""

import argparse
import time

from bench.common import add_harness_args, append_rows
from tools.trl_arm import compare

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out", default="runs/vs_trl")
    ap.add_argument("--recipe", default="examples/tiny_reverse.yaml")
    ap.add_argument("--eval-every", type=int, default=10)
    add_harness_args(ap, results=False, dry_run="")
    a = ap.parse_args()
    stamp = time.strftime("%Y%m%d_%H%M", time.gmtime())
    for row in compare(a.out, [int(s) for s in a.seeds.split(",")], a.steps, a.target, a.recipe, a.eval_every):
        append_rows("vs_trl", [{"run": stamp, **row}])  # row by row: a partial run counts
