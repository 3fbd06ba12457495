"""Asynchronous vs synchronous RL throughput in simulated GPU time, at the AReaL paper's scale: the real
Controller, staleness gate and rollout client against simulated SGLang servers (``tools/sim_sglang.py``),
the trainer and weight sync simulated; ``--pause-modes``: GPU seconds lost per update per pause mode.
The arms, the 1/16 slice and the constants' sources: docs/scale.md and docs/pause_modes.md.

    python bench/bench_async_speedup.py                 # paper setups + small setups, split sweep
    python bench/bench_async_speedup.py --setups 1.5B-128 --splits 0.75
    python bench/bench_async_speedup.py --dry-run       # the model constants and the planned runs

Every constant and its source is in :data:`CONSTANTS` and printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_controller_scale import RunSpec, run_controller  # noqa: E402
from bench.common import add_harness_args, csv_list, print_table, provenance, save  # noqa: E402
from tools import sim_sglang as sim  # noqa: E402
from tools.gpu_model import CONSTANTS, MODELS, c, decode_config, train_seconds  # noqa: E402

# --pause-modes: the async arm once per mode (docs/pause_modes.md). in_place runs the servers with
# --disable-overlap-schedule --disable-radix-cache (what it needs for exact versions on SGLang) and so
# pays no_overlap_slowdown; in_place_ideal is in_place at no such cost (the embedded engine, or an
# SGLang that labelled the overlapped step right): the bound of what keeping the KV saves.
PAUSE_ARMS = {"abort": ("abort", None), "retract": ("retract", None), "in_place": ("in_place", "no_overlap_slowdown"),
              "in_place_ideal": ("in_place", 1.0)}


@dataclass(frozen=True)
class Setup:
    name: str
    model: str
    gpus_full: int  # the setup's GPUs
    slice_div: int  # simulated as gpus_full / slice_div GPUs with batch / slice_div prompts
    batch_prompts: int  # of the full setup

    @property
    def gpus(self) -> int:
        return self.gpus_full // self.slice_div

    @property
    def batch(self) -> int:
        return self.batch_prompts // self.slice_div


SETUPS = {
    "1.5B-128": Setup("1.5B, 16 nodes x 8 GPUs", "1.5B", 128, 16, 512),
    "7B-192": Setup("7B, 24 nodes x 8 GPUs", "7B", 192, 16, 512),
    "1.5B-8": Setup("1.5B, 8 GPUs", "1.5B", 8, 1, 32),
    "1.5B-4": Setup("1.5B, 4 GPUs", "1.5B", 4, 1, 16),
    "7B-8": Setup("7B, 8 GPUs", "7B", 8, 1, 32),
}


def plan(setup: Setup, splits: list[float], pause_modes: list[str] | None = None) -> list[dict]:
    """The sync arm, then the async arm per split and (with ``pause_modes``) per pause arm."""
    runs = [{"setup": setup, "arm": "sync", "n_gen": setup.gpus, "n_train": setup.gpus, "eta": 0, "pause": None}]
    seen = set()
    for f in splits:
        n_gen = min(setup.gpus - 1, max(1, round(f * setup.gpus)))
        if n_gen not in seen:
            seen.add(n_gen)
            for mode in pause_modes or [None]:
                runs.append({"setup": setup, "arm": "async", "n_gen": n_gen, "n_train": setup.gpus - n_gen,
                             "eta": c("eta"), "pause": mode})
    return runs


def apply_pause_arm(cfg: sim.SimConfig, arm: str | None) -> str | None:
    """Set the servers' flags for pause arm ``arm`` (:data:`PAUSE_ARMS`); returns the client's pause mode."""
    if arm is None:
        return None
    mode, slowdown = PAUSE_ARMS[arm]
    if mode == "in_place":
        cfg.disable_overlap_schedule = cfg.disable_radix_cache = True
        cfg.no_overlap_slowdown = c(slowdown) if isinstance(slowdown, str) else slowdown
    return mode


def update_costs(row: dict, setup: Setup, n_gen: int, slowdown: float, step_s: float, k: float) -> dict:
    """GPU seconds each weight update (one per step) costs the whole setup (all its generation GPUs),
    from the simulator's counters: prefill computed again (retracted or resubmitted requests: every
    pause comes after the first step, in steady state) and, where the servers run without the
    overlap scheduler, the decode time that costs in a steady-state step (the run's decode-busy
    fraction x generation GPUs x step time x (1 - 1/slowdown))."""
    updates = row["pauses"] / n_gen  # the simulator counts one pause per server
    if updates <= 0:
        return {}
    prefill = row["recomputed_prefill_s"] * setup.slice_div / updates
    busy = row["decode_busy_s"] / (n_gen * row["wall_s"] * k)  # of the servers' model time, whole run
    overlap = (1 - 1 / slowdown) * busy * n_gen * setup.slice_div * step_s
    return {"updates": updates, "running_per_update": row["running_at_pauses"] * setup.slice_div / updates,
            "recomputed_prefill_tokens_per_update": row["recomputed_prefill_tokens"] * setup.slice_div / updates,
            "recomputed_prefill_gpu_s_per_update": prefill, "decode_busy_fraction": busy,
            "no_overlap_gpu_s_per_update": overlap, "lost_gpu_s_per_update": prefill + overlap,
            "lost_fraction_of_generation": (prefill + overlap) / (n_gen * setup.slice_div * step_s)}


async def run_one(run: dict, args) -> dict:
    setup, model = run["setup"], MODELS[run["setup"].model]
    s, k = args.tokens_per_token, args.time_scale
    cfg = decode_config(model, s, k, args.seed)
    pause_mode = apply_pause_arm(cfg, run.get("pause"))
    prompt_len = max(1, round(c("prompt_tokens") / s))
    n_train, sync_arm = run["n_train"], run["arm"] == "sync"

    def train_s(samples: list[dict]) -> float:
        lens = [(len(x.prompt_ids) + len(x.output_ids)) * s for x in samples]  # the sample records
        return train_seconds(model, lens, n_train) / k

    def sync_s(version: int) -> float:
        if sync_arm:
            return (c("colocated_switch_s") + model.weight_bytes / c("host_bytes_per_s")) / k
        return (c("sync_fixed_s") + model.weight_bytes / c("nccl_bytes_per_s")) / k

    g = c("group_size")
    concurrent = setup.batch * (run["eta"] + 1)  # the gate's bound at version 0: all it can admit
    spec = RunSpec(servers=run["n_gen"], in_flight=concurrent * g, group_size=g, batch_groups=setup.batch,
                   eta=run["eta"], steps=args.steps, max_new=math.ceil(c("len_max") / s), api_key=cfg.api_key,
                   prompt_len=prompt_len, pause_mode=pause_mode)
    with sim.SimProcess(run["n_gen"], cfg) as proc:
        row = await run_controller(spec, cfg, proc.urls, train_s=train_s, sync_delay_s=sync_s)
    marks = row["marks"]
    w0 = min(args.warmup_steps, len(marks) - 2)
    window = marks[w0:]
    sim_s = (window[-1]["t"] - window[0]["t"]) * k
    steps = len(window) - 1
    samples = steps * setup.batch * g
    per_step = sim_s / steps
    return {
        "setup": setup.name, "model": model.name, "gpus": setup.gpus_full, "simulated_gpus": setup.gpus,
        "arm": run["arm"], "eta": run["eta"], "gen_gpus": run["n_gen"] * setup.slice_div,
        "train_gpus": n_train * setup.slice_div, "gen_fraction": run["n_gen"] / setup.gpus,
        "step_s": per_step, "samples_per_s": samples / sim_s * setup.slice_div,
        "train_step_model_s": sum(m["train_s"] for m in window[1:]) * k / steps,
        "wait_for_batch_s": sum(m["wait_s"] for m in window[1:]) * k / steps,
        "staleness_mean": row["staleness_mean"], "staleness_max": row["staleness_max"],
        "correct": row["correct"], "errors": row["errors"], "controller_cpu_util": row["cpu_util"],
        "loop_lag_p99_ms": row["lag_p99_ms"], "steps_measured": steps, "wall_s": row["wall_s"],
        "pause_arm": run.get("pause") or "production default", "pause_modes_used": row["pause_modes_used"],
        **update_costs(row, setup, run["n_gen"], cfg.no_overlap_slowdown if cfg.disable_overlap_schedule else 1.0,
                       per_step, k),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", type=csv_list(SETUPS), default=["1.5B-128", "7B-192", "1.5B-4", "7B-8"],
                    help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--splits", type=csv_list(cast=float), default=[0.5, 0.625, 0.75, 0.875],
                    help="generation GPU fractions for the async arm")
    ap.add_argument("--steps", type=int, default=7, help="training steps per run")
    ap.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the measurement")
    ap.add_argument("--time-scale", type=float, default=25.0, help="K: simulated seconds per wall second")
    ap.add_argument("--tokens-per-token", type=int, default=128, help="S: model tokens per returned token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause-modes", type=csv_list(PAUSE_ARMS), default=[],
                    help=f"comma-separated pause arms from {', '.join(PAUSE_ARMS)}: the async arm once per arm, "
                         "results named pause_mode (default: the production pause only)")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    setups, pause_modes, splits = [SETUPS[x] for x in args.setups], args.pause_modes, args.splits
    if any(not 0 < f < 1 for f in splits):
        raise SystemExit(f"--splits: each fraction must be in (0, 1), got {args.splits}")
    print("model constants:")
    for name, (value, source) in CONSTANTS.items():
        print(f"  {name} = {value}  [{source}]")
    for key, m in MODELS.items():
        cfg = decode_config(m, 1, 1.0, 0)
        print(f"  {key}: {asdict(m)}; decode step = {cfg.decode_a_s * 1e3:.2f} ms + {cfg.decode_b_s * 1e6:.1f} us x "
              f"batch + {cfg.decode_c_s * 1e9:.1f} ns x context tokens; max_running {cfg.max_running}; prefill "
              f"{cfg.prefill_tokens_per_s:.0f} tok/s")
    runs = [r for s in setups for r in plan(s, splits, pause_modes)]
    if args.dry_run:
        for r in runs:
            print(f"[dry-run] {r['setup'].name}: {r['arm']} gen {r['n_gen']} train {r['n_train']} eta {r['eta']} "
                  f"pause {r['pause'] or 'production default'}")
        return
    name = "async_speedup_pause_mode" if pause_modes else "async_speedup"
    prov = provenance()
    rows = []
    for r in runs:
        row = asyncio.run(run_one(r, args))
        row.update(time_scale=args.time_scale, tokens_per_token=args.tokens_per_token, load_avg_1m=os.getloadavg()[0])
        rows.append(row)
        print_table([{k: v for k, v in row.items() if not isinstance(v, list)}], )
        save(name, [row], args, prov)
    summary = []
    for s in setups:
        mine = [r for r in rows if r["setup"] == s.name]
        sync = next(r for r in mine if r["arm"] == "sync")
        for arm in pause_modes or ["production default"]:
            best = max((r for r in mine if r["arm"] == "async" and r["pause_arm"] == arm),
                       key=lambda r: r["samples_per_s"])
            summary.append({"setup": s.name, "pause_arm": arm, "sync_samples_per_s": sync["samples_per_s"],
                            "sync_step_s": sync["step_s"], "best_gen_gpus": best["gen_gpus"],
                            "best_train_gpus": best["train_gpus"], "async_samples_per_s": best["samples_per_s"],
                            "async_step_s": best["step_s"], "speedup": best["samples_per_s"] / sync["samples_per_s"],
                            **{k: best.get(k) for k in ("running_per_update", "recomputed_prefill_tokens_per_update",
                                                        "recomputed_prefill_gpu_s_per_update",
                                                        "no_overlap_gpu_s_per_update", "lost_gpu_s_per_update",
                                                        "lost_fraction_of_generation")},
                            "paper": c("paper_speedup") if s.gpus_full >= 128 else "-"})
    print("\nsummary (best split per setup and pause arm):")
    print_table(summary)
    save(f"{name}_summary", summary, args, prov)
    bad = [r for r in rows if not r["correct"]]
    if bad:
        print("CORRECTNESS FAILED:", bad[0]["errors"])
        raise SystemExit(1)


if __name__ == "__main__":
    main()
