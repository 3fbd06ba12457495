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
    run_overrides,
    summarise_run,
)

__all__ = ["Run", "contrast", "run_overrides", "summarise_run", "ci95_halfwidth"]
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
# The hard-task sweep: a task still being learned after 200 steps at eta 0, 4 optimizer
# steps per batch as AReaL does (so the decoupled clip acts from the second minibatch on), every eta,
# naive / decoupled / decoupled + each option, 5 seeds, GRPO. The task is the shipped reversal with a
# weak warm start (120 supervised steps instead of 350: held-out EM ~0.19 at step 0) and a lower RL
# learning rate (5e-5 instead of 2e-4), so RL climbs slowly (pilot: 0.19 -> 0.31 -> 0.34 at steps
# 0 / 25 / 50); answers are at most 12 characters, so max_new_tokens 16 (cheaper runaway samples).
# The earlier design (8-20 character strings) did not learn at all in 250 steps (docs/staleness_ablation.md).
HARD_OPTIONS = ["tis", "icepop", "seq_mis", "m2po"]
PRESETS = {
    "hard": dict(etas=[0, 1, 2, 4, 8, 16], objectives=["naive", "recompute", *HARD_OPTIONS],
                 advantages=["grpo"], seeds=[1, 2, 3, 4, 5], steps=200, eval_every=25, batch_size=8,
                 overrides=["train.ppo.ppo_n_minibatches=4", "rollout.max_new_tokens=16", "train.optim.lr=5e-5",
                            "model.warm_start.steps=120"],
                 # The run order, most information first; each phase is seed-major (all its arms for seed 1,
                 # then seed 2, ...), so a sweep stopped part-way has complete seeds to pair. First the paper's
                 # contrast (naive vs decoupled) at eta 0 / 4 / 16 (synchronous, the paper's naive-PPO collapse,
                 # the extreme), then at 1 / 2 / 8; then the options where they can act (eta 16, then 8), their
                 # own eta 0 (until then they are paired with the decoupled eta 0 run), and the rest.
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


def report(runs: list[Run], work: Path, out: Path, args, prov: dict, wall_s: float | None) -> Path | None:
    results = load_results(runs, work)
    if not results:
        return None
    if wall_s is None and (work / "sweep_wall.json").is_file():  # --report-only after a complete sweep
        wall_s = json.loads((work / "sweep_wall.json").read_text())["wall_s"]
    if (work / "provenance.json").is_file():  # where and on what commit the runs ran, not where this reports
        prov = json.loads((work / "provenance.json").read_text())
    # table order: by advantage, objective (as listed) and eta, whatever order the runs ran in
    order = {o: i for i, o in enumerate(args.objectives)}
    results.sort(key=lambda r: (ADVANTAGES.index(r["advantage"]), order.get(r["objective"], len(order)), r["eta"],
                                r["seed"]))
    rows = aggregate(results)
    contrast_rows = contrast(results)
    # each option on top of the decoupled objective against the plain decoupled objective, same eta and seed
    options = [o for o in dict.fromkeys(r["objective"] for r in results) if o not in ("naive", "recompute")]
    option_rows = {o: rows_o for o in options if (rows_o := contrast(results, a=o, b="recompute"))}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M") + (f"_{args.tag}" if args.tag else "")
    out.mkdir(parents=True, exist_ok=True)
    key = json.loads((work / "sweep.json").read_text())
    res = {"date": stamp, "provenance": prov, "sweep": key, "recipe_commit": recipe_commit(args.config),
           "runs_done": len(results), "runs_planned": len(runs), "sweep_wall_s": wall_s,
           "sum_run_wall_s": sum(r["wall_s"] for r in results),
           "arms": rows, "contrast_recompute_minus_naive": contrast_rows,
           "contrast_option_minus_recompute": option_rows, "runs": results}
    (out / f"staleness_{stamp}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = (f"# Staleness ablation, {stamp} UTC\n\nRecipe `{Path(args.config).name}` at {res['recipe_commit']}; "
          f"{key['steps']} steps x {results[0].get('batch_size')} groups x {results[0].get('group_size')} samples per "
          f"run, eval every {key['eval_every']}; overrides {key['overrides'] or 'none'}; "
          f"{len(results)}/{len(runs)} runs; sweep wall time "
          f"{'-' if wall_s is None else f'{wall_s / 60:.1f} min'} (sum of run times "
          f"{res['sum_run_wall_s'] / 60:.1f} min); commit {prov.get('commit')}, "
          f"{prov.get('cpu_count')} CPUs.\n\nEM = held-out exact match (greedy), mean ± std over seeds; \"- sync\": "
          f"final EM minus that of the eta = 0 run with the same objective, advantage and seed (\"vs recompute "
          f"eta 0\": an option arm whose own eta = 0 runs are not there yet, paired with the plain decoupled "
          f"objective's); 95% CI: Student t over the paired seeds. \"mean EM over run\": the mean of the "
          f"evaluations after step 0 (area under the learning curve).\n\n"
          + markdown_table(rows)
          + ("\n## Decoupled minus naive PPO, paired by seed\n\n" + contrast_table(contrast_rows)
             if contrast_rows else "")
          + ("\n## Each option minus the plain decoupled objective, paired by seed\n\nAt eta = 0 an option "
             "masks nothing, so its row there is two runs of the same algorithm: the run-to-run noise.\n\n"
             + "\n".join(contrast_table(r) for r in option_rows.values()) if option_rows else ""))
    (out / f"staleness_{stamp}.md").write_text(md)
    png = plot(rows, out / f"staleness_{stamp}.png")
    summary_rows = [{k: v for k, v in r.items() if k != "eval_curve_mean"} | {"curves": f"staleness_{stamp}.json"}
                    for r in rows]
    append_rows("staleness", summary_rows, out, prov)
    print(md)
    print(f"results: {out / f'staleness_{stamp}.json'}, .md" + (f", {png}" if png else ""))
    return out / f"staleness_{stamp}.json"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a named sweep (etas, objectives, advantages, seeds, steps, eval-every and overrides); "
                         "'hard': the hard-task ablation, in its plan's order (most information first). The "
                         "preset's values replace --etas/--objectives/--seeds/--steps/--eval-every/--batch-size; "
                         "KEY=VALUE overrides are added after its own")
    ap.add_argument("--etas", type=_ints, default=list(ETAS))
    ap.add_argument("--objectives", type=_names, default=list(DEFAULT_OBJECTIVES))
    ap.add_argument("--advantages", type=_names, default=list(ADVANTAGES))
    ap.add_argument("--seeds", type=_ints, default=list(SEEDS))
    ap.add_argument("--steps", type=int, default=40, help="trainer steps per run (the same for every arm)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="train.batch_size (groups per step) of every run (default: the recipe's)")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps (and at 0, end)")
    ap.add_argument("--servers", choices=("shared", "per-run"), default="shared",
                    help="shared: one embedded engine per seed, reset before each run (saves 6-11 s a run); "
                         "per-run: run_train launches its own server every run")
    ap.add_argument("--run-timeout", type=float, default=900.0,
                    help="seconds after which a run that has not ended is stopped and counted as failed")
    ap.add_argument("--work", default="/tmp/areal_bench_staleness", help="run directories and per-run results")
    ap.add_argument("--resume", metavar="DIR", help="continue the sweep in DIR, skipping finished runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the table, JSON and plot go")
    ap.add_argument("--tag", default="", help="suffix of the result files' names (staleness_<date>_<tag>.*)")
    ap.add_argument("--report-only", action="store_true",
                    help="write the table and plot from the work dir's results, run nothing")
    add_harness_args(ap, results=False, dry_run="print the run list and each run's overrides, run nothing")
    ap.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the recipe for every run")
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE overrides may come before or after the flags
    args.plan = None
    if args.preset:
        preset = PRESETS[args.preset]
        for k, v in preset.items():
            setattr(args, k, v if k != "overrides" else [*v, *args.overrides])
        args.tag = args.tag or args.preset
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        ap.error(f"--tag must be letters, digits, '-' or '_', got {args.tag!r}")
    if args.eval_every < 1:
        ap.error(f"--eval-every must be >= 1, got {args.eval_every}")
    if not args.seeds:
        ap.error("--seeds: at least one seed")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    arms = build_arms(args.etas, args.objectives, args.advantages)
    runs = build_plan_runs(args.plan, args.advantages, args.seeds) if args.plan else build_runs(arms, args.seeds)
    work = Path(args.resume or args.work)
    if args.dry_run:
        print_dry_run("staleness", [dict(run=r.name, overrides=" ".join(run_overrides(r, args.steps, args.eval_every,
                                                                                   args.overrides, args.batch_size)))
                                    for r in runs])
        print(f"recipe: {args.config} ({recipe_commit(args.config)}); work dir {work}")
        return
    key = sweep_key(args.config, args.steps, args.eval_every, args.overrides, args.servers, args.batch_size)
    refuse_dirty(args.out)
    prov = provenance()
    if args.report_only:
        report(runs, work, Path(args.out), args, prov, None)
        return
    open_work_dir(work, key, resume=bool(args.resume))
    if not (work / "provenance.json").is_file():
        write_json_atomic(work / "provenance.json", prov)
    todo = pending(runs, work)
    print(f"staleness sweep: {len(runs)} runs, {len(runs) - len(todo)} already finished, {len(todo)} to run; "
          f"work dir {work}", flush=True)
    _preload()
    t_start = time.perf_counter()
    durations, failed = [], []
    servers: SharedServers | None = None
    t_warm = time.perf_counter()
    models = build_warm_starts(args.config, args.overrides, work, sorted({r.seed for r in todo}))
    print(f"warm starts of seeds {sorted(models)} ready in {time.perf_counter() - t_warm:.0f} s", flush=True)
    try:
        for i, run in enumerate(todo, 1):
            t0 = time.perf_counter()
            overrides = run_overrides(run, args.steps, args.eval_every, args.overrides, args.batch_size)
            ok = False
            try:
                model = models[run.seed]
                if args.servers == "shared":
                    if servers is not None and servers.seed != run.seed:
                        servers.close()
                        servers = None
                    if servers is None:
                        servers = SharedServers(args.config, args.overrides, work, run.seed, model)
                    try:
                        servers.reset()
                    except Exception as e:  # noqa: BLE001 - a server died or hangs: start them again, once
                        print(f"{run.name}: server reset failed ({e}); starting the servers again", flush=True)
                        servers.close()
                        servers = SharedServers(args.config, args.overrides, work, run.seed, model)
                        servers.reset()
                    overrides = [*overrides, servers.override()]
                ok = execute(run, args.config, overrides, work, servers.api_key if servers else None,
                             args.run_timeout)
            except Exception as e:  # noqa: BLE001 - one run's failure is reported, the sweep goes on
                print(f"{run.name}: {type(e).__name__}: {e}", flush=True)
                if servers is not None:  # start the seed's servers afresh for the next run
                    servers.close()
                    servers = None
            durations.append(time.perf_counter() - t0)
            left = (len(todo) - i) * statistics.fmean(durations)
            eta_clock = (datetime.datetime.now() + datetime.timedelta(seconds=left)).strftime("%H:%M")
            if ok:
                r = json.loads(result_path(work, run).read_text())
                what = (f"EM {r['eval_first']:.3f} -> {r['eval_final']:.3f} (best {r['eval_best']:.3f}), staleness "
                        f"mean {r['staleness_mean']:.2f} max {r['staleness_max']}, "
                        f"{r['trained_samples_per_s']:.0f} samples/s")
            else:
                failed.append(run.name)
                what = f"FAILED (log: {work / 'logs' / (run.name + '.log')}); rerun with --resume {work}"
            print(f"[{i}/{len(todo)}] {run.name}: {what}; {durations[-1]:.0f} s; sweep done in ~{left / 60:.0f} "
                  f"min (~{eta_clock})", flush=True)
    finally:
        if servers is not None:
            servers.close()
    wall = time.perf_counter() - t_start
    print(f"sweep wall time {wall / 60:.1f} min; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}",
          flush=True)
    complete = not failed and len(todo) == len(runs)
    if complete:
        write_json_atomic(work / "sweep_wall.json", {"wall_s": wall, "runs": len(runs)})
    report(runs, work, Path(args.out), args, prov, wall if complete else None)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
