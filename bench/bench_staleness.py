"""The staleness ablation: held-out quality vs the staleness bound eta, per objective (recomputed or
log-linear proximal, naive PPO; with ``--preset hard`` also the decoupled objective plus each mismatch
option) and advantage estimator, over seeds, on the shipped tiny task with the real training loop
(``bench/sweep.py``). What it runs and what it found: docs/staleness_ablation.md.

    python bench/bench_staleness.py [--etas 0,1,2,4,8,16] [--objectives recompute,loglinear,naive]
        [--advantages grpo,rloo] [--preset hard] [sweep options] [KEY=VALUE ...]

Writes ``<out>/staleness_<date>.{json,md,png}`` and one row per arm to ``<out>/staleness.jsonl``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import sweep  # noqa: E402
from bench.sweep import (  # noqa: E402
    DIAGNOSTICS,
    Run,
    ci95_halfwidth,
    contrast,
    eval_mean,
    hist_stats,
    mean_curve,
    mean_spread,
)

ETAS = (0, 1, 2, 4, 8, 16)
# name -> train.ppo.prox_mode (docs/objective.md, "The proximal policy")
OBJECTIVES = {"recompute": "recompute", "loglinear": "approx", "naive": "none",
              "tis": "recompute", "icepop": "recompute", "seq_mis": "recompute", "m2po": "recompute"}
DEFAULT_OBJECTIVES = ("recompute", "loglinear", "naive")
# The decoupled objective plus one mismatch/staleness option each (docs/objective.md, "Train/inference
# mismatch and staleness corrections"), in place of the recipe's token_mis_upper (the old cap of 5).
# Values: TIS's C = 2 (as in the TIS post), IcePop's published band [0.5, 5], a sequence band
# [0.5, 2] on the geometric mean, M2PO's tau = 0.04 (its paper's default).
OBJECTIVE_LOSS = {
    "tis": ("train.ppo.loss.token_mis_upper=null", "train.ppo.loss.tis_cap=2.0"),
    "icepop": ("train.ppo.loss.token_mis_lower=0.5", "train.ppo.loss.token_mis_upper=5.0"),
    "seq_mis": ("train.ppo.loss.token_mis_upper=null", "train.ppo.loss.seq_mis_lower=0.5",
                "train.ppo.loss.seq_mis_upper=2.0"),
    "m2po": ("train.ppo.loss.token_mis_upper=null", "train.ppo.loss.m2po_tau=0.04"),
}
OBJECTIVE_TITLES = {"recompute": "decoupled, recomputed proximal", "loglinear": "decoupled, log-linear proximal",
                    "naive": "naive PPO (proximal = behaviour)", "tis": "decoupled + token TIS (C = 2)",
                    "icepop": "decoupled + IcePop [0.5, 5]", "seq_mis": "decoupled + sequence MIS [0.5, 2]",
                    "m2po": "decoupled + M2PO (tau = 0.04)"}
# The hard-task sweep: a slowly learned task (weak warm start, low learning rate), 4 minibatches, every eta,
# naive / decoupled / decoupled + each option, 5 seeds, GRPO; the design and its pilot: docs/staleness_ablation.md.
HARD_OPTIONS = ["tis", "icepop", "seq_mis", "m2po"]
PRESETS = {
    "hard": dict(etas=[0, 1, 2, 4, 8, 16], objectives=["naive", "recompute", *HARD_OPTIONS],
                 advantages=["grpo"], seeds=[1, 2, 3, 4, 5], steps=200, eval_every=25, batch_size=8,
                 overrides=["train.ppo.ppo_n_minibatches=4", "rollout.max_new_tokens=16", "train.optim.lr=5e-5",
                            "model.warm_start.steps=120"],
                 # the run order, most information first, each phase seed-major (a sweep stopped part-way has
                 # complete seeds to pair): naive vs decoupled at 0 / 4 / 16, then 1 / 2 / 8, then the options
                 plan=[(["naive", "recompute"], [0, 4, 16]), (["naive", "recompute"], [1, 2, 8]),
                       (HARD_OPTIONS, [16]), (HARD_OPTIONS, [8]), (HARD_OPTIONS, [0]), (HARD_OPTIONS, [1, 2, 4])]),
}
ADVANTAGES = ("grpo", "rloo")
SEEDS = (1, 2, 3)


@dataclass(frozen=True)
class Arm:
    eta: int
    objective: str  # a key of OBJECTIVES
    advantage: str  # grpo | rloo

    @property
    def name(self) -> str:
        return f"eta{self.eta}_{self.objective}_{self.advantage}"

    def overrides(self) -> list[str]:
        return [f"rollout.max_staleness={self.eta}", f"train.ppo.prox_mode={OBJECTIVES[self.objective]}",
                *OBJECTIVE_LOSS.get(self.objective, ()), f"train.ppo.adv_estimator={self.advantage}"]


def build_arms(etas=ETAS, objectives=DEFAULT_OBJECTIVES, advantages=ADVANTAGES) -> list[Arm]:
    for o in objectives:
        if o not in OBJECTIVES:
            raise ValueError(f"--objectives: unknown objective {o!r} (known: {', '.join(OBJECTIVES)})")
    for a in advantages:
        if a not in ADVANTAGES:
            raise ValueError(f"--advantages: unknown advantage {a!r} (known: {', '.join(ADVANTAGES)})")
    for e in etas:
        if e < 0:
            raise ValueError(f"--etas: eta must be >= 0, got {e}")
    return [Arm(e, o, a) for a in advantages for o in objectives for e in etas]


def build_runs(arms: list[Arm], seeds) -> list[Run]:
    """Seed-major: the first pass over all arms gives a complete (one-seed) table early."""
    return [Run(arm, s) for s in seeds for arm in arms]


def build_plan_runs(plan, advantages, seeds) -> list[Run]:
    """The runs of a preset's ``plan`` (a list of (objectives, etas) phases), phase by phase, each phase
    seed-major; a run listed by two phases runs once, at its first place."""
    runs: list[Run] = []
    for objectives, etas in plan:
        runs += [r for r in build_runs(build_arms(etas, objectives, advantages), seeds) if r not in runs]
    return runs


def sync_partner(result: dict, sync: dict) -> tuple[dict, str] | None:
    """The eta = 0 run a result is paired with: the same objective, advantage and seed; for a decoupled
    option arm whose objective has no eta = 0 run at all (yet), the plain decoupled objective's eta = 0
    run of that seed (the options act on the behaviour/proximal ratio, which is 1 up to the
    engine/trainer mismatch when nothing is stale). An arm is never paired half one way, half the other.
    Returns (run, objective paired with) or None."""
    own = sync.get((result["objective"], result["advantage"], result["seed"]))
    if own is not None:
        return own, result["objective"]
    if any(k[0] == result["objective"] and k[1] == result["advantage"] for k in sync):
        return None
    if result["objective"] in OBJECTIVE_LOSS and OBJECTIVES[result["objective"]] == "recompute":
        fallback = sync.get(("recompute", result["advantage"], result["seed"]))
        if fallback is not None:
            return fallback, "recompute"
    return None


def aggregate(results: list[dict]) -> list[dict]:
    """One row per arm (in first-seen order): mean and spread over seeds, the pooled staleness histogram."""
    by_arm: dict[str, list[dict]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    # paired with the synchronous run of the same objective, advantage and seed (same warm start): the
    # seeds' warm starts differ more than the arms do, so the paired difference is the sharper number
    sync = {(r["objective"], r["advantage"], r["seed"]): r for r in results if r["eta"] == 0}
    rows = []
    for arm, rs in by_arm.items():
        hist: Counter = Counter()
        for r in rs:
            hist.update({int(k): v for k, v in r["staleness_hist"].items()})
        st = hist_stats(hist)
        row = {"arm": arm, "eta": rs[0]["eta"], "objective": rs[0]["objective"], "advantage": rs[0]["advantage"],
               "seeds": sorted(r["seed"] for r in rs)}
        for key in ("eval_final", "eval_best", "trained_samples_per_s", "eval_first", "staleness_at_bound_fraction",
                    *(f"{k}_mean" for k in DIAGNOSTICS)):
            row[f"{key}_mean"], row[f"{key}_spread"] = mean_spread([r.get(key) for r in rs])
        row["eval_mean_mean"], row["eval_mean_spread"] = mean_spread([eval_mean(r) for r in rs])
        pairs = [(r, p) for r in rs if (p := sync_partner(r, sync)) is not None]
        row["sync_objective"] = pairs[0][1][1] if pairs else None
        row["sync_seeds"] = sorted(r["seed"] for r, _ in pairs)
        for key, value in (("eval_final", lambda x: x["eval_final"]), ("eval_mean", eval_mean)):
            deltas = [value(r) - value(p) for r, (p, _) in pairs]
            row[f"{key}_vs_sync_mean"], row[f"{key}_vs_sync_spread"] = mean_spread(deltas)
            row[f"{key}_vs_sync_ci95"] = ci95_halfwidth(deltas)
        row["staleness_hist"] = {str(k): v for k, v in sorted(hist.items())}
        row["staleness_mean"], row["staleness_max"] = st["mean"], st["max"]
        row["staleness_at_eta_fraction"] = hist.get(rs[0]["eta"], 0) / st["groups"] if st["groups"] else None
        row["eval_curve_mean"] = mean_curve([r["eval_curve"] for r in rs])
        rows.append(row)
    return rows


def _pm(m, s, digits=3, signed=False) -> str:
    if m is None:
        return "-"
    return f"{m:{'+' if signed else ''}.{digits}f} ± {s:.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _hist_text(hist: dict) -> str:
    n = sum(hist.values())
    return " ".join(f"{k}:{v / n:.0%}" for k, v in hist.items() if v / n >= 0.01) if n else "-"


def _ci(mean, half) -> str:
    return "-" if mean is None or half is None else f"[{mean - half:+.3f}, {mean + half:+.3f}]"


# the share of loss tokens (sequences for seq_mis) each objective's option masked or truncated
OPTION_FRACTION = {"tis": "tis_truncated_fraction", "icepop": "token_mis_masked_fraction",
                   "seq_mis": "seq_mis_masked_fraction", "m2po": "m2po_masked_fraction"}


def markdown_table(rows: list[dict]) -> str:
    head = ("| eta | objective | advantage | seeds | final EM | final EM - sync (paired) | 95% CI | mean EM over run | "
            "mean EM - sync (paired) | 95% CI | best EM | trained samples/s | staleness mean | staleness max | "
            "at bound | staleness histogram (share of trained groups) | mean(p - b) | clip fraction | "
            "option masked/truncated | mismatch k3 |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        vs = "" if r.get("sync_objective") in (None, r["objective"]) else f" (vs {r['sync_objective']} eta 0)"
        opt = OPTION_FRACTION.get(r["objective"], "token_mis_masked_fraction")
        lines.append(
            f"| {r['eta']} | {r['objective']} | {r['advantage']} | {len(r['seeds'])} | "
            f"{_pm(r['eval_final_mean'], r['eval_final_spread'])} | "
            f"{_pm(r['eval_final_vs_sync_mean'], r['eval_final_vs_sync_spread'], signed=True)}{vs} | "
            f"{_ci(r.get('eval_final_vs_sync_mean'), r.get('eval_final_vs_sync_ci95'))} | "
            f"{_pm(r.get('eval_mean_mean'), r.get('eval_mean_spread'))} | "
            f"{_pm(r.get('eval_mean_vs_sync_mean'), r.get('eval_mean_vs_sync_spread'), signed=True)}{vs} | "
            f"{_ci(r.get('eval_mean_vs_sync_mean'), r.get('eval_mean_vs_sync_ci95'))} | "
            f"{_pm(r['eval_best_mean'], r['eval_best_spread'])} | "
            f"{_pm(r['trained_samples_per_s_mean'], r['trained_samples_per_s_spread'], 1)} | "
            f"{r['staleness_mean']:.2f} | {r['staleness_max']} | {_pct(r.get('staleness_at_bound_fraction_mean'))} | "
            f"{_hist_text(r['staleness_hist'])} | "
            f"{_num(r.get('behav_kl_mean_mean'))} | {_num(r.get('clip_fraction_mean_mean'))} | "
            f"{_num(r.get(f'{opt}_mean_mean'))} | {_num(r.get('mismatch_k3_mean_mean'))} |")
    return "\n".join(lines) + "\n"


def contrast_table(rows: list[dict]) -> str:
    """The paired contrast of two objectives per eta (see :func:`contrast`)."""
    if not rows:
        return ""
    lines = [f"| eta | advantage | seeds | final EM: {rows[0]['a']} - {rows[0]['b']} | 95% CI | "
             f"mean EM over run: {rows[0]['a']} - {rows[0]['b']} | 95% CI |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        eta = r["eta"] if r["eta"] != "pooled" else "mean over " + "/".join(map(str, r["etas"]))
        lines.append(f"| {eta} | {r['advantage']} | {len(r['seeds'])} | "
                     f"{_pm(r['eval_final_diff_mean'], r['eval_final_diff_spread'], signed=True)} | "
                     f"{_ci(r['eval_final_diff_mean'], r['eval_final_diff_ci95'])} | "
                     f"{_pm(r['eval_mean_diff_mean'], r['eval_mean_diff_spread'], signed=True)} | "
                     f"{_ci(r['eval_mean_diff_mean'], r['eval_mean_diff_ci95'])} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plot


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    advs = list(dict.fromkeys(r["advantage"] for r in rows))
    etas = sorted({r["eta"] for r in rows})
    objs = list(dict.fromkeys(r["objective"] for r in rows))
    cmap = plt.get_cmap("viridis")
    colour = {e: cmap(i / max(len(etas) - 1, 1)) for i, e in enumerate(etas)}
    style = dict(zip(objs, itertools.cycle(("-", "--", ":", "-."))))
    marker = dict(zip(objs, itertools.cycle(("o", "s", "^", "d", "v", "x", "P"))))
    fig, axes = plt.subplots(2, len(advs), figsize=(7 * len(advs), 9), squeeze=False)
    for j, adv in enumerate(advs):
        ax = axes[0][j]
        for r in rows:
            if r["advantage"] != adv:
                continue
            c = r["eval_curve_mean"]
            ax.plot([s for s, _ in c], [v for _, v in c], style[r["objective"]], color=colour[r["eta"]], lw=1.3,
                    label=f"eta {r['eta']}, {r['objective']}")
        ax.set_title(f"{adv.upper()}: held-out exact match vs step (mean over seeds)")
        ax.set_xlabel("trainer step")
        ax.set_ylabel("held-out exact match (greedy)")
        ax.legend(fontsize=6, ncol=3)
        # the paired difference, which is what the analysis reads: seeds differ far more than arms do,
        # so mean ± std of the raw EM would hide every effect under the seeds' spread
        ax = axes[1][j]
        width = 0.6 / max(len(objs), 1)
        for k, o in enumerate(objs):
            sel = sorted((r for r in rows if r["advantage"] == adv and r["objective"] == o
                          and r.get("eval_mean_vs_sync_mean") is not None), key=lambda r: r["eta"])
            if not sel:
                continue
            ax.errorbar([etas.index(r["eta"]) + (k - (len(objs) - 1) / 2) * width for r in sel],
                        [r["eval_mean_vs_sync_mean"] for r in sel],
                        yerr=[r.get("eval_mean_vs_sync_ci95") or 0.0 for r in sel], ls=style[o], marker=marker[o],
                        capsize=3, label=OBJECTIVE_TITLES.get(o, o))
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(etas)))
        ax.set_xticklabels([str(e) for e in etas])
        ax.set_title(f"{adv.upper()}: mean EM over the run minus the same seed's eta 0 run (95% t CI)")
        ax.set_xlabel("eta (rollout.max_staleness)")
        ax.set_ylabel("paired difference in mean held-out EM")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary(args):
    def make(results, stamp):
        # table order: by advantage, objective (as listed) and eta, whatever order the runs ran in
        order = {o: i for i, o in enumerate(args.objectives)}
        results.sort(key=lambda r: (ADVANTAGES.index(r["advantage"]), order.get(r["objective"], len(order)),
                                    r["eta"], r["seed"]))
        rows = aggregate(results)
        contrast_rows = contrast(results)
        # each option on top of the decoupled objective against the plain decoupled objective, same eta and seed
        options = [o for o in dict.fromkeys(r["objective"] for r in results) if o not in ("naive", "recompute")]
        option_rows = {o: rows_o for o in options if (rows_o := contrast(results, a=o, b="recompute"))}
        md = ("EM = held-out exact match (greedy), mean ± std over seeds; \"- sync\": final EM minus that of the "
              "eta = 0 run with the same objective, advantage and seed (\"vs recompute eta 0\": an option arm whose "
              "own eta = 0 runs are not there yet, paired with the plain decoupled objective's); 95% CI: Student t "
              "over the paired seeds. \"mean EM over run\": the mean of the evaluations after step 0 (area under "
              "the learning curve).\n\n" + markdown_table(rows)
              + ("\n## Decoupled minus naive PPO, paired by seed\n\n" + contrast_table(contrast_rows)
                 if contrast_rows else "")
              + ("\n## Each option minus the plain decoupled objective, paired by seed\n\nAt eta = 0 an option "
                 "masks nothing, so its row there is two runs of the same algorithm: the run-to-run noise.\n\n"
                 + "\n".join(contrast_table(r) for r in option_rows.values()) if option_rows else ""))
        png = plot(rows, Path(args.out) / f"staleness_{stamp}.png")
        if png:
            print(f"plot: {png}")
        summary_rows = [{k: v for k, v in r.items() if k != "eval_curve_mean"}
                        | {"curves": f"staleness_{stamp}.json"} for r in rows]
        return ({"arms": rows, "contrast_recompute_minus_naive": contrast_rows,
                 "contrast_option_minus_recompute": option_rows}, md, summary_rows)
    return make


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a named sweep ('hard': the hard-task ablation in its plan's order); its values replace "
                         "--etas/--objectives/--seeds/--steps/--eval-every/--batch-size, KEY=VALUE adds to them")
    ap.add_argument("--etas", type=sweep.ints, default=list(ETAS))
    ap.add_argument("--objectives", type=sweep.names, default=list(DEFAULT_OBJECTIVES))
    ap.add_argument("--advantages", type=sweep.names, default=list(ADVANTAGES))
    sweep.add_sweep_args(ap, "staleness", seeds=SEEDS)
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE overrides may come before or after the flags
    args.plan = None
    if args.preset:
        for k, v in PRESETS[args.preset].items():
            setattr(args, k, v if k != "overrides" else [*v, *args.overrides])
        args.tag = args.tag or args.preset
    sweep.check_sweep_args(ap, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    arms = build_arms(args.etas, args.objectives, args.advantages)
    runs = build_plan_runs(args.plan, args.advantages, args.seeds) if args.plan else build_runs(arms, args.seeds)
    sweep.main("staleness", runs, args, lambda runs, work, args: sweep.report(
        "staleness", "Staleness ablation", runs, work, args, summary(args)))


if __name__ == "__main__":
    main()
