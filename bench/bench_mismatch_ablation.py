"""The mismatch corrections under a real train/inference mismatch: the embedded engine serves in
bfloat16 while the trainer computes in fp32, and each correction of the decoupled loss is trained
against none, with the real training loop.

    python bench/bench_mismatch_ablation.py [--arms none,tis,icepop,seq_mis,m2po,none_fp32] [--etas 0,4]
        [--seeds 1,2,3] [--steps N] [--eval-every K] [--batch-size B] [--work DIR | --resume DIR]
        [--out bench/results] [--tag T] [--report-only] [--dry-run] [KEY=VALUE ...]

Every run is one ``areal-fast train`` run of ``examples/tiny_reverse.yaml`` (``run_train``: embedded
engine server, controller, PPO actor, weight sync after every step), driven by the machinery of
``bench_staleness.py`` (forked child per run, warm start shared per seed, one server per seed and
serving dtype reset between runs, ``--resume``). The task is the recipe's reversal with longer
strings (``TASK``: 6-16 characters, so 7-17 generated tokens with the end token, against the recipe's
~4), where a per-token mismatch has more tokens to add up over. Per arm:

    rollout.server_args   = ["--dtype", "bfloat16"]  (the control: "float32", no mismatch)
    rollout.max_staleness = eta
    train.ppo.prox_mode   = recompute (the decoupled objective; its w = exp(p - b) is the
                            train/inference ratio at eta 0, times the policy-lag ratio at eta > 0)
    train.ppo.loss.*      = the correction (CORRECTIONS), the recipe's token_mis_upper removed

``--arms`` may add ``seq_mis_fp32`` (sequence MIS with fp32 serving: does what it does need the
mismatch?). ``--resume DIR`` with more seeds or arms runs only the new runs; the report then covers
every run of the given lists, and its wall time is the sum of the invocations' (``invocations.jsonl``).

Per run the result holds the held-out exact match curve and, per trainer step, what the trainer's
mismatch dashboard logged (``train/mismatch_k1``, ``train/mismatch_k3``, the p99 / max of w) and the
share of loss tokens each correction masked or truncated.

Writes ``<out>/mismatch_ablation_<date>.json`` (runs with curves, per-arm aggregates, paired
contrasts) and ``.md`` (the tables), and appends one row per arm to ``<out>/mismatch_ablation.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_staleness import (  # noqa: E402
    DEFAULT_CONFIG,
    OBJECTIVE_LOSS,
    ROOT,
    RUN_SETTINGS,
    SharedServers,
    _ints,
    _preload,
    build_warm_starts,
    ci95_halfwidth,
    contrast,
    eval_mean,
    execute,
    load_results,
    mean_curve,
    mean_spread,
    open_work_dir,
    pending,
    recipe_commit,
    result_path,
    sweep_key,
    write_json_atomic,
)
from bench.common import add_harness_args, append_rows, print_dry_run, provenance, refuse_dirty  # noqa: E402

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
        "seq_mis_fp32": ("seq_mis", "float32")}
DEFAULT_ARMS = tuple(a for a in ARMS if a != "seq_mis_fp32")
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
        return [f'rollout.server_args=["--dtype", "{self.dtype}"]']

    def overrides(self) -> list[str]:
        return [*self.server_overrides(), f"rollout.max_staleness={self.eta}", "train.ppo.prox_mode=recompute",
                *CORRECTIONS[self.correction], f"train.ppo.adv_estimator={self.advantage}"]


@dataclass(frozen=True)
class Run:
    arm: Arm
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}_s{self.seed}"


def build_runs(arms, etas, seeds) -> list[Run]:
    """Seed-major (complete seeds first); within a seed the bf16 arms, then the fp32 ones (one server
    start per seed and dtype)."""
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"--arms: unknown arm {a!r} (known: {', '.join(ARMS)})")
    for e in etas:
        if e < 0:
            raise ValueError(f"--etas: eta must be >= 0, got {e}")
    order = sorted(arms, key=lambda a: ARMS[a][1] == "float32")
    return [Run(Arm(e, a), s) for s in seeds for a in order for e in etas]


def run_overrides(run: Run, steps: int, eval_every: int, extra=(), batch_size: int | None = None) -> list[str]:
    """The dotted overrides of one run: the sweep's settings, the task, the user's, the arm's, the seed."""
    batch = [] if batch_size is None else [f"train.batch_size={batch_size}"]
    return [*RUN_SETTINGS, f"experiment.total_steps={steps}", f"eval.every_steps={eval_every}", *batch, *TASK,
            *extra, *run.arm.overrides(), f"experiment.seed={run.seed}"]


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
    """Paired by seed and eta: each correction minus no correction (bf16), and the fp32 control minus
    bf16 without correction (what the mismatch costs)."""
    arms = {r["objective"] for r in results}
    out = {f"{a}_minus_none": c for a in ("tis", "icepop", "seq_mis", "m2po") if a in arms
           and (c := contrast(results, a=a, b="none"))}
    for a, b in (("none_fp32", "none"), ("seq_mis_fp32", "none_fp32"), ("seq_mis_fp32", "seq_mis")):
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


