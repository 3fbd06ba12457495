"""The tiny example's quality per pause mode (abort / retract / in_place), over seeds, on CPU: one
sweep (``bench/sweep.py``) of ``examples/tiny_reverse.yaml`` at eta 4, the decoupled objective with the
proximal recomputed, GRPO, with ``rollout.pause_mode=<mode>`` as the one difference between arms (the
warm start built once per seed). The measured table: docs/pause_modes.md.

    python bench/bench_pause_modes_cpu.py [--modes abort,retract,in_place] [sweep options] [KEY=VALUE ...]

Writes ``<out>/pause_mode_cpu_<date>.{json,md}`` and one row per mode to ``<out>/pause_mode_cpu.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import sweep  # noqa: E402
from bench.common import csv_list  # noqa: E402
from bench.sweep import Run, mean_spread  # noqa: E402

MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class Arm:
    mode: str
    eta: int = 4
    objective: str = "recompute"
    advantage: str = "grpo"

    @property
    def name(self) -> str:
        return f"pause_{self.mode}"

    def overrides(self) -> list[str]:
        return [f"rollout.max_staleness={self.eta}", "train.ppo.prox_mode=recompute",
                f"train.ppo.adv_estimator={self.advantage}", f"rollout.pause_mode={self.mode}"]


def summarise(mode: str, runs: list[dict]) -> dict:
    em, em_sd = mean_spread([r["eval_final"] for r in runs])
    area, area_sd = mean_spread([sweep.eval_mean(r) for r in runs])
    return {"pause_mode": mode, "seeds": [r["seed"] for r in runs], "steps": runs[0]["steps"] if runs else None,
            "em_final_mean": em, "em_final_std": em_sd, "em_final_per_seed": [r["eval_final"] for r in runs],
            "em_start_per_seed": [r["eval_first"] for r in runs], "em_over_run_mean": area, "em_over_run_std": area_sd,
            **{k: mean_spread([r.get(k) for r in runs])[0] for k in ("staleness_mean", "behav_kl_mean",
                                                                       "clip_fraction_mean", "trained_samples_per_s")},
            "run_wall_s_mean": mean_spread([r["wall_s"] for r in runs])[0]}


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


def summary(results: list[dict], stamp: str):
    by_mode = {m: [r for r in results if r["pause_mode"] == m] for m in dict.fromkeys(r["pause_mode"] for r in results)}
    rows = [summarise(m, rs) for m, rs in by_mode.items()]
    return {"modes": rows}, "Decoupled PPO (recompute), GRPO, eta 4; one arm per pause mode.\n\n" + table(rows), rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", type=csv_list(MODES), default=list(MODES))
    sweep.add_sweep_args(ap, "pause_modes", eval_every=20)
    args = ap.parse_intermixed_args(argv)
    sweep.check_sweep_args(ap, args)
    runs = [Run(Arm(m), s) for s in args.seeds for m in args.modes]
    sweep.main("pause_mode_cpu", runs, args, lambda runs, work, args: sweep.report(
        "pause_mode_cpu", "Tiny example per pause mode", runs, work, args, summary),
        after_run=lambda run, res, work: res.update(pause_mode=run.arm.mode))


if __name__ == "__main__":
    main()
