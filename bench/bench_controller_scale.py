"""The controller at production scale: the real Controller, staleness gate and RolloutClient (or the
sharded client, ``--client-procs N``) against N simulated SGLang servers (``tools/sim_sglang.py``, in a
child process so that this process's CPU is the controller's alone). What each row of
``bench/results/controller_scale.jsonl`` holds and the measured table: docs/scale.md.

    python bench/bench_controller_scale.py                    # 8/512, 64/4,096, 256/16,384
    python bench/bench_controller_scale.py --scales 64:4096   # servers:requests in flight
    python bench/bench_controller_scale.py --quick            # 4 servers, 128 in flight, short answers
    python bench/bench_controller_scale.py --client-procs 2   # the sharded client: 2 worker processes
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.backends.sglang.client import SGLangRolloutClient  # noqa: E402
from areal_fast.controller import Controller, ControllerSettings  # noqa: E402
from areal_fast.rollout.loop import event_loop_choice, run_event_loop  # noqa: E402
from areal_fast.rollout.port import ClientRollout  # noqa: E402
from areal_fast.rollout.sharded import ShardedRollout  # noqa: E402
from areal_fast.rollout.staleness import StalenessManager  # noqa: E402
from bench.common import add_harness_args, print_table, provenance, save  # noqa: E402
from tools import sim_sglang as sim  # noqa: E402
from tools.sim_controller import (  # noqa: E402
    PROMPT_LEN,
    CheckedRollout,
    ConstReward,
    GcClock,
    LoopLag,
    MemoryProbe,
    SimPrompts,
    SimSync,
    SimTokenizer,
    SleepTrainer,
    peak_rss_mb,
    sim_stats_all,
)

# ----------------------------------------------------------------------------- one run


@dataclass(kw_only=True)
class RunSpec:
    servers: int
    in_flight: int
    group_size: int = 16
    batch_groups: int = 0  # 0: half the groups in flight
    eta: int = 4
    steps: int = 4
    train_s: float = 2.0
    max_new: int = 32768
    pause_mode: str | None = None
    api_key: str | None = "bench-key"
    prompt_len: int = PROMPT_LEN
    client_procs: int = 1  # > 1: ShardedRollout with that many worker processes
    loop: str | None = None  # the rollout workers' event loop (sharded client)
    fill_buffer: bool = False  # the first training step waits until the gate stops admitting
    buffer_memory_mb: float | None = ControllerSettings.__dataclass_fields__["buffer_memory_mb"].default


async def run_controller(spec: RunSpec, cfg: sim.SimConfig, urls: list[str], *, train_s=None, sync_delay_s=None,
                         out_dir: Path | None = None, stat_urls: list[str] | None = None) -> dict:
    """Drive the real Controller against the simulated servers at ``urls``; returns the measures.
    ``stat_urls``: one url of each simulator process (default: they all share one, ``urls[0]``)."""
    stat_urls = stat_urls or urls[:1]
    if spec.in_flight % spec.group_size:
        raise ValueError(f"in_flight {spec.in_flight} must be a multiple of group_size {spec.group_size}")
    concurrent = spec.in_flight // spec.group_size
    batch = spec.batch_groups or max(1, concurrent // 2)
    if spec.client_procs > 1:
        client = port = ShardedRollout(urls, spec.client_procs, client_class=SGLangRolloutClient,
                                      api_key=spec.api_key, request_timeout_s=24 * 3600,
                                      loop=spec.loop)
        worker_cpu = port.worker_cpu_seconds
    else:
        client = SGLangRolloutClient(urls, api_key=spec.api_key, request_timeout_s=24 * 3600)
        port = ClientRollout(client)
        worker_cpu = lambda: 0.0  # noqa: E731
    # an in_place pause keeps requests with their KV: the update goes in without a flush (as production's)
    sync = SimSync(urls, spec.api_key, sync_delay_s or (lambda v: 0.0), flush_cache=spec.pause_mode != "in_place")
    rollout = CheckedRollout(port, cfg, spec.max_new, sync, spec.pause_mode)
    gate = StalenessManager(batch, spec.eta, concurrent)
    # --fill-buffer: the gate has stopped admitting at version 0 ((eta + 1) x B groups finished)
    filled: dict = {}

    def hold() -> bool:
        if gate.running or gate.capacity():
            return False
        filled["groups"] = len(ctrl.buffer) + batch  # the first batch is already out of the buffer
        return True

    trainer = SleepTrainer(train_s or (lambda samples: spec.train_s), hold_first=hold if spec.fill_buffer else None)
    tmp = tempfile.TemporaryDirectory(prefix="ctrl_scale_")
    settings = ControllerSettings(batch_size=batch, group_size=spec.group_size, total_steps=spec.steps,
                                  sampling={"max_new_tokens": spec.max_new, "temperature": 1.0}, eval_sampling={},
                                  eval_every=0, eval_at_start=False, checkpoint_every=0,
                                  output_dir=Path(out_dir or tmp.name), buffer_memory_mb=spec.buffer_memory_mb)
    marks: list[dict] = []

    def on_metrics(m: dict) -> None:
        if m.get("kind") == "train":
            marks.append({"t": time.perf_counter(), "cpu": time.process_time(), "wcpu": worker_cpu(), "step": m["step"],
                          "trained_tokens": m["tokens"], "staleness": m["staleness"], "positions": m["positions"],
                          "train_s": m["train_s"], "wait_s": m["wait_s"], "sync_s": m["sync_s"]})

    ctrl = Controller(settings, SimPrompts(), SimTokenizer(spec.prompt_len), rollout, ConstReward(), trainer, sync,
                      gate, callbacks=[on_metrics])
    await client.start()
    probe = MemoryProbe(ctrl, rollout, trainer, gate, spec.group_size)
    lag = LoopLag(other_rss_mb=port.worker_rss_mb if spec.client_procs > 1 else None, on_peak=probe)
    stats0 = await sim_stats_all(stat_urls, spec.api_key)
    gc.collect()
    lag.start()
    t0, cpu0, wcpu0 = time.perf_counter(), time.process_time(), worker_cpu()
    try:
        with GcClock() as gcc:
            summary = await ctrl.run()
        workers_peak_hwm = port.worker_rss_mb(peak=True) if spec.client_procs > 1 else 0.0
        sharded_stats = dict(port.stats) if spec.client_procs > 1 else None
    finally:
        await lag.stop()
        await client.close()
        await sync.close()
        tmp.cleanup()
    stats1 = await sim_stats_all(stat_urls, spec.api_key)
    last = marks[-1]
    wall = last["t"] - t0
    cpu = last["cpu"] - cpu0 - rollout.check_cpu_s - probe.cpu_s
    wcpu = last["wcpu"] - wcpu0
    received = stats1["sent_tokens"] - stats0["sent_tokens"]
    trained = sum(m["trained_tokens"] for m in marks)
    positions = [p for m in marks for p in m["positions"]]
    errors = list(rollout.errors)
    if len(set(positions)) != len(positions):
        errors.append("a group was trained twice")
    if stats1["duplicates"] != stats0["duplicates"]:
        errors.append(f"{stats1['duplicates'] - stats0['duplicates']} rids completed twice on the servers")
    pauses = rollout.pauses
    stal = [s for m in marks for s in m["staleness"]]
    mp = probe.at_peak
    held = mp.get("buffer_tokens", 0) + mp.get("training_tokens", 0) + mp.get("in_flight_finished_tokens", 0)
    above = mp.get("rss_mb", lag.rss0) - lag.rss0
    return {
        "servers": spec.servers, "in_flight": spec.in_flight, "group_size": spec.group_size, "batch_groups": batch,
        "eta": spec.eta, "steps": len(marks), "pause_mode": spec.pause_mode or "production default",
        "pause_modes_used": sorted({p["mode"] for p in rollout.pauses}),
        "wall_s": wall, "received_tok_s": received / wall, "trained_tok_s": trained / wall,
        "cpu_s": cpu, "cpu_util": cpu / wall, "cpu_us_per_tok": 1e6 * cpu / max(received, 1),
        "client_procs": spec.client_procs, "worker_cpu_s": wcpu,
        "worker_cpu_us_per_tok": 1e6 * wcpu / max(received, 1),
        "total_cpu_us_per_tok": 1e6 * (cpu + wcpu) / max(received, 1), "total_cpu_util": (cpu + wcpu) / wall,
        "gc_s": gcc.total_s, "gc_share_of_cpu": gcc.total_s / max(cpu, 1e-9), "gc_collections": gcc.collections,
        **lag.summary(),
        "pause_ack_max_s": max((p["ack_s"] for p in pauses), default=None),
        "sim_loop_lag_max_s": stats1.get("loop_lag_max_s"),
        "pause_ack_s": [round(p["ack_s"], 3) for p in pauses],
        "pause_in_workers_s": [round(p["in_workers_s"], 3) for p in pauses if p["in_workers_s"] is not None],
        "pause_to_continue_mean_s": sum(p["continue_s"] for p in pauses) / len(pauses) if pauses else None,
        "pause_to_continue_max_s": max((p["continue_s"] for p in pauses), default=None),
        "peak_rss_mb": lag.peak_rss, "rss_before_mb": lag.rss0, "process_peak_rss_mb": peak_rss_mb(),
        "workers_peak_rss_mb": lag.peak_other_rss, "workers_peak_hwm_mb": workers_peak_hwm,
        "total_peak_rss_mb": max(lag.peak_total_rss, lag.peak_rss), "sharded_stats": sharded_stats,
        "received_tokens": received, "trained_tokens": trained,
        "client_tok_s_per_core": received / max(cpu, 1e-9), "check_cpu_s": rollout.check_cpu_s,
        "probe_cpu_s": probe.cpu_s, "fill_buffer": spec.fill_buffer,
        "first_step_held_s": trainer.held_s,
        "first_step_finished_groups": filled.get("groups"), "buffer_memory_mb": spec.buffer_memory_mb,
        "gate_bound_groups": (spec.eta + 1) * batch,
        **{f"at_peak_{k}": v for k, v in mp.items()},
        "at_peak_held_tokens": held, "at_peak_rss_above_base_mb": above,
        "rss_bytes_per_held_token": above * 2**20 / held if held else None,
        **{k: stats1.get(k, 0) - stats0.get(k, 0)
           for k in ("pauses", "recomputed_prefill_tokens", "recomputed_prefill_s", "running_at_pauses",
                     "decode_busy_s")},
        "answers": stats1["answers"] - stats0["answers"], "aborted_answers": stats1["aborted_answers"]
        - stats0["aborted_answers"], "samples_checked": sum(rollout.returned.values()),
        "staleness_mean": sum(stal) / max(len(stal), 1), "staleness_max": max(stal, default=0),
        "correct": not errors, "errors": errors[:5], "summary_counters": summary["counters"],
        "heap_trim": summary.get("heap_trim"),
        "marks": [{k: m[k] for k in ("step", "train_s", "wait_s", "sync_s")} | {"t": m["t"] - t0} for m in marks],
    }


# ----------------------------------------------------------------------------- main


MAX_SPEED_TIME_SCALE = 1e6  # --max-speed: a 32k-token answer decodes in ~1 ms of wall time


def time_scale_of(args) -> float:
    """--max-speed, else --time-scale, else max(1, 16 / --compress): real time at the default answers /16,
    and at full lengths (--compress 1) 16x, so that a full-length answer takes the wall time of a /16 one
    and 16,384 requests offer ~8M tokens/s, more than one client process takes."""
    if args.max_speed:
        return MAX_SPEED_TIME_SCALE
    return args.time_scale if args.time_scale is not None else max(1.0, 16.0 / args.compress)


def scale_config(args) -> sim.SimConfig:
    """A 7B-class model on one H100: 12 ms + 0.3 ms x batch per step (64 running: ~2,000 tokens/s per
    server), time compressed by :func:`time_scale_of`; answer lengths log-normal, median 4,000 /
    --compress, cap 32k / --compress."""
    return sim.SimConfig(decode_a_s=0.012, decode_b_s=0.0003, prefill_tokens_per_s=200_000, max_running=512,
                         len_median=4000 / args.compress, len_sigma=1.0, len_max=int(32768 / args.compress),
                         time_scale=time_scale_of(args), sglang_version=args.sglang_version, api_key="bench-key",
                         seed=args.seed, reference_renderer=args.reference_renderer)


class SimProcesses:
    """``n`` simulated servers spread over ``procs`` child processes (as even as they divide)."""

    def __init__(self, n: int, procs: int, cfg: sim.SimConfig):
        sizes = [n // procs + (i < n % procs) for i in range(procs)]
        self.procs: list[sim.SimProcess] = []
        try:
            for k in sizes:
                self.procs.append(sim.SimProcess(k, cfg))
        except BaseException:
            self.close()
            raise
        self.urls = [u for p in self.procs for u in p.urls]
        self.stat_urls = [p.urls[0] for p in self.procs]

    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.close()

    def __enter__(self) -> SimProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _memory_mb(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MB or 'none': {text!r}") from None
    if not v >= 0:  # 0: every finished group is spilled (as rollout.buffer_memory_mb: 0)
        raise argparse.ArgumentTypeError(f"must be >= 0 (or 'none'), got {text!r}")
    return v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default="8:512,64:4096,256:16384", help="servers:in_flight[,...]")
    ap.add_argument("--quick", action="store_true", help="4 servers, 128 in flight, answers /64, 3 steps")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--train-s", type=float, default=2.0, help="the trainer's sleep per step (wall s)")
    ap.add_argument("--compress", type=float, default=16.0, help="divide answer lengths (median 4,000, cap 32k)")
    ap.add_argument("--pause-mode", choices=("abort", "retract", "in_place"), default=None,
                    help="default: what the production rollout port does (the client's configured mode)")
    ap.add_argument("--sglang-version", default="0.5.23")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="stored in each row (e.g. which code was measured)")
    ap.add_argument("--profile", action="store_true", help="cProfile the controller process; print the top 25")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="rollout client processes: 1 = in the controller's process, N > 1 = ShardedRollout")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default=None,
                    help="the controller's event loop (default: production's choice, uvloop where installed)")
    ap.add_argument("--sim-procs", type=int, default=1, help="simulator processes the servers are spread over")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="the simulator's time compression (default: max(1, 16 / --compress))")
    ap.add_argument("--max-speed", action="store_true",
                    help="no decode-rate limit: the servers answer as fast as the simulator can (the client is "
                         "the bottleneck: received tokens/s at ~100%% of a core is one client process's rate)")
    ap.add_argument("--reference-renderer", action="store_true",
                    help="the simulator builds answers token by token (the slow renderer: to compare its CPU)")
    ap.add_argument("--fill-buffer", action="store_true",
                    help="the first training step waits until the gate stops admitting: the buffer of finished "
                         "groups as full as eta allows (worst-case memory)")
    ap.add_argument("--buffer-memory-mb", type=_memory_mb,
                    default=ControllerSettings.__dataclass_fields__["buffer_memory_mb"].default,
                    help="the controller's in-memory buffer bound (rollout.buffer_memory_mb; 'none' = no bound)")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.scales, args.compress, args.steps = "4:128", 64.0, 3
    scales = []
    for part in args.scales.split(","):
        try:
            n, f = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--scales: {part!r} is not servers:in_flight") from None
        scales.append((n, f))
        if not 1 <= args.client_procs <= n:
            raise SystemExit(f"--client-procs: must be >= 1 and <= the servers of every scale ({n}), "
                             f"got {args.client_procs}")
        if not 1 <= args.sim_procs <= n:
            raise SystemExit(f"--sim-procs: must be >= 1 and <= the servers of every scale ({n}), got {args.sim_procs}")
    if args.time_scale is not None and not args.time_scale > 0:
        raise SystemExit(f"--time-scale: must be > 0, got {args.time_scale}")
    cfg = scale_config(args)
    if args.dry_run:
        for n, f in scales:
            print(f"[dry-run] {n} servers, {f} in flight, group {args.group_size}, {cfg}")
        return
    sim.raise_fd_limit()  # the in-process client holds one connection per request in flight
    prov = provenance()
    rows = []
    for n, f in scales:
        spec = RunSpec(servers=n, in_flight=f, group_size=args.group_size, eta=args.eta, steps=args.steps,
                       train_s=args.train_s, max_new=cfg.len_max, pause_mode=args.pause_mode, api_key=cfg.api_key,
                       client_procs=args.client_procs, loop=args.loop, fill_buffer=args.fill_buffer,
                       buffer_memory_mb=args.buffer_memory_mb)
        load_before = os.getloadavg()[0]
        with SimProcesses(n, args.sim_procs, cfg) as proc:
            sim_cpu0 = proc.cpu_seconds()
            prof = None
            if args.profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            row = run_event_loop(run_controller(spec, cfg, proc.urls, stat_urls=proc.stat_urls), args.loop)
            row["event_loop"] = event_loop_choice(args.loop)
            if prof is not None:
                import pstats

                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            row["sim_cpu_s"] = proc.cpu_seconds() - sim_cpu0
            row["sim_cpu_us_per_tok"] = 1e6 * row["sim_cpu_s"] / max(row["received_tokens"], 1)
            row["sim_procs"] = args.sim_procs
        row["load_avg_1m"] = os.getloadavg()[0]
        row["load_avg_1m_before"] = load_before
        if args.note:
            row["note"] = args.note
        row["sim"] = {"decode_a_s": cfg.decode_a_s, "decode_b_s": cfg.decode_b_s, "len_median": cfg.len_median,
                      "len_max": cfg.len_max, "compress": args.compress, "sglang_version": cfg.sglang_version,
                      "time_scale": cfg.time_scale, "max_speed": args.max_speed,
                      "renderer": "reference" if cfg.reference_renderer else "fast"}
        rows.append(row)
        print_table([{k: v for k, v in row.items() if not isinstance(v, dict | list)}])
        save("controller_scale", [row], args, prov)
    for r in rows:
        if not r["correct"]:
            print("CORRECTNESS FAILED:", r["errors"])
            raise SystemExit(1)


if __name__ == "__main__":
    main()
