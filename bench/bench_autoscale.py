"""The server-count policy (``areal_fast.rollout.autoscale``) against every fixed split of the same GPUs,
in simulated GPU time at the AReaL paper's scale, with generation lengths constant or growing over the run.

    python bench/bench_autoscale.py                       # both scenarios, the split sweep, the plot
    python bench/bench_autoscale.py --scenarios growing --seeds 0,1 --steps 60
    python bench/bench_autoscale.py --dry-run             # the model constants and the planned runs

The loop is simulated as events in GPU time (``tools/sim_loop.py``) with the GPU model of
``tools/gpu_model.py`` (``decode_config``, ``train_seconds`` and the constants they cite); the
policy is the run's own (:class:`~areal_fast.rollout.autoscale.AutoscalePolicy`), fed with each simulated
step's measurements. docs/autoscale.md says what the model leaves out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.rollout.autoscale import AutoscalePolicy  # noqa: E402
from areal_fast.rollout.config import AutoscaleConfig  # noqa: E402
from bench.common import add_harness_args, csv_list, print_table, provenance, save  # noqa: E402
from tools.gpu_model import CONSTANTS, MODELS, decode_config, train_seconds  # noqa: E402
from tools.sim_loop import SCENARIOS, Loop, Scenario  # noqa: E402

ASSUMED = {
    "server_start_s": (60.0, "assumption: an SGLang server's start (weights loaded, CUDA graphs captured) "
                             "before its first weight update"),
    "trainer_resize_s": (10.0, "assumption: the trainer re-forming its process groups and resharding when its "
                               "GPUs change at a step boundary"),
    "len_ratio": (8, "answer cap / median answer length, as bench_async_speedup's 32,768 / 4,000"),
}
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "autoscale.png"


def c(name: str):
    return CONSTANTS[name][0]


def policy_config(gpus: int) -> AutoscaleConfig:
    return AutoscaleConfig(enabled=True, min_servers=1, max_servers=gpus - 1)


def run_case(model: str, gpus: int, batch: int, sc: Scenario, steps: int, seed: int, n_gen: int | None,
             start: int) -> tuple[dict, list[dict]]:
    policy = None if n_gen is not None else AutoscalePolicy(policy_config(gpus), start, shared_gpus=gpus)
    k = {**{n: v for n, (v, _) in CONSTANTS.items()}, **{n: v for n, (v, _) in ASSUMED.items()}}
    spec = MODELS[model]
    loop = Loop(spec, decode_config(spec, 1, 1.0, seed), train_seconds, k, gpus, batch, sc, steps,
                n_gen if n_gen is not None else start, seed, policy)
    s = loop.run()
    return {"arm": "fixed" if n_gen is not None else "policy", "gen_gpus": n_gen, "start_gen_gpus": start,
            **s}, loop.rows


def sweep_splits(gpus: int, coarse: int) -> list[int]:
    return list(range(coarse, gpus, coarse))


def plot(traces: dict, best: dict, gpus: int, path: Path, k: int = 1) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, axes = plt.subplots(2, len(traces), figsize=(5.5 * len(traces), 6), sharex="col", squeeze=False)
    for j, (name, rows) in enumerate(traces.items()):
        steps = [r["step"] for r in rows]
        ax = axes[0][j]
        ax.plot(steps, [r["servers"] * k for r in rows], label="policy: servers in the pool")
        ax.plot(steps, [r["target"] * k for r in rows], "--", label="policy: target")
        ax.axhline(best[name], color="gray", ls=":", label=f"best fixed split: {best[name]} of {gpus}")
        ax.set_ylabel("generation GPUs")
        ax.set_title(f"lengths {name}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax = axes[1][j]
        ax.plot(steps, [r["idle"] for r in rows], label="policy")
        ax.set_ylabel("trainer idle fraction (step)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fixed_split(args, sc: Scenario, n: int, start: int, per_split: dict) -> None:
    """The fixed split of ``n`` generation GPUs, once per seed, into ``per_split`` (skipped when done)."""
    if n in per_split or not 0 < n < args.gpus:
        return
    per_split[n] = [run_case(args.model, args.gpus, args.batch, sc, args.steps, seed, n, start)[0]
                    for seed in args.seeds]
    mean = sum(r["samples_per_s"] for r in per_split[n]) / len(per_split[n])
    print(f"{sc.name}: fixed {n * args.slice:4d} gen / {(args.gpus - n) * args.slice:4d} train: "
          f"{mean * args.slice:8.2f} samples/s", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1.5B", choices=list(MODELS))
    ap.add_argument("--gpus", type=int, default=128, help="GPUs shared by servers and trainer (the paper: 128)")
    ap.add_argument("--batch", type=int, default=c("batch_prompts"), help="prompts a step (groups of 16)")
    ap.add_argument("--slice", type=int, default=4,
                    help="simulate GPUS / SLICE GPUs with BATCH / SLICE prompts (bench_async_speedup's slice: the "
                         "same per-GPU load, SLICE times fewer events); rates are reported for the whole setup")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--scenarios", type=csv_list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--seeds", type=csv_list(cast=int), default=[0])
    ap.add_argument("--coarse", type=int, default=2, help="the sweep's grid of generation GPUs (of the slice)")
    ap.add_argument("--fine", type=int, default=2, help="then every count within this of the grid's best")
    ap.add_argument("--start", type=float, default=0.5, help="the policy's first split (fraction of GPUs)")
    ap.add_argument("--plot", default=str(DOCS_PNG), help="the PNG of the policy's trajectory ('' = none)")
    add_harness_args(ap, dry_run="print the constants and the planned runs, run nothing")
    args = ap.parse_args(argv)
    if args.gpus % args.slice or args.batch % args.slice:
        raise SystemExit(f"--slice {args.slice}: must divide --gpus {args.gpus} and --batch {args.batch}")
    full_gpus, full_batch = args.gpus, args.batch
    args.gpus, args.batch = args.gpus // args.slice, args.batch // args.slice
    print("constants (tools/gpu_model.py) and this bench's assumptions:")
    for k in ("len_sigma", "prompt_tokens", "group_size", "eta", "sync_fixed_s", "nccl_bytes_per_s", "train_mfu"):
        print(f"  {k} = {c(k)}  [{CONSTANTS[k][1]}]")
    for k, (v, why) in ASSUMED.items():
        print(f"  {k} = {v}  [{why}]")
    start = max(1, round(args.start * args.gpus))  # of the slice
    if args.dry_run:
        for s in args.scenarios:
            print(f"[dry-run] {s}: fixed splits {sweep_splits(args.gpus, args.coarse)} (+ fine +-{args.fine}), "
                  f"policy from {start}; seeds {args.seeds}; {args.steps} steps")
        return
    prov = provenance(native=False)
    rows, traces, best_split = [], {}, {}
    for sname in args.scenarios:
        sc = SCENARIOS[sname]
        per_split: dict[int, list[dict]] = {}
        for n in sweep_splits(args.gpus, args.coarse):
            fixed_split(args, sc, n, start, per_split)
        mean_of = {n: sum(r["samples_per_s"] for r in v) / len(v) for n, v in per_split.items()}
        top = max(mean_of, key=mean_of.get)
        for n in range(top - args.fine, top + args.fine + 1):
            fixed_split(args, sc, n, start, per_split)
        mean_of = {n: sum(r["samples_per_s"] for r in v) / len(v) for n, v in per_split.items()}
        best = max(mean_of, key=mean_of.get)
        pol, trace = [], None
        for seed in args.seeds:
            res, tr = run_case(args.model, args.gpus, args.batch, sc, args.steps, seed, None, start)
            pol.append(res)
            trace = trace or tr
        pmean = sum(r["samples_per_s"] for r in pol) / len(pol)
        traces[sname], best_split[sname] = trace, best
        print(f"{sname}: policy {pmean * args.slice:8.2f} samples/s; best fixed {best * args.slice} gen: "
              f"{mean_of[best] * args.slice:8.2f} "
              f"({pmean / mean_of[best] - 1:+.1%}); {pol[0]['changes']} changes")
        common = {"scenario": sname, "model": MODELS[args.model].name, "gpus": full_gpus, "batch_prompts": full_batch,
                  "slice": args.slice, "simulated_gpus": args.gpus, "simulated_batch_prompts": args.batch,
                  "steps": args.steps, "seeds": args.seeds, "cap_start": sc.cap_start, "cap_end": sc.cap_end,
                  **{k: v for k, (v, _) in ASSUMED.items()}}
        k = args.slice  # the slice's counts and rates, as the whole setup's
        rows.append({**common, "kind": "summary", "policy_samples_per_s": pmean * k,
                     "best_fixed_gen_gpus": best * k, "best_fixed_samples_per_s": mean_of[best] * k,
                     "policy_vs_best_fixed": pmean / mean_of[best] - 1,
                     "policy_vs_worst_fixed": pmean / min(mean_of.values()) - 1,
                     "splits_swept": [n * k for n in sorted(mean_of)],
                     "fixed_samples_per_s": {str(n * k): mean_of[n] * k for n in sorted(mean_of)},
                     "policy_changes": pol[0]["changes"], "policy_staleness_max": max(r["staleness_max"] for r in pol),
                     "policy_trainer_idle_fraction": sum(r["trainer_idle_fraction"] for r in pol) / len(pol),
                     "best_fixed_trainer_idle_fraction":
                         sum(r["trainer_idle_fraction"] for r in per_split[best]) / len(per_split[best]),
                     "policy_start_gen_gpus": start * k,
                     "policy_trace": [{"step": r["step"], "gen_gpus": r["servers"] * k,
                                       "target_gen_gpus": r["target"] * k,
                                       "trainer_gpus": r["trainer_gpus"] * k, "idle": r["idle"],
                                       "gen_len_mean": r["gen_len_mean"], "staleness_mean": r["staleness_mean"]}
                                      for r in trace]})
    print_table([{k: v for k, v in r.items() if not isinstance(v, list | dict)} for r in rows])
    if args.plot and traces:
        p = plot(traces, {n: b * args.slice for n, b in best_split.items()}, full_gpus, Path(args.plot), args.slice)
        if p:
            print(f"plot: {p}")
    save("autoscale", rows, args, prov)
    if not getattr(args, "no_results", False):
        print(json.dumps({r["scenario"]: round(r["policy_vs_best_fixed"], 4) for r in rows}))


if __name__ == "__main__":
    main()
