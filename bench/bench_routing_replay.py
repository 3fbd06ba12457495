"""Routing replay on the tiny Qwen3-MoE, bf16 "server" against the fp32 "trainer" (docs/moe.md): the
routings that differ, k1 / k3 of the log-ratio, the largest |log-ratio| and IcePop's masked share,
without and with the server's routing replayed, and replay's cost. ``--engine``: the same, paired, on
what the loop trains on (the recipe's warm-started MoE served by the embedded engine in bf16).

    python bench/bench_routing_replay.py [--seeds 0,1,2] [--prompts 32] [--new-tokens 48] [--engine [--temperature T]]

A row per seed goes to ``bench/results/routing_replay.jsonl`` (``routing_replay_engine.jsonl`` with
``--engine``); the ``routing_replay_engine_*.md`` files there are this command's printed output from
before it wrote rows.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, csv_list, provenance, save  # noqa: E402


def one_seed(seed: int, n_prompts: int, new_tokens: int) -> dict:
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf
    from areal_fast.moe_routing import record_routing, replay_routing, routers

    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_qwen3_moe(d, seed=seed, vocab_size=100)
        trainer = load_hf(path)
        server = load_hf(path).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, 100, (n_prompts, 8), generator=g)
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = server.generate(prompts, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)

        def lps(model):
            logits = model(ids).logits[:, prompts.shape[1] - 1:-1].float()
            return logits.log_softmax(-1).gather(-1, ids[:, prompts.shape[1]:, None])[..., 0]

        with record_routing(server) as served:
            behaviour = lps(server)
        with record_routing(trainer) as own:
            free = lps(trainer)
        rec = [s[0] for s in served]
        with replay_routing(trainer, rec):
            replayed = lps(trainer)

        def best_of(n, ctx_factory):  # the fastest of n timed forwards (the machine is shared)
            best = float("inf")
            for _ in range(n):
                with ctx_factory():
                    t0 = time.perf_counter()
                    lps(trainer)
                    best = min(best, time.perf_counter() - t0)
            return best

        t_plain = best_of(5, contextlib.nullcontext)
        t_replay = best_of(5, lambda: replay_routing(trainer, rec))
        t_rec = best_of(5, lambda: record_routing(trainer))
    n_tok = ids.numel()
    flips = sum(int((s.sort(-1).values != o[0].sort(-1).values).any(-1).sum()) for s, o in zip(rec, own))
    out = {"flip_frac": flips / (n_tok * len(rec)), "tokens": n_tok,
           "column_bytes_per_token": 2 * len(routers(trainer)) * trainer.config.num_experts_per_tok,
           "replay_overhead": t_replay / t_plain - 1, "record_overhead": t_rec / t_plain - 1}
    for name, t in (("free", free), ("replay", replayed)):
        d = (behaviour - t).double()
        out[f"{name}_k1"] = d.mean().item()
        out[f"{name}_k3"] = (d.exp() - 1 - d).mean().item()
        out[f"{name}_max"] = d.abs().max().item()
        out[f"{name}_icepop_masked"] = (d.abs() > math.log(2)).double().mean().item()
    return out


def engine_paired(seed: int, n_prompts: int, new_tokens: int, work: str, temperature: float = 1.0) -> dict:
    """The trained recipe's MoE (``examples/tiny_reverse_moe.yaml``'s warm start, longer strings),
    served by the embedded engine in bf16 with routing recorded at generation time (KV cache,
    continuous batching), the answers stitched by the rollout client; the fp32 trainer's proximal
    recompute of the very same samples without and with replay (paired: the same tokens)."""
    import asyncio

    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.config import load_config
    from areal_fast.data import load_tokenizer
    from areal_fast.data.warm_start import ensure_warm_start
    from areal_fast.embedded import start_engine_in_thread
    from areal_fast.launch.rank import load_data
    from areal_fast.moe_routing import routing_shape
    from areal_fast.trainer import PPOActor, TrainerConfig
    from areal_fast.trainer.config import PPOConfig

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "examples" / "tiny_reverse_moe.yaml",
                      [f"experiment.output_dir={work}/seed{seed}", f"experiment.seed={seed}",
                       "data.synthetic.min_len=6", "data.synthetic.max_len=16", "data.synthetic.log_mean=0.7"])
    model = str(ensure_warm_start(cfg.warm_start_recipe()))
    tok = load_tokenizer(model)
    _, evals = load_data(cfg, tok)
    prompts = [tok.encode(r.text) for r in evals[:n_prompts]]
    h = start_engine_in_thread(model, seed=seed, dtype="bfloat16", return_routed_experts=True)
    try:
        async def gen():
            width, experts = routing_shape(model)
            async with SGLangRolloutClient([h.url], routed_experts_width=width, num_experts=experts) as c:
                return await asyncio.gather(*(c.generate(p, {"max_new_tokens": new_tokens, "temperature": temperature,
                                                              "ignore_eos": True}) for p in prompts))
        samples = asyncio.run(gen())
    finally:
        h.stop()
    b = torch.cat([torch.tensor(list(s.output_logprobs)) for s in samples]).double()
    out = {"tokens": int(b.numel())}
    for name, replay in (("free", False), ("replay", True)):
        actor = PPOActor(TrainerConfig(model_path=model, device="cpu", ppo=PPOConfig(routing_replay=replay),
                                       sampling_temperature=temperature))
        p = torch.cat(actor.compute_logprobs(samples)).double()
        stats = actor.train_batch([_with_group(s) for s in samples], version=0) if name == "free" else {}
        if "routing_differ_fraction" in stats:
            out["flip_frac"] = stats["routing_differ_fraction"]
        d = b - p
        out[f"{name}_k1"] = d.mean().item()
        out[f"{name}_k3"] = (d.exp() - 1 - d).mean().item()
        out[f"{name}_max"] = d.abs().max().item()
        out[f"{name}_icepop_masked"] = (d.abs() > math.log(2)).double().mean().item()
    return out


def _with_group(s):
    s.group_id = 0
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", type=csv_list(cast=int))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0, help="--engine: the sampling temperature")
    ap.add_argument("--engine", action="store_true",
                    help="the trained recipe's MoE served by the embedded engine in bf16 (routing recorded while "
                         "it generates), the fp32 trainer's recompute of the same samples without / with replay")
    add_harness_args(ap, dry_run=None)
    a = ap.parse_args(argv)
    prov = provenance(native=False)
    torch.set_num_threads(1)
    if a.engine:
        with tempfile.TemporaryDirectory(prefix="areal_bench_replay_") as work:
            rows = [engine_paired(s, a.prompts, a.new_tokens, work, a.temperature) for s in a.seeds]
        for s, r in zip(a.seeds, rows):
            print(f"seed {s}: {r['tokens']} tokens | routings differing {100 * r['flip_frac']:.3f} % | k3 "
                  f"{r['free_k3']:.3e} -> {r['replay_k3']:.3e} | k1 {r['free_k1']:+.2e} -> {r['replay_k1']:+.2e} | "
                  f"max |log w| {r['free_max']:.3f} -> {r['replay_max']:.3f} | IcePop masks "
                  f"{100 * r['free_icepop_masked']:.3f} % -> {100 * r['replay_icepop_masked']:.3f} %")
        ratio = [r["free_k3"] / r["replay_k3"] for r in rows]
        print(f"k3 without / with replay (same samples): {', '.join(f'{x:.2f}' for x in ratio)}")
        save("routing_replay_engine", [{"seed": s, **r} for s, r in zip(a.seeds, rows)], a, prov)
        return 0
    rows = [one_seed(s, a.prompts, a.new_tokens) for s in a.seeds]
    for s, r in zip(a.seeds, rows):
        print(f"seed {s}: routings differing {100 * r['flip_frac']:.2f} % | k3 {r['free_k3']:.2e} -> "
              f"{r['replay_k3']:.2e} | k1 {r['free_k1']:+.2e} -> {r['replay_k1']:+.2e} | max |log w| "
              f"{r['free_max']:.3f} -> {r['replay_max']:.3f} | IcePop masks {100 * r['free_icepop_masked']:.3f} % "
              f"-> {100 * r['replay_icepop_masked']:.3f} % | replay forward {100 * r['replay_overhead']:+.0f} %, "
              f"recording {100 * r['record_overhead']:+.0f} %")
    ratio = [r["free_k3"] / r["replay_k3"] for r in rows]
    print(f"k3 without / with replay: {', '.join(f'{x:.1f}' for x in ratio)} (median "
          f"{statistics.median(ratio):.1f}); column {rows[0]['column_bytes_per_token']} bytes per token "
          f"({rows[0]['tokens']} tokens a seed)")
    save("routing_replay", [{"seed": s, **r} for s, r in zip(a.seeds, rows)], a, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
