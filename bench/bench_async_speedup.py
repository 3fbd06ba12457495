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


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


# Architectures from the models' Hugging Face config.json (the models the paper trains).
MODELS = {
    "1.5B": ModelSpec("DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9, 28, 1536, 2, 128),
    "7B": ModelSpec("DeepSeek-R1-Distill-Qwen-7B", 7.62e9, 28, 3584, 4, 128),
}

CONSTANTS = {
    "gpu": ("H800 / H100 SXM", "NVIDIA H100 datasheet; the H800 differs only in NVLink (400 GB/s) and FP64"),
    "hbm_bytes_per_s": (3.35e12, "H100 SXM HBM3 bandwidth, NVIDIA datasheet"),
    "bf16_flops": (989e12, "H100 SXM dense BF16 tensor-core peak, NVIDIA datasheet (1,979 with sparsity)"),
    "hbm_efficiency": (0.7, "assumption: fraction of HBM peak a decode step achieves (weights + KV reads)"),
    "step_overhead_s": (0.003, "assumption: per decode step scheduling, sampling and launch time with CUDA graphs"),
    "per_seq_overhead_s": (10e-6, "assumption: per running request per step (batch bookkeeping, sampling)"),
    "decode_mfu": (0.5, "assumption: compute efficiency of the per-token matmuls in a large decode batch"),
    "prefill_mfu": (0.5, "assumption: prefill efficiency (2 x params FLOPs per token)"),
    "train_mfu": (0.35, "assumption: FSDP training MFU on long packed sequences (public reports 30-50%)"),
    "kv_mem_fraction": (0.85, "assumption: SGLang --mem-fraction-static-like share of 80 GB for weights + KV"),
    "nccl_bytes_per_s": (25e9, "assumption: trainer -> servers weight broadcast, ~half of a 400 Gb/s NIC"),
    "sync_fixed_s": (1.0, "assumption: pause, update call, continue around a weight broadcast"),
    "colocated_switch_s": (3.0, "assumption: sync arm, per step: release and reload the engine's memory"),
    "host_bytes_per_s": (20e9, "assumption: sync arm weight reload into the colocated engine (PCIe-class)"),
    "len_median": (4000, "assumption: median answer length (log-normal, sigma 1.0) of R1-distilled models"),
    "len_sigma": (1.0, "assumption: 1.9% of answers reach 8x the median"),
    "len_max": (32768, "the paper's maximum generation length (32k context)"),
    "prompt_tokens": (512, "assumption: math prompt with chat template"),
    "group_size": (16, "the paper: 16 answers per prompt"),
    "batch_prompts": (512, "the paper: 512 prompts per step"),
    "eta": (4, "the paper's default maximum staleness"),
    "paper_speedup": ("2.57-2.77x", "AReaL paper: end-to-end training throughput of AReaL vs the synchronous system"),
    "no_overlap_slowdown": (1.10, "assumption: decode step time with --disable-overlap-schedule (needed by in_place "
                                  "pauses) over with it; the overlap scheduler's published gain is of this order "
                                  "(SGLang v0.4 announcement); 'in_place_ideal' arms take 1.0"),
}

# --pause-modes: the async arm once per mode (docs/pause_modes.md). in_place runs the servers with
# --disable-overlap-schedule --disable-radix-cache (what it needs for exact versions on SGLang) and so
# pays no_overlap_slowdown; in_place_ideal is in_place at no such cost (the embedded engine, or an
# SGLang that labelled the overlapped step right): the bound of what keeping the KV saves.
PAUSE_ARMS = {"abort": ("abort", None), "retract": ("retract", None), "in_place": ("in_place", "no_overlap_slowdown"),
              "in_place_ideal": ("in_place", 1.0)}


def c(name: str):
    return CONSTANTS[name][0]


def train_seconds(model: ModelSpec, seq_lens: list[int], gpus: int) -> float:
    """One step: forward + backward (3 forward passes' FLOPs) + the proximal log-prob forward = 4
    forwards of 2 * params FLOPs per token, plus causal attention (2 * layers * hidden * n^2 per
    forward of a sequence of n tokens), at ``train_mfu`` of ``gpus`` GPUs' peak."""
    fwd = sum(2 * model.params * n + 2 * model.layers * model.hidden * n * n for n in seq_lens)
    return 4 * fwd / (gpus * c("bf16_flops") * c("train_mfu"))


def decode_config(model: ModelSpec, s: int, k: float, seed: int) -> sim.SimConfig:
    """The batching decode model of one SGLang server on one GPU (see CONSTANTS)."""
    bw = c("hbm_bytes_per_s") * c("hbm_efficiency")
    a = c("step_overhead_s") + model.weight_bytes / bw
    b = c("per_seq_overhead_s") + 2 * model.params / (c("bf16_flops") * c("decode_mfu"))
    kv_tokens = (80e9 * c("kv_mem_fraction") - model.weight_bytes) / model.kv_bytes_per_token
    mean_len = c("len_median") * math.exp(c("len_sigma") ** 2 / 2)
    return sim.SimConfig(decode_a_s=a, decode_b_s=b, decode_c_s=model.kv_bytes_per_token / bw,
                         prefill_tokens_per_s=c("bf16_flops") * c("prefill_mfu") / (2 * model.params),
                         max_running=max(1, min(1024, int(kv_tokens / (c("prompt_tokens") + mean_len)))),
                         len_median=c("len_median"), len_sigma=c("len_sigma"), len_max=c("len_max"),
                         tokens_per_token=s, time_scale=k, seed=seed, api_key="bench-key")


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
