"""Asynchronous (eta = 4) vs synchronous (eta = 0) RL on the shipped tiny task, same machine, seeds,
warm start, processes and batch size, the two modes of a seed one after the other: per mode the mean
and spread over seeds of the final and best held-out reward, trained samples/s and tokens/s, the time
to a target reward and where the wall time went (examples/README.md quotes it).

    python bench/bench_e2e.py [--seeds 1 2 3] [--steps 120] [--eta 4] [--target 0.7 0.8] [--dry-run] [KEY=VALUE ...]

Writes ``bench/results/e2e_<date>.json`` (every curve) and ``e2e_<date>.png``, and appends a summary row
to ``bench/results/e2e.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, append_rows, print_dry_run, provenance, refuse_dirty  # noqa: E402


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_mode(name: str, eta: int, seed: int, args, work: Path, warm: Path | None) -> tuple[dict, Path]:
    out = work / f"{name}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if warm is not None:  # both modes of a seed start from the very same warm-started weights
        shutil.copytree(warm, out / "warm_start")
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", args.config, f"experiment.output_dir={out}",
           f"experiment.seed={seed}", f"experiment.total_steps={args.steps}", f"rollout.max_staleness={eta}",
           "experiment.resume=false", "checkpoint.every_steps=0", "checkpoint.save_hf=false", "log.tensorboard=false",
           "log.progress=false", f"eval.every_steps={args.eval_every}", *args.overrides]
    print(f"[{name} seed {seed}] {' '.join(cmd)}", flush=True)
    load_before = os.getloadavg()
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = read(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    summary = json.loads((out / "summary.json").read_text())
    hits = {f"{t:g}": next((e["time"] for e in evals if e["eval_reward"] >= t), None) for t in args.target}
    timers = summary["timers"]
    import yaml

    return {
        "config": yaml.safe_load((out / "config.yaml").read_text()),
        "eta": eta, "seed": seed, "steps": len(train), "elapsed_s": train[-1]["time"],
        "load_avg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        "trained_samples_per_s": train[-1]["trained_samples_per_s"],
        "trained_tokens_per_s": train[-1]["trained_tokens_per_s"],
        "time_to_target_s": hits, "eval_first": evals[0]["eval_reward"] if evals else None,
        "eval_final": evals[-1]["eval_reward"] if evals else None,
        "eval_best": max(e["eval_reward"] for e in evals) if evals else None,
        "eval_curve": [(e["step"], e["time"], e["eval_reward"]) for e in evals],
        "train_reward_curve": [(r["step"], r["time"], r["reward"]) for r in train],
        "staleness_hist": summary["staleness_hist"],
        "time_breakdown_s": {"waiting_for_batch (generation-bound)": timers.get("wait_s", 0.0),
                             "training": timers.get("train_s", 0.0), "weight_sync": timers.get("sync_s", 0.0),
                             "evaluation": timers.get("eval_s", 0.0)},
    }, out


AGGREGATED = ("eval_first", "eval_final", "eval_best", "trained_samples_per_s", "trained_tokens_per_s", "elapsed_s")


def aggregate(runs: list[dict]) -> dict:
    """Mean, min and max over seeds of each AGGREGATED number (time to target: over the seeds that
    reached it, with how many did), and the summed time breakdown and staleness histogram."""
    def stats(xs):
        xs = [x for x in xs if x is not None]
        return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    agg = {k: stats([r[k] for r in runs]) for k in AGGREGATED}
    agg["time_to_target_s"] = {t: stats([r["time_to_target_s"][t] for r in runs]) for t in runs[0]["time_to_target_s"]}
    agg["time_breakdown_s_mean"] = {k: statistics.fmean(r["time_breakdown_s"][k] for r in runs)
                                    for k in runs[0]["time_breakdown_s"]}
    hist: dict[str, int] = {}
    for r in runs:
        for k, v in r["staleness_hist"].items():
            hist[k] = hist.get(k, 0) + v
    agg["staleness_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    return agg


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"async": "tab:blue", "sync": "tab:orange"}
    for name, runs in res["runs"].items():
        for i, r in enumerate(runs):
            c = r["eval_curve"]
            axes[0].plot([t for _, t, _ in c], [v for _, _, v in c], "o-", c=colors[name], alpha=0.7,
                         label=f"{name} (eta={r['eta']})" if i == 0 else None)
    for t in res["target"]:
        axes[0].axhline(t, ls="--", c="gray")
    axes[0].set_xlabel("wall time (s)")
    axes[0].set_ylabel("held-out exact match (greedy)")
    axes[0].legend()
    names = list(res["modes"])
    means = [res["modes"][n]["trained_tokens_per_s"]["mean"] for n in names]
    lo = [m - res["modes"][n]["trained_tokens_per_s"]["min"] for m, n in zip(means, names)]
    hi = [res["modes"][n]["trained_tokens_per_s"]["max"] - m for m, n in zip(means, names)]
    axes[1].bar(names, means, yerr=[lo, hi], color=[colors[n] for n in names])
    axes[1].set_ylabel("trained tokens / s (mean, min..max over seeds)")
    for n in names:
        h = res["modes"][n]["staleness_hist"]
        axes[2].bar([int(k) + (0.2 if n == "sync" else -0.2) for k in h], list(h.values()), width=0.4, label=n,
                    color=colors[n])
    axes[2].set_xlabel("staleness")
    axes[2].set_ylabel("groups (all seeds)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _fmt(a: dict | None, digits: int = 3) -> str:
    if a is None:
        return "-"
    return f"{a['mean']:.{digits}f} [{a['min']:.{digits}f}..{a['max']:.{digits}f}] (n={a['n']})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "tiny_reverse.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--target", type=float, nargs="+", default=[0.7, 0.8],
                    help="held-out rewards whose first-reach time is reported")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--work", default="/tmp/areal_bench_e2e")
    ap.add_argument("--warm-start-from", default=None, metavar="PATTERN",
                    help="reuse warm-started models built by earlier runs of the same config: a directory "
                         "pattern with {seed}, e.g. runs/s{seed}/warm_start (its signature must match, or the "
                         "run rebuilds it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    add_harness_args(ap, results=False, dry_run="print the runs' commands, run nothing")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    mode_etas = (("async", args.eta), ("sync", 0))
    if args.dry_run:
        print_dry_run("e2e", [dict(mode=m, eta=e, seed=s, config=args.config, steps=args.steps,
                                   overrides=args.overrides) for s in args.seeds for m, e in mode_etas])
        return
    refuse_dirty(args.out)
    prov = provenance()
    work = Path(args.work)
    runs: dict[str, list[dict]] = {m: [] for m, _ in mode_etas}
    for seed in args.seeds:
        warm = Path(args.warm_start_from.format(seed=seed)) if args.warm_start_from else None
        if warm is not None and not warm.is_dir():
            raise SystemExit(f"--warm-start-from: {warm} is not a directory")
        for name, eta in mode_etas:
            r, out = run_mode(name, eta, seed, args, work, warm)
            runs[name].append(r)
            warm = warm or (out / "warm_start" if (out / "warm_start").is_dir() else None)
    modes = {name: aggregate(rs) for name, rs in runs.items()}
    a, s = modes["async"], modes["sync"]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    res = {"date": stamp, "provenance": prov, "seeds": args.seeds, "steps": args.steps, "target": args.target,
           "overrides": args.overrides, "modes": modes, "runs": runs,
           "speedup_tokens_per_s": a["trained_tokens_per_s"]["mean"] / s["trained_tokens_per_s"]["mean"],
           "speedup_samples_per_s": a["trained_samples_per_s"]["mean"] / s["trained_samples_per_s"]["mean"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"e2e_{stamp}.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, out / f"e2e_{stamp}.png")
    except ImportError:
        pass
    for name, m in modes.items():
        print(f"{name:5s} (eta={runs[name][0]['eta']}), mean [min..max] over seeds {args.seeds}:")
        for k in AGGREGATED:
            print(f"    {k:24s} {_fmt(m[k], 1 if k.endswith(('_s', 'per_s')) else 3)}")
        for t, a in m["time_to_target_s"].items():
            print(f"    {'time to ' + t + ' (s)':24s} {_fmt(a, 1)}")
        print(f"    time breakdown (mean s)  {({k: round(v, 1) for k, v in m['time_breakdown_s_mean'].items()})}")
        print(f"    staleness histogram      {m['staleness_hist']}")
    summary = {k: res[k] for k in ("seeds", "steps", "target", "overrides", "speedup_tokens_per_s",
                                   "speedup_samples_per_s")}
    summary |= {f"{n}_{k}": m[k] for n, m in modes.items() for k in ("trained_tokens_per_s", "time_to_target_s",
                                                                       "eval_final", "eval_best")}
    append_rows("e2e", [summary | {"curves": f"e2e_{stamp}.json"}], out, prov)
    print(f"speedup (tokens/s, mean over seeds): {res['speedup_tokens_per_s']:.2f}x; results in "
          f"{out / f'e2e_{stamp}.json'}")


if __name__ == "__main__":
    main()
