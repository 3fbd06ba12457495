"""Asynchronous (eta = 4) vs synchronous (eta = 0) RL on the shipped tiny task, same machine, same
seed, same processes (one embedded engine + the trainer inside the controller), same batch size.

    python bench/bench_e2e.py [--steps 60] [--eta 4] [--target 0.6] [--out bench/results] [--dry-run] [KEY=VALUE ...]

Reports, per mode: trained samples/s and tokens/s, time to the first held-out (greedy) reward >=
target, final held-out reward, the staleness histogram, and where the wall time went (waiting
for a batch = generation-bound, training, weight sync, evaluation). Writes
``bench/results/e2e_<date>.json`` (the curves) and ``e2e_<date>.png``, and appends a summary row
with provenance to ``bench/results/e2e.jsonl``. The synchronous baseline is the same
code with eta = 0: the same engine with continuous batching, batch size and kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_rows, print_dry_run, provenance  # noqa: E402


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_mode(name: str, eta: int, args, work: Path, warm: Path | None) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if warm is not None:  # both modes start from the very same warm-started weights
        shutil.copytree(warm, out / "warm_start")
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", args.config, f"experiment.output_dir={out}",
           f"experiment.total_steps={args.steps}", f"rollout.max_staleness={eta}", "experiment.resume=false",
           "checkpoint.every_steps=0", "checkpoint.save_hf=false", "log.tensorboard=false", "log.progress=false",
           f"eval.every_steps={args.eval_every}", *args.overrides]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = read(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    summary = json.loads((out / "summary.json").read_text())
    elapsed = train[-1]["time"]
    hit = next((e["time"] for e in evals if e["eval_reward"] >= args.target), None)
    timers = summary["timers"]
    import yaml

    return {
        "config": yaml.safe_load((out / "config.yaml").read_text()),
        "eta": eta, "steps": len(train), "elapsed_s": elapsed,
        "trained_samples_per_s": train[-1]["trained_samples_per_s"],
        "trained_tokens_per_s": train[-1]["trained_tokens_per_s"],
        "time_to_target_s": hit, "eval_first": evals[0]["eval_reward"] if evals else None,
        "eval_final": evals[-1]["eval_reward"] if evals else None,
        "eval_curve": [(e["step"], e["time"], e["eval_reward"]) for e in evals],
        "train_reward_curve": [(r["step"], r["time"], r["reward"]) for r in train],
        "staleness_hist": summary["staleness_hist"],
        "time_breakdown_s": {"waiting_for_batch (generation-bound)": timers.get("wait_s", 0.0),
                             "training": timers.get("train_s", 0.0), "weight_sync": timers.get("sync_s", 0.0),
                             "evaluation": timers.get("eval_s", 0.0)},
    }, out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in res["modes"].items():
        c = r["eval_curve"]
        axes[0].plot([t for _, t, _ in c], [v for _, _, v in c], "o-", label=f"{name} (eta={r['eta']})")
    axes[0].axhline(res["target"], ls="--", c="gray")
    axes[0].set_xlabel("wall time (s)")
    axes[0].set_ylabel("held-out reward (greedy)")
    axes[0].legend()
    names = list(res["modes"])
    axes[1].bar(names, [res["modes"][n]["trained_tokens_per_s"] for n in names])
    axes[1].set_ylabel("trained tokens / s")
    for n in names:
        h = res["modes"][n]["staleness_hist"]
        axes[2].bar([int(k) + (0.2 if n == "sync" else -0.2) for k in h], list(h.values()), width=0.4, label=n)
    axes[2].set_xlabel("staleness")
    axes[2].set_ylabel("groups")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "tiny_reverse.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--work", default="/tmp/areal_bench_e2e")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--dry-run", action="store_true", help="print the two runs' commands, run nothing")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.dry_run:
        print_dry_run("e2e", [dict(mode=m, eta=e, config=args.config, steps=args.steps, overrides=args.overrides)
                              for m, e in (("async", args.eta), ("sync", 0))])
        return
    prov = provenance()
    work = Path(args.work)
    modes, warm = {}, None
    for name, eta in (("async", args.eta), ("sync", 0)):
        modes[name], out = run_mode(name, eta, args, work, warm)
        warm = warm or (out / "warm_start" if (out / "warm_start").is_dir() else None)
    a, s = modes["async"], modes["sync"]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    res = {"date": stamp, "provenance": prov, "steps": args.steps, "target": args.target,
           "overrides": args.overrides, "modes": modes,
           "speedup_tokens_per_s": a["trained_tokens_per_s"] / s["trained_tokens_per_s"],
           "speedup_samples_per_s": a["trained_samples_per_s"] / s["trained_samples_per_s"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"e2e_{stamp}.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, out / f"e2e_{stamp}.png")
    except ImportError:
        pass
    for name, r in modes.items():
        print(f"{name:5s} eta={r['eta']}: {r['trained_samples_per_s']:.1f} samples/s, "
              f"{r['trained_tokens_per_s']:.0f} tokens/s, {r['elapsed_s']:.0f} s, "
              f"eval {r['eval_first']} -> {r['eval_final']}, time to {args.target}: {r['time_to_target_s']}, "
              f"breakdown {({k: round(v, 1) for k, v in r['time_breakdown_s'].items()})}")
    summary = {k: res[k] for k in ("steps", "target", "overrides", "speedup_tokens_per_s", "speedup_samples_per_s")}
    summary |= {f"{n}_{k}": r[k] for n, r in modes.items() for k in ("eta", "trained_tokens_per_s",
                                                                       "time_to_target_s", "eval_final")}
    append_rows("e2e", [summary | {"curves": f"e2e_{stamp}.json"}], out, prov)
    print(f"speedup (tokens/s): {res['speedup_tokens_per_s']:.2f}x; results in {out / f'e2e_{stamp}.json'}")


if __name__ == "__main__":
    main()
