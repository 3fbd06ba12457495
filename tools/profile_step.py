"""Time and profile the trainer step of the tiny recipe alone (no servers): the warm-started model
of a finished ``areal-fast train examples/tiny_reverse.yaml`` run, batches shaped like the recipe's
(16 prompts x 8 samples of the reverse task, behaviour version = the current one).

    python -m tools.profile_step RUN_DIR [--steps 30] [--profile] [--set train.ppo.prox_mode=...]

Prints the median trainer step seconds (``train_batch`` wall time) and, with ``--profile``, the
top operators of torch.profiler over a few steps."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path


def batches(seed: int, n: int, version_of):
    from areal_fast.sample import Sample

    rng = random.Random(seed)
    for _ in range(n):
        out = []
        for g in range(16):
            k = max(2, min(12, round(rng.lognormvariate(0.5, 0.6))))
            prompt = [1] + [rng.randrange(3, 13) for _ in range(k)] + [13]
            for _ in range(8):
                gl = k + rng.choice((0, 1))
                out.append(Sample(prompt_ids=prompt, output_ids=[rng.randrange(3, 13) for _ in range(gl)] + [2],
                                  output_logprobs=[-rng.random() * 0.5 for _ in range(gl + 1)],
                                  output_versions=[version_of()] * (gl + 1), reward=rng.random(), group_id=g))
        yield out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--save", metavar="NOTE", help="append the timing to bench/results/trainer_step.jsonl")
    ap.add_argument("--reference", action="store_true",
                    help="the reference paths: per-sequence attention, every proximal log-prob recomputed")
    a = ap.parse_args(argv)
    import torch

    from areal_fast.config import load_config
    from areal_fast.launch.rank import trainer_config
    from areal_fast.trainer import PPOActor

    run = Path(a.run_dir)
    cfg = load_config(str(run / "config.yaml"), overrides=a.set) if a.set else load_config(str(run / "config.yaml"))
    torch.set_num_threads(cfg.train.threads)
    if a.reference:
        from areal_fast.trainer import attention

        attention.varlen_attention_bucketed = attention.varlen_attention_ref
        PPOActor.prox_from_forward = False
    actor = PPOActor(trainer_config(cfg, str(run / "warm_start")))
    times = []
    for b in batches(0, a.steps, lambda: actor.version):
        t = time.perf_counter()
        m = actor.train_batch(b, actor.version)
        times.append(time.perf_counter() - t)
    print(f"trainer step: median {statistics.median(times[3:]):.4f} s, mean {statistics.mean(times[3:]):.4f} s "
          f"(train_batch wall, {len(times) - 3} steps after 3 warm-up; recompute {m['recompute_time_s']:.4f} s; "
          f"threads {torch.get_num_threads()})")
    if a.save:
        import os

        row = {"note": a.save, "variant": "reference" if a.reference else "fast", "overrides": a.set,
               "step_s_median": round(statistics.median(times[3:]), 4),
               "step_s_mean": round(statistics.mean(times[3:]), 4),
               "steps": len(times) - 3, "n_tokens": m["n_tokens"], "threads": torch.get_num_threads(),
               "load": os.getloadavg()}
        from bench.common import append_rows

        append_rows("trainer_step", [row])
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in batches(1, 5, lambda: actor.version):
                actor.train_batch(b, actor.version)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


if __name__ == "__main__":
    main()
