"""areal_fast (asynchronous, and synchronous: max_staleness 0) against TRL's GRPOTrainer on the tiny recipe, per seed
with the load (tools/trl_arm.py runs the arms; TRL: the ``trl`` extra). ``python -m bench.bench_vs_trl``"""
import argparse
import time

from bench.common import add_harness_args, append_rows, provenance
from tools.trl_arm import compare

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    for flag, default in (("--seeds", "1,2,3"), ("--steps", 120), ("--target", 0.8), ("--eval-every", 10),
                          ("--out", "runs/vs_trl"), ("--recipe", "examples/tiny_reverse.yaml")):
        ap.add_argument(flag, default=default, type=type(default))
    a = add_harness_args(ap, results=False, dry_run="").parse_args()
    stamp, prov = time.strftime("%Y%m%d_%H%M", time.gmtime()), provenance()  # the tree as the run starts
    for row in compare(a.out, [int(s) for s in a.seeds.split(",")], a.steps, a.target, a.recipe, a.eval_every):
        append_rows("vs_trl", [{"run": stamp, **row}], prov=prov)  # row by row: a partial run counts
