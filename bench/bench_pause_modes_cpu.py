"""The tiny example's quality per pause mode (abort / retract / in_place), over seeds, on CPU.

    python bench/bench_pause_modes_cpu.py [--modes abort,retract,in_place] [--seeds 1,2,3] [--steps 40]
        [--eval-every 20] [--work-root DIR] [--report-only] [--results bench/results]

Each mode is one sweep of ``bench/bench_staleness.py`` (the real training loop: an embedded engine,
the controller with its staleness gate, the PPO actor, weight sync after every step) of
``examples/tiny_reverse.yaml`` at the recipe's eta (4), the decoupled objective with the proximal
recomputed, GRPO, with ``rollout.pause_mode=<mode>`` as the one difference, in
``<work-root>/work_<mode>``. The warm start depends on the seed only: a warm start already built by
one mode's sweep is copied into the others before they start (``--share-warm``, on by default).

Writes ``<results>/pause_mode_cpu_<date>.json`` (every run) and ``.md`` (the table), and appends one
row per mode to ``<results>/pause_mode_cpu.jsonl``. docs/pause_modes.md has the measured table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, append_rows, provenance, refuse_dirty  # noqa: E402

MODES = ("abort", "retract", "in_place")


def sweep_command(mode: str, args) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "bench_staleness.py"), "--etas", "4", "--objectives", "recompute",
            "--advantages", "grpo", "--seeds", ",".join(map(str, args.seeds)), "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), "--work", str(work_dir(args, mode)),
            "--out", str(work_dir(args, mode) / "report"), "--tag", f"pause_mode_{mode}",
            f"rollout.pause_mode={mode}"]


def work_dir(args, mode: str) -> Path:
    return Path(args.work_root) / f"work_{mode}"


def share_warm_starts(args, mode: str) -> None:
    """Copy each seed's warm start built by another mode's sweep into this one's (same recipe, same seed)."""
    for seed in args.seeds:
        dst = work_dir(args, mode) / "warm" / f"seed{seed}" / "warm_start"
        if dst.is_dir():
            continue
        for other in args.modes:
            src = work_dir(args, other) / "warm" / f"seed{seed}" / "warm_start"
            if other != mode and (src / "warm_start.json").is_file():
                shutil.copytree(src, dst)
                break


def mode_results(args, mode: str) -> list[dict]:
    files = sorted((work_dir(args, mode) / "results").glob("*.json"))
    return [json.loads(f.read_text()) | {"pause_mode": mode} for f in files]


def _ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(mode: str, runs: list[dict]) -> dict:
    em, em_sd = _ms([r["eval_final"] for r in runs])
    area, area_sd = _ms([statistics.fmean(v for s, v in r["eval_curve"] if s > 0) for r in runs])
    return {"pause_mode": mode, "seeds": [r["seed"] for r in runs], "steps": runs[0]["steps"] if runs else None,
            "em_final_mean": em, "em_final_std": em_sd, "em_final_per_seed": [r["eval_final"] for r in runs],
            "em_start_per_seed": [r["eval_first"] for r in runs], "em_over_run_mean": area, "em_over_run_std": area_sd,
            "staleness_mean": _ms([r["staleness_mean"] for r in runs])[0],
            "behav_kl_mean": _ms([r.get("behav_kl_mean") for r in runs])[0],
            "clip_fraction_mean": _ms([r.get("clip_fraction_mean") for r in runs])[0],
            "trained_samples_per_s": _ms([r["trained_samples_per_s"] for r in runs])[0],
            "run_wall_s_mean": _ms([r["wall_s"] for r in runs])[0]}


def _f(x, d=3):
    return "-" if x is None else f"{x:.{d}f}"


def table(rows: list[dict]) -> str:
    out = ["| pause mode | held-out EM, final (mean ± std) | per seed | EM over the run | staleness mean | "
           "behav KL (p - b) | clip fraction | trained samples/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r['pause_mode']}` | {_f(r['em_final_mean'])} ± {_f(r['em_final_std'])} | "
                   f"{', '.join(_f(x) for x in r['em_final_per_seed'])} | {_f(r['em_over_run_mean'])} | "
                   f"{_f(r['staleness_mean'], 2)} | {_f(r['behav_kl_mean'], 5)} | {_f(r['clip_fraction_mean'], 4)} | "
                   f"{_f(r['trained_samples_per_s'], 1)} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--work-root", default="/tmp/areal_bench_pause_modes")
    ap.add_argument("--no-share-warm", dest="share_warm", action="store_false")
    ap.add_argument("--report-only", action="store_true", help="summarise the work dirs' results, run nothing")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    add_harness_args(ap, results=False, dry_run=None)
    args = ap.parse_args(argv)
    refuse_dirty(args.results)
    args.modes = [m for m in args.modes.split(",") if m]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown mode {bad[0]!r}; known: {', '.join(MODES)}")
    if not args.report_only:
        for mode in args.modes:
            if args.share_warm:
                share_warm_starts(args, mode)
            resume = ["--resume", str(work_dir(args, mode))] if (work_dir(args, mode) / "sweep.json").is_file() else []
            subprocess.run(sweep_command(mode, args) + resume, check=True)
    runs = {m: mode_results(args, m) for m in args.modes}
    rows = [summarise(m, rs) for m, rs in runs.items() if rs]
    if not rows:
        raise SystemExit(f"no results under {args.work_root}")
    prov = provenance()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pause_mode_cpu_{stamp}.json").write_text(json.dumps(
        {"date": stamp, "provenance": prov, "modes": rows, "runs": [r for rs in runs.values() for r in rs],
         "commands": {m: " ".join(sweep_command(m, args)) for m in args.modes}}, indent=1) + "\n")
    md = (f"# Tiny example per pause mode, {stamp} UTC\n\n{rows[0]['steps']} steps, eta 4, decoupled PPO "
          f"(recompute), GRPO, seeds {args.seeds}; commit {prov.get('commit')}.\n\n" + table(rows))
    (out / f"pause_mode_cpu_{stamp}.md").write_text(md)
    append_rows("pause_mode_cpu", rows, out, prov)
    print(md)


if __name__ == "__main__":
    main()