def report(runs: list[Run], work: Path, out: Path, args, prov: dict, wall_s: float | None) -> Path | None:
    results = load_results(runs, work)
    if not results:
        return None
    if wall_s is None and (work / "invocations.jsonl").is_file() and not pending(runs, work):
        # a sweep finished over several invocations (--resume, more seeds or arms): the sum of their walls
        wall_s = sum(json.loads(x)["wall_s"] for x in (work / "invocations.jsonl").read_text().splitlines() if x)
    if (work / "provenance.json").is_file():
        prov = json.loads((work / "provenance.json").read_text())
    rows = aggregate(results)
    cons = contrasts(results)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M") + (f"_{args.tag}" if args.tag else "")
    key = json.loads((work / "sweep.json").read_text())
    # a sweep run from an exported copy (no .git) has the recipe of the commit its provenance names
    rc = recipe_commit(args.config) if prov.get("commit_from", "git") == "git" else f"commit {prov.get('commit')}"
    res = {"date": stamp, "provenance": prov, "sweep": key, "task": list(TASK), "recipe_commit": rc,
           "runs_done": len(results), "runs_planned": len(runs), "sweep_wall_s": wall_s,
           "sum_run_wall_s": sum(r["wall_s"] for r in results), "arms": rows, "contrasts": cons, "runs": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"mismatch_ablation_{stamp}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = (f"# Mismatch corrections under bf16 serving, {stamp} UTC\n\nRecipe `{Path(args.config).name}` at "
          f"{res['recipe_commit']} with {' '.join(TASK)}; {key['steps']} steps x {results[0].get('batch_size')} groups "
          f"x {results[0].get('group_size')} samples per run, eval every {key['eval_every']}; overrides "
          f"{key['overrides'] or 'none'}; {len(results)}/{len(runs)} runs; sweep wall time "
          f"{'-' if wall_s is None else f'{wall_s / 60:.1f} min'} (sum of run times "
          f"{res['sum_run_wall_s'] / 60:.1f} min); commit {prov.get('commit')}, {prov.get('cpu_count')} CPUs.\n\n"
          "Trainer fp32; the embedded engine serves in the dtype shown. EM = held-out exact match (greedy, 256 "
          "prompts); mean EM over run = mean of the evaluations after step 0. Dashboard columns: the mean over "
          "steps of the trainer's per-step value, then the mean over seeds (k1 = mean(b - p), k3 = mean(w - 1 - "
          "log w), w = exp(p - b) on the loss tokens; at eta > 0 they include the policy lag). Intervals: 95 % "
          "Student t over seeds (per arm: of the seeds' values; contrasts: of the paired differences).\n\n"
          + markdown(rows, cons))
    (out / f"mismatch_ablation_{stamp}.md").write_text(md)
    append_rows("mismatch_ablation", [{k: v for k, v in r.items() if not k.endswith("_curve_mean")}
                                      | {"results": f"mismatch_ablation_{stamp}.json"} for r in rows], out, prov)
    print(md)
    print(f"results: {out / f'mismatch_ablation_{stamp}.json'}, .md")
    return out / f"mismatch_ablation_{stamp}.json"


