"""The mismatch corrections under a real train/inference mismatch: the embedded engine serves in
bfloat16 (or, in the ``*_fp8`` arms, serves the block-FP8 weights the trainer sends with
``weights.quantize: fp8``, ``--quantization fp8``) while the trainer computes in fp32, and each
correction of the decoupled loss (``CORRECTIONS``) is trained against none at eta 0 and 4, with an
fp32-served control, over seeds, on the reversal task with 6-16 character strings (``TASK``), through
the sweep harness (``bench/sweep.py``). Per run it keeps the trainer's per-step mismatch dashboard
(``STEP_KEYS``). Results and reading: docs/mismatch.md.

    python bench/bench_mismatch_ablation.py [--arms none,tis,icepop,seq_mis,m2po,none_fp32] [--etas 0,4]
        [sweep options] [KEY=VALUE ...]
    python bench/bench_mismatch_ablation.py --arms none_fp8,tis_fp8,icepop_fp8,seq_mis_fp8,m2po_fp8 ...

Writes ``<out>/mismatch_ablation_<date>.{json,md}`` and one row per arm to ``<out>/mismatch_ablation.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import sweep  # noqa: E402
from bench.bench_staleness import OBJECTIVE_LOSS  # noqa: E402
from bench.sweep import Run, ci95_halfwidth, contrast, eval_mean, mean_curve, mean_spread  # noqa: E402

# The corrections, each replacing the recipe's token_mis_upper = 5 (docs/objective.md): TIS with
# C = 2, IcePop's band [0.5, 2], the geometric-mean sequence band [0.5, 2], M2PO with tau = 0.04.
CORRECTIONS = {
    "none": ("train.ppo.loss.token_mis_upper=null",),
    "tis": OBJECTIVE_LOSS["tis"],
    "icepop": ("train.ppo.loss.token_mis_lower=0.5", "train.ppo.loss.token_mis_upper=2.0"),
    "seq_mis": OBJECTIVE_LOSS["seq_mis"],
    "m2po": OBJECTIVE_LOSS["m2po"],
}
TITLES = {"none": "no correction", "tis": "token TIS (C = 2)", "icepop": "IcePop band [0.5, 2]",
          "seq_mis": "sequence MIS [0.5, 2] (geometric mean)", "m2po": "M2PO (tau = 0.04)"}
# arm name -> (correction, serving dtype); "none_fp32" is the control without mismatch, "seq_mis_fp32"
# (not in the default sweep) asks whether what sequence MIS does needs the bf16 mismatch
ARMS = {**{c: (c, "bfloat16") for c in CORRECTIONS}, "none_fp32": ("none", "float32"),
        "seq_mis_fp32": ("seq_mis", "float32"), **{f"{c}_fp8": (c, "fp8") for c in CORRECTIONS}}
DEFAULT_ARMS = tuple(a for a in ARMS if a != "seq_mis_fp32" and not a.endswith("_fp8"))
FP8_ARMS = tuple(a for a in ARMS if a.endswith("_fp8"))
# the servers' flags per serving dtype: FP8 is the engine in bf16 serving the block-FP8 weights
SERVER_ARGS = {"bfloat16": ["--dtype", "bfloat16"], "float32": ["--dtype", "float32"],
               "fp8": ["--dtype", "bfloat16", "--quantization", "fp8"]}
DTYPE_ORDER = ("bfloat16", "fp8", "float32")
ETAS = (0, 4)
SEEDS = (1, 2, 3)
# Longer answers than the recipe's (median 3 characters): 6-16 characters, median 8.
TASK = ("data.synthetic.min_len=6", "data.synthetic.max_len=16", "data.synthetic.log_mean=0.7",
        "data.synthetic.log_std=0.6", "rollout.max_new_tokens=24")
# the per-step dashboard keys kept per run (train/<key> in metrics.jsonl; gen_len_mean: generated tokens)
STEP_KEYS = ("mismatch_k1", "mismatch_k3", "mismatch_ratio_p99", "mismatch_ratio_max", "behav_kl", "clip_fraction",
             "tis_truncated_fraction", "token_mis_masked_fraction", "seq_mis_masked_fraction", "m2po_masked_fraction",
             "gen_len_mean")
# the share each correction masked (sequences' tokens for seq_mis) or truncated
MASKED = {"tis": "tis_truncated_fraction", "icepop": "token_mis_masked_fraction",
          "seq_mis": "seq_mis_masked_fraction", "m2po": "m2po_masked_fraction"}


@dataclass(frozen=True)
class Arm:
    eta: int
    arm: str  # a key of ARMS
    advantage: str = "grpo"

    @property
    def correction(self) -> str:
        return ARMS[self.arm][0]

    @property
    def dtype(self) -> str:
        return ARMS[self.arm][1]

    @property
    def objective(self) -> str:  # what bench_staleness's summaries and contrasts key on
        return self.arm

    @property
    def name(self) -> str:
        return f"eta{self.eta}_{self.arm}"

    def server_overrides(self) -> list[str]:
        return [f"rollout.server_args={json.dumps(SERVER_ARGS[self.dtype])}"]

    def overrides(self) -> list[str]:
        quantize = ["weights.quantize=fp8"] if self.dtype == "fp8" else []
        return [*self.server_overrides(), *quantize, f"rollout.max_staleness={self.eta}",
                "train.ppo.prox_mode=recompute", *CORRECTIONS[self.correction],
                f"train.ppo.adv_estimator={self.advantage}"]


def build_runs(arms, etas, seeds) -> list[Run]:
    """Seed-major (complete seeds first); within a seed the bf16 arms, then the FP8 ones, then the fp32
    ones (one server start per seed and dtype)."""
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"--arms: unknown arm {a!r} (known: {', '.join(ARMS)})")
    for e in etas:
        if e < 0:
            raise ValueError(f"--etas: eta must be >= 0, got {e}")
    order = sorted(arms, key=lambda a: DTYPE_ORDER.index(ARMS[a][1]))
    return [Run(Arm(e, a), s) for s in seeds for a in order for e in etas]


def run_overrides(run: Run, steps: int, eval_every: int, extra=(), batch_size: int | None = None) -> list[str]:
    """The dotted overrides of one run: the sweep's settings, the task, the user's, the arm's, the seed."""
    return sweep.run_overrides(run, steps, eval_every, [*TASK, *extra], batch_size)


