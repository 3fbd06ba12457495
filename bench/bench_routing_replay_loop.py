"""Routing replay through the training loop: ``areal-fast train examples/tiny_reverse_moe.yaml`` served in
bf16, trained in fp32, eta 0, routed experts recorded, ``train.ppo.routing_replay`` off or on, the
corrections logging their masked shares (docs/moe.md, "Routing replay, measured in the loop").

    python bench/bench_routing_replay_loop.py [--seeds 1,2,3] [--steps 20] [--results DIR | --no-results]
        [--dry-run]

Writes ``<results>/routing_replay_loop_<date>.{json,md}`` and a row per run to ``routing_replay_loop.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, csv_list, print_dry_run, provenance, save  # noqa: E402

RECIPE = ROOT / "examples" / "tiny_reverse_moe.yaml"
KEYS = ("mismatch_k3", "mismatch_k1", "mismatch_ratio_p99", "mismatch_ratio_max", "tis_truncated_fraction",
        "token_mis_masked_fraction", "seq_mis_masked_fraction", "routing_replayed_fraction",
        "routing_differ_fraction", "step_time_s", "recompute_time_s")
# longer answers than the recipe's (median 3 characters): 6-16 characters, median 8
LONG_TASK = ("data.synthetic.min_len=6", "data.synthetic.max_len=16", "data.synthetic.log_mean=0.7",
             "data.synthetic.log_std=0.6", "rollout.max_new_tokens=24")
CORRECTIONS = ("train.ppo.loss.tis_cap=2.0", "train.ppo.loss.token_mis_lower=0.5", "train.ppo.loss.token_mis_upper=2.0",
               "train.ppo.loss.seq_mis_lower=0.5", "train.ppo.loss.seq_mis_upper=2.0")


def overrides(seed: int, replay: bool, steps: int, out: Path, task: str = "recipe") -> list[str]:
    return [*(LONG_TASK if task == "long" else ()), f"experiment.output_dir={out}", f"experiment.seed={seed}",
            f"experiment.total_steps={steps}",
            'rollout.server_args=["--dtype", "bfloat16"]', "rollout.max_staleness=0",
            "rollout.return_routed_experts=true", f"train.ppo.routing_replay={str(replay).lower()}",
            f"eval.every_steps={steps}", "checkpoint.every_steps=0", "log.progress=false", "log.plots=false",
            "log.tensorboard=false", *CORRECTIONS]


def one_run(seed: int, replay: bool, steps: int, work: Path, task: str) -> dict:
    out = work / f"seed{seed}_{'replay' if replay else 'free'}"
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(RECIPE), *overrides(seed, replay, steps, out, task)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        raise RuntimeError(f"run seed {seed} replay {replay} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train" and r["step"] >= 2]
    evals = [r for r in rows if r.get("kind") == "eval"]
    res = {"task": task, "seed": seed, "replay": replay, "steps": steps, "wall_s": round(time.monotonic() - t0, 1)}
    for k in KEYS:
        vals = [r[f"train/{k}"] for r in train if f"train/{k}" in r]
        res[k] = statistics.fmean(vals) if vals else None
    res["eval_em"] = evals[-1].get("eval_reward") if evals else None  # exact match of greedy answers
    return res


def table(runs: list[dict], seeds: list[int]) -> str:
    head = ("| seed | replay | routings differing | k3 | k1 | w p99 | w max | TIS truncated | IcePop masked | "
            "seq MIS masked | replayed | step s | recompute s | held-out EM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        lines.append(f"| {r['seed']} | {'on' if r['replay'] else 'off'} | {100 * r['routing_differ_fraction']:.3f} % | "
                     f"{r['mismatch_k3']:.2e} | "
                     f"{r['mismatch_k1']:+.2e} | {r['mismatch_ratio_p99']:.3f} | {r['mismatch_ratio_max']:.2f} | "
                     f"{100 * r['tis_truncated_fraction']:.3f} % | {100 * r['token_mis_masked_fraction']:.3f} % | "
                     f"{100 * r['seq_mis_masked_fraction']:.2f} % | {r['routing_replayed_fraction'] or 0:.3f} | "
                     f"{r['step_time_s']:.3f} | {r['recompute_time_s']:.3f} | {r['eval_em']} |")
    by = {(r["seed"], r["replay"]): r for r in runs}
    ratios = [by[(s, False)]["mismatch_k3"] / by[(s, True)]["mismatch_k3"] for s in seeds
              if (s, False) in by and (s, True) in by and by[(s, True)]["mismatch_k3"]]
    if ratios:
        lines.append("")
        lines.append(f"k3 without / with replay, per seed: {', '.join(f'{x:.2f}' for x in ratios)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3", type=csv_list(cast=int))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--task", choices=("recipe", "long"), default="recipe",
                    help="the recipe's strings, or longer ones (6-16 characters, 24 new tokens)")
    add_harness_args(ap)
    a = ap.parse_args(argv)
    cases = [{"seed": s, "replay": r} for s in a.seeds for r in (False, True)]
    if a.dry_run:
        print_dry_run("routing_replay_loop", cases)
        for c in cases[:2]:
            print("  overrides:", " ".join(overrides(c["seed"], c["replay"], a.steps, Path("<work>"), a.task)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="areal_bench_replay_") as work:
        for c in cases:
            r = one_run(c["seed"], c["replay"], a.steps, Path(work), a.task)
            print(json.dumps(r), flush=True)
            runs.append(r)
    md = table(runs, a.seeds)
    print(md)
    prov = provenance(native=False)
    if not a.no_results:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
        results = Path(a.results or ROOT / "bench" / "results")
        results.mkdir(parents=True, exist_ok=True)
        stamp += f"_{a.task}"
        (results / f"routing_replay_loop_{stamp}.json").write_text(json.dumps({"provenance": prov, "runs": runs},
                                                                              indent=1))
        (results / f"routing_replay_loop_{stamp}.md").write_text(
            f"# Routing replay in the loop ({stamp} UTC)\n\n`python bench/bench_routing_replay_loop.py "
            f"--seeds {','.join(map(str, a.seeds))} --steps {a.steps} --task {a.task}`\n\n{md}\n")
    save("routing_replay_loop", runs, a, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
