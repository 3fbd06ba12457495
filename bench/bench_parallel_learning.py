"""It learns under expert and context parallelism (docs/parallelism.md): a recipe on two trainer ranks with
``train.parallel.ep: 2`` or ``cp: 2`` against its one-rank run, same seeds and warm starts, through the whole
loop (bench/sweep.py). ``cp2``'s rank budget is 18 tokens: a longer sequence is cut across the ranks.

    python bench/bench_parallel_learning.py --config examples/tiny_reverse_moe.yaml --arms one,ep2 --tag moe
    python bench/bench_parallel_learning.py --arms one,cp2 --tag long data.synthetic.min_len=6 \\
        data.synthetic.max_len=16 data.synthetic.log_mean=0.7 rollout.max_new_tokens=18
Writes ``<out>/parallel_learning_<date>_<tag>.{json,md}``, a row per arm to ``parallel_learning.jsonl``."""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import sweep  # noqa: E402

ARMS = {"one": (), "ep2": ("train.world_size=2", "train.parallel.ep=2"),
        "cp2": ("train.world_size=2", "train.parallel.cp=2", "train.max_tokens_per_mb=18")}


@dataclass(frozen=True)
class Arm:  # eta (the recipes' max_staleness), objective, advantage: what the sweep's per-run summary reads
    name: str
    eta: int = 4
    objective: str = "recompute"
    advantage: str = "grpo"

    def overrides(self) -> list[str]:
        return list(ARMS[self.name])


def summary(results: list[dict], stamp: str):
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in results):
        rs = [r for r in results if r["arm"] == arm]
        (em, em_sd), (wall, wall_sd) = (sweep.mean_spread([r[k] for r in rs]) for k in ("eval_final", "wall_s"))
        rows.append({"arm": arm, "overrides": list(ARMS[arm]), "seeds": [r["seed"] for r in rs], "eval_final_mean": em,
                     "eval_first_mean": sweep.mean_spread([r["eval_first"] for r in rs])[0], "eval_final_spread": em_sd,
                     "wall_s_mean": wall, "wall_s_spread": wall_sd, "curves": f"parallel_learning_{stamp}.json"})
    md = "| arm | seeds | EM at step 0 | final EM (mean ± std) | wall s a run (mean ± std) |\n" + "|---" * 5 + "|\n"
    md += "".join(f"| {r['arm']} | {r['seeds']} | {r['eval_first_mean']:.3f} | {r['eval_final_mean']:.3f} ± "
                  f"{r['eval_final_spread']:.3f} | {r['wall_s_mean']:.0f} ± {r['wall_s_spread']:.0f} |\n" for r in rows)
    return {"arms": rows}, md, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", type=sweep.csv_list(list(ARMS)), default=["one", "ep2"])
    sweep.add_sweep_args(ap, "parallel_learning", seeds=(1, 2, 3), steps=40, batch_size=8)
    sweep.check_sweep_args(ap, args := ap.parse_intermixed_args(argv))
    runs = [sweep.Run(Arm(a), s) for s in args.seeds for a in args.arms]
    sweep.main("parallel_learning", runs, args, lambda runs, work, args: sweep.report(
        "parallel_learning", "Learning under expert and context parallelism", runs, work, args, summary))

if __name__ == "__main__":
    main()