# ----------------------------------------------------------------------------- main


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--arms", type=_names, default=list(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--etas", type=_ints, default=list(ETAS))
    ap.add_argument("--seeds", type=_ints, default=list(SEEDS))
    ap.add_argument("--steps", type=int, default=40, help="trainer steps per run")
    ap.add_argument("--batch-size", type=int, default=8, help="train.batch_size (groups per step)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--run-timeout", type=float, default=600.0)
    ap.add_argument("--work", default="/tmp/areal_bench_mismatch_ablation")
    ap.add_argument("--resume", metavar="DIR")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--report-only", action="store_true")
    add_harness_args(ap, results=False, dry_run="print the runs and their overrides, run nothing")
    ap.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the recipe for every run")
    args = ap.parse_intermixed_args(argv)
    if args.steps < 1 or args.eval_every < 1 or args.batch_size < 1:
        ap.error("--steps, --eval-every and --batch-size must be >= 1")
    if not args.seeds:
        ap.error("--seeds: at least one seed")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        ap.error(f"--tag must be letters, digits, '-' or '_', got {args.tag!r}")
    try:
        build_runs(args.arms, args.etas, args.seeds)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = build_runs(args.arms, args.etas, args.seeds)
    work = Path(args.resume or args.work)
    if args.dry_run:
        print_dry_run("mismatch_ablation", [dict(run=r.name, overrides=" ".join(
            run_overrides(r, args.steps, args.eval_every, args.overrides, args.batch_size))) for r in runs])
        return
    key = sweep_key(args.config, args.steps, args.eval_every, [*TASK, *args.overrides], "shared", args.batch_size)
    refuse_dirty(args.out)
    prov = provenance()
    if args.report_only:
        report(runs, work, Path(args.out), args, prov, None)
        return
    open_work_dir(work, key, resume=bool(args.resume))
    if not (work / "provenance.json").is_file():
        write_json_atomic(work / "provenance.json", prov)
    todo = pending(runs, work)
    print(f"mismatch ablation: {len(runs)} runs, {len(todo)} to run; work dir {work}", flush=True)
    _preload()
    t_start = time.perf_counter()
    base = [*TASK, *args.overrides]
    models = build_warm_starts(args.config, base, work, sorted({r.seed for r in todo}))
    print(f"warm starts ready in {time.perf_counter() - t_start:.0f} s", flush=True)
    servers, server_key, durations, failed = None, None, [], []
    try:
        for i, run in enumerate(todo, 1):
            t0 = time.perf_counter()
            ok = False
            try:
                if server_key != (run.seed, run.arm.dtype):
                    if servers is not None:
                        servers.close()
                    servers = None
                    server_key = (run.seed, run.arm.dtype)
                if servers is None:
                    servers = SharedServers(args.config, [*base, *run.arm.server_overrides()], work, run.seed,
                                            models[run.seed])
                servers.reset()
                overrides = [*run_overrides(run, args.steps, args.eval_every, args.overrides, args.batch_size),
                             servers.override()]
                ok = execute(run, args.config, overrides, work, servers.api_key, args.run_timeout)
                if ok:  # add the run's serving dtype and per-step dashboard to its result
                    res = json.loads(result_path(work, run).read_text())
                    res["dtype"], res["correction"] = run.arm.dtype, run.arm.correction
                    res["steps_curves"] = step_curves(work / "runs" / run.name / "metrics.jsonl")
                    write_json_atomic(result_path(work, run), res)
            except Exception as e:  # noqa: BLE001 - one run's failure is reported, the sweep goes on
                print(f"{run.name}: {type(e).__name__}: {e}", flush=True)
                ok = False
                if servers is not None:
                    servers.close()
                    servers = None
            durations.append(time.perf_counter() - t0)
            left = (len(todo) - i) * statistics.fmean(durations)
            if ok:
                what = (f"EM {res['eval_first']:.3f} -> {res['eval_final']:.3f}, k3/step "
                        f"{_g(_curve_mean(res['steps_curves']['mismatch_k3']), '.2e')}")
            else:
                failed.append(run.name)
                what = f"FAILED (log: {work / 'logs' / (run.name + '.log')})"
            print(f"[{i}/{len(todo)}] {run.name}: {what}; {durations[-1]:.0f} s; ~{left / 60:.0f} min left",
                  flush=True)
    finally:
        if servers is not None:
            servers.close()
    wall = time.perf_counter() - t_start
    print(f"sweep wall time {wall / 60:.1f} min; {len(failed)} failed", flush=True)
    with open(work / "invocations.jsonl", "a") as f:
        f.write(json.dumps({"wall_s": wall, "runs": len(todo), "failed": len(failed)}) + "\n")
    report(runs, work, Path(args.out), args, prov, None)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
