"""Benchmark of one PPO trainer step (proximal recompute + loss + backward + AdamW) on a random-initialised
model of the given shape: ``fused`` (the fused-linear loss, logits never whole) against ``unfused``
(materialised logits + the PyTorch reference loss): tokens/s, MFU and peak memory. On CPU it runs the
``tiny`` shape with a few hundred tokens: a smoke run, not a measurement.

    python bench/bench_trainer.py [--shape qwen2-1.5b|qwen2-0.5b|tiny] [--tokens 32768] [--mb-tokens 16384]
                                  [--steps 3] [--no-ckpt] [--results DIR] [--no-results] [--dry-run]

Rows go to bench/results/trainer.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.ops import fused_linear_decoupled_ppo_loss_ref, fused_linear_token_logprobs_ref  # noqa: E402
from areal_fast.trainer import OptimConfig, PPOActor, PPOConfig, Sample, TrainerConfig  # noqa: E402
from areal_fast.trainer.model import shutdown_process_group  # noqa: E402
from bench.common import add_harness_args, csv_list, print_dry_run, print_table, provenance, save  # noqa: E402

SHAPES = {
    # Qwen2-1.5B: 28 layers, d 1536, 12 heads / 2 KV heads, MLP 8960, vocab 151936, tied embeddings
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1e6),
    # Qwen2-0.5B: 24 layers, d 896, 14 heads / 2 KV heads, MLP 4864, vocab 151936, tied embeddings
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1e6),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048),
}


class UnfusedActor(PPOActor):
    """Baseline: the LM head's logits materialised whole, the loss by the PyTorch reference."""

    def _token_logprobs_op(self, hidden, weight, labels, bias):
        return fused_linear_token_logprobs_ref(hidden, weight, labels, bias=bias,
                                               temperature=self.loss_config.temperature)

    def _loss_op(self, hidden, weight, labels, behav, adv, mask, **kw):
        return fused_linear_decoupled_ppo_loss_ref(hidden, weight, labels, behav, adv, mask, **kw)


def make_batch(total_tokens, vocab, seed, max_len, lo=256, hi=4096):
    g = torch.Generator().manual_seed(seed)
    out, n, i = [], 0, 0
    hi = min(hi, total_tokens, max_len)
    lo = min(lo, hi)
    while n < total_tokens:
        L = int(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * float(torch.rand((), generator=g))))
        L = max(2, min(L, total_tokens - n + 1, hi))
        p = max(1, L // 4)
        o = L - p
        out.append(Sample(prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
                          output_ids=torch.randint(0, vocab, (o,), generator=g).tolist(),
                          output_logprobs=(-torch.rand(o, generator=g) * 3 - 8).tolist(), output_versions=[0] * o,
                          reward=float(torch.rand((), generator=g) > 0.5), group_id=i // 8))
        n += L - 1
        i += 1
    return out


def run_variant(cls, cfg, batches, steps):
    cuda = torch.cuda.is_available()
    actor = cls(cfg)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rows = []
    try:
        for b in batches[: steps + 1]:
            rows.append(actor.train_batch(b))
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"OOM: {str(e)[:120]}"}
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        # The actor itself goes with `del` (no cycle through it any more); its model sits in torch's
        # FSDP cycle (module hooks bound to the FSDP state, which holds the module), so collect before
        # the next variant builds its own model, or the two models share the device.
        del actor
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    timed = rows[1:] or rows  # the first step includes allocator warm-up
    res = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_mem_gib": peak,
        "loss_step1": rows[0]["loss"],
    }
    if "mfu" in timed[0]:
        res["mfu"] = statistics.median(r["mfu"] for r in timed)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default=None)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 32768 GPU, 512 CPU)")
    ap.add_argument("--mb-tokens", type=int, default=None, help="max_tokens_per_mb (default 16384 GPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-ckpt", action="store_true", help="disable activation checkpointing")
    ap.add_argument("--variants", type=csv_list(("fused", "unfused")), default=["fused", "unfused"])
    add_harness_args(ap)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    shape = args.shape or ("qwen2-1.5b" if cuda else "tiny")
    tokens = args.tokens or (32768 if cuda else 512)
    mb_tokens = args.mb_tokens or (16384 if cuda else 256)
    if not cuda:
        tokens = min(tokens, 4 * mb_tokens)
    variants = args.variants
    if args.dry_run:
        print_dry_run("trainer", [dict(variant=v, shape=shape, tokens=tokens, mb_tokens=mb_tokens, steps=args.steps,
                                       act_ckpt=not args.no_ckpt) for v in variants])
        return
    if not cuda:
        print("# CPU: tiny shapes, a smoke run of the code path, not a measurement")
    prov = provenance()
    # the actor makes a one-rank NCCL (gloo on CPU) group; left to interpreter exit, its teardown can
    # abort the process after the rows are written, and the run ends with a failing exit status
    own_group = not torch.distributed.is_initialized()
    try:
        rows = _measure(args, shape, tokens, mb_tokens, variants, prov)
    finally:
        if own_group:
            shutdown_process_group()
    print_table(rows)


def _measure(args, shape, tokens, mb_tokens, variants, prov) -> list[dict]:
    from transformers import Qwen2Config

    with tempfile.TemporaryDirectory() as d:
        Qwen2Config(**SHAPES[shape]).save_pretrained(d)  # config only: random init from the seed
        cfg = TrainerConfig(model_path=d, max_tokens_per_mb=mb_tokens, gradient_checkpointing=not args.no_ckpt,
                            ppo=PPOConfig(prox_mode="recompute"), optim=OptimConfig(lr=1e-6))
        vocab = SHAPES[shape]["vocab_size"]
        batches = [make_batch(tokens, vocab, seed=s, max_len=mb_tokens) for s in range(args.steps + 1)]
        rows = []
        for name in variants:
            cls = {"fused": PPOActor, "unfused": UnfusedActor}[name]
            res = run_variant(cls, cfg, batches, args.steps)
            rows.append({"variant": name, "shape": shape, "tokens": tokens, "mb_tokens": mb_tokens,
                         "act_ckpt": not args.no_ckpt, **res})
            print(json.dumps(rows[-1]), flush=True)
            save("trainer", rows[-1:], args, prov)  # at once: a run cut short keeps what it measured
    return rows


if __name__ == "__main__":
    main()