def step_curves(metrics_path: Path) -> dict[str, list]:
    """Per trainer step, the dashboard keys of ``STEP_KEYS`` (``[step, value]``; missing values left out)."""
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    def key(k):  # the controller's keys (gen_len_mean) are top-level, the trainer's under train/
        return k if k in ("gen_len_mean",) else f"train/{k}"

    return {k: [[r["step"], r[key(k)]] for r in train if isinstance(r.get(key(k)), int | float)] for k in STEP_KEYS}


def _curve_mean(curve: list, skip_first: int = 0) -> float | None:
    xs = [v for s, v in curve if s > skip_first]
    return statistics.fmean(xs) if xs else None


# ----------------------------------------------------------------------------- aggregation


def aggregate(results: list[dict]) -> list[dict]:
    """One row per arm: mean and a 95 % t interval over seeds of final EM, mean EM over the run, and
    the run means of the dashboard keys."""
    by_arm: dict[str, list[dict]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    rows = []
    for arm, rs in by_arm.items():
        row = {"arm": arm, "eta": rs[0]["eta"], "objective": rs[0]["objective"], "dtype": rs[0]["dtype"],
               "seeds": sorted(r["seed"] for r in rs)}
        values = {"eval_first": [r["eval_first"] for r in rs], "eval_final": [r["eval_final"] for r in rs],
                  "eval_mean": [eval_mean(r) for r in rs],
                  **{k: [_curve_mean(r["steps_curves"][k]) for r in rs] for k in STEP_KEYS}}
        for key, xs in values.items():
            row[f"{key}_mean"], row[f"{key}_spread"] = mean_spread(xs)
            row[f"{key}_ci95"] = ci95_halfwidth(xs)
        row["eval_curve_mean"] = mean_curve([r["eval_curve"] for r in rs])
        row["mismatch_k3_curve_mean"] = mean_curve([r["steps_curves"]["mismatch_k3"] for r in rs])
        rows.append(row)
    return rows


def contrasts(results: list[dict]) -> dict[str, list[dict]]:
    """Paired by seed and eta: each correction minus no correction (bf16; FP8 against FP8), and the
    fp32 control minus bf16 without correction (what the mismatch costs), FP8 against bf16 and fp32."""
    arms = {r["objective"] for r in results}
    out = {f"{a}_minus_none": c for a in ("tis", "icepop", "seq_mis", "m2po") if a in arms
           and (c := contrast(results, a=a, b="none"))}
    out |= {f"{a}_fp8_minus_none_fp8": c for a in ("tis", "icepop", "seq_mis", "m2po") if f"{a}_fp8" in arms
            and (c := contrast(results, a=f"{a}_fp8", b="none_fp8"))}
    for a, b in (("none_fp32", "none"), ("seq_mis_fp32", "none_fp32"), ("seq_mis_fp32", "seq_mis"),
                 ("none_fp8", "none"), ("none_fp32", "none_fp8")):
        if {a, b} <= arms and (c := contrast(results, a=a, b=b)):
            out[f"{a}_minus_{b}"] = c
    return out


# ----------------------------------------------------------------------------- report


def _ci(m, h, d=3) -> str:
    return "-" if m is None else (f"{m:.{d}f}" if h is None else f"{m:.{d}f} [{m - h:.{d}f}, {m + h:.{d}f}]")


def _dci(m, h) -> str:
    return "-" if m is None else (f"{m:+.3f}" if h is None else f"{m:+.3f} [{m - h:+.3f}, {m + h:+.3f}]")


def _g(x, fmt=".2g") -> str:
    return "-" if x is None else f"{x:{fmt}}"


def markdown(rows: list[dict], cons: dict[str, list[dict]]) -> str:
    head = ("| eta | arm | serving | seeds | final EM [95% CI] | mean EM over run [95% CI] | k1 / step | "
            "k3 / step [95% CI] | w p99 | w max | masked or truncated | clip fraction | response tokens |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(rows, key=lambda r: (r["eta"], list(ARMS).index(r["arm"].split("_", 1)[1]))):
        correction = ARMS[r["objective"]][0]
        opt = MASKED.get(correction)
        k3 = r["mismatch_k3_mean"]
        k3s = "-" if k3 is None else (f"{k3:.2e}" + ("" if r["mismatch_k3_ci95"] is None else
                                                      f" [{k3 - r['mismatch_k3_ci95']:.2e}, "
                                                      f"{k3 + r['mismatch_k3_ci95']:.2e}]"))
        lines.append(
            f"| {r['eta']} | {TITLES[correction]} | {r['dtype']} | {len(r['seeds'])} | "
            f"{_ci(r['eval_final_mean'], r['eval_final_ci95'])} | {_ci(r['eval_mean_mean'], r['eval_mean_ci95'])} | "
            f"{_g(r['mismatch_k1_mean'], '.2e')} | {k3s} | {_g(r['mismatch_ratio_p99_mean'], '.3f')} | "
            f"{_g(r['mismatch_ratio_max_mean'], '.2f')} | "
            f"{'-' if opt is None else _g(r[f'{opt}_mean'], '.2e')} | {_g(r['clip_fraction_mean'], '.3f')} | "
            f"{_g(r['gen_len_mean_mean'], '.1f')} |")
    out = "\n".join(lines) + "\n"
    for name, rs in cons.items():
        a, b = name.split("_minus_")
        out += (f"\n### {a} minus {b}, paired by seed\n\n| eta | seeds | final EM difference [95% CI] | "
                f"mean EM over run difference [95% CI] |\n|---|---|---|---|\n")
        for r in rs:
            eta = r["eta"] if r["eta"] != "pooled" else "mean over " + "/".join(map(str, r["etas"]))
            out += (f"| {eta} | {len(r['seeds'])} | {_dci(r['eval_final_diff_mean'], r['eval_final_diff_ci95'])} | "
                    f"{_dci(r['eval_mean_diff_mean'], r['eval_mean_diff_ci95'])} |\n")
    return out


def summary(results: list[dict], stamp: str):
    rows = aggregate(results)
    cons = contrasts(results)
    md = ("Trainer fp32; the embedded engine serves in the dtype shown. EM = held-out exact match (greedy, 256 "
          "prompts); mean EM over run = mean of the evaluations after step 0. Dashboard columns: the mean over "
          "steps of the trainer's per-step value, then the mean over seeds (k1 = mean(b - p), k3 = mean(w - 1 - "
          "log w), w = exp(p - b) on the loss tokens; at eta > 0 they include the policy lag). Intervals: 95 % "
          "Student t over seeds (per arm: of the seeds' values; contrasts: of the paired differences).\n\n"
          + markdown(rows, cons))
    return ({"task": list(TASK), "arms": rows, "contrasts": cons}, md,
            [{k: v for k, v in r.items() if not k.endswith("_curve_mean")}
             | {"results": f"mismatch_ablation_{stamp}.json"} for r in rows])


def after_run(run: Run, res: dict, work: Path) -> None:
    """Add the run's serving dtype and per-step dashboard to its result."""
    res["dtype"], res["correction"] = run.arm.dtype, run.arm.correction
    res["steps_curves"] = step_curves(work / "runs" / run.name / "metrics.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", type=sweep.names, default=list(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--etas", type=sweep.ints, default=list(ETAS))
    sweep.add_sweep_args(ap, "mismatch_ablation", seeds=SEEDS, batch_size=8, run_timeout=600.0)
    args = ap.parse_intermixed_args(argv)
    sweep.check_sweep_args(ap, args)
    try:
        build_runs(args.arms, args.etas, args.seeds)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = build_runs(args.arms, args.etas, args.seeds)
    args.overrides = [*TASK, *args.overrides]  # the task, under the user's word, in every run and server
    sweep.main("mismatch_ablation", runs, args, lambda runs, work, args: sweep.report(
        "mismatch_ablation", "Mismatch corrections under bf16 and FP8 serving", runs, work, args, summary),
        after_run=after_run)


if __name__ == "__main__":
    main()
