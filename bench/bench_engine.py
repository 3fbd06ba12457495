"""Continuous batching of the embedded engine: N concurrent requests vs the same N one at a time.

    python bench/bench_engine.py [--requests 64] [--new-tokens 64] [--hidden 256] [--layers 4] [--device cpu]

Builds a small random Qwen2 (no download), serves it with ``python -m areal_fast.rollout.engine`` in a
subprocess (so client and server do not share a GIL) and reports aggregate output tokens/s of both
modes and their ratio (goal >= 4x on CPU: proves requests really share forward passes). A row with
device, versions, commit and date is appended to bench/results/bench_engine.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import tempfile
import time

import aiohttp

from areal_fast.rollout.engine import launch_engine_subprocess
from areal_fast.rollout.testing import build_tiny_qwen2


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], n: int) -> int:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as r:
        r.raise_for_status()
        data = await r.json()
    assert len(data["output_ids"]) == n, data["meta_info"]["finish_reason"]
    return n


async def _run(url: str, prompts: list[list[int]], n: int, concurrent: bool) -> tuple[int, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await _one(s, url, prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        if concurrent:
            counts = await asyncio.gather(*(_one(s, url, p, n) for p in prompts))
        else:
            counts = [await _one(s, url, p, n) for p in prompts]
        return sum(counts), time.perf_counter() - t0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers

    tmp = tempfile.mkdtemp(prefix="bench_engine_")
    build_tiny_qwen2(tmp, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                     num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128),
                     intermediate_size=args.hidden * 3, max_position_embeddings=4096)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with launch_engine_subprocess(tmp, device=args.device, max_running_requests=max(256, args.requests)) as h:
        seq_tok, seq_s = asyncio.run(_run(h.url, prompts, args.new_tokens, concurrent=False))
        con_tok, con_s = asyncio.run(_run(h.url, prompts, args.new_tokens, concurrent=True))
    seq_rate, con_rate = seq_tok / seq_s, con_tok / con_s
    row = {
        "bench": "engine_continuous_batching", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "commit": _commit(), "device": args.device if args.device != "cpu" else f"cpu x{os.cpu_count()} "
        f"({platform.processor() or platform.machine()})", "torch": torch.__version__,
        "transformers": transformers.__version__, "model": f"qwen2 h{args.hidden} L{args.layers} V{args.vocab}",
        "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "sequential_tok_s": round(seq_rate, 1), "concurrent_tok_s": round(con_rate, 1),
        "ratio": round(con_rate / seq_rate, 2),
    }
    print(f"one at a time : {seq_tok} tokens in {seq_s:.2f} s = {seq_rate:.1f} tok/s")
    print(f"{args.requests} concurrent : {con_tok} tokens in {con_s:.2f} s = {con_rate:.1f} tok/s")
    print(f"ratio         : {con_rate / seq_rate:.2f}x (goal >= 4x)")
    if not args.no_save:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_engine.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
