"""Continuous batching of the embedded engine: N concurrent requests vs the same N one at a time.

    python bench/bench_engine.py [--requests 64] [--new-tokens 64] [--hidden 256] [--layers 4] [--device cpu]

Builds a small random Qwen2 (no download), serves it with ``python -m areal_fast.embedded`` in a
subprocess (so client and server do not share a GIL) and reports aggregate output tokens/s of both
modes and their ratio (goal >= 4x on CPU: proves requests really share forward passes). A row with
provenance is appended to bench/results/engine.jsonl (``--results DIR``, ``--no-results``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.data.tiny_models import build_tiny_qwen2  # noqa: E402
from areal_fast.embedded import launch_engine_subprocess  # noqa: E402
from bench.common import add_harness_args, print_dry_run, provenance, save  # noqa: E402


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    model = f"qwen2 h{args.hidden} L{args.layers} V{args.vocab}"
    if args.dry_run:
        print_dry_run("engine", [dict(model=model, device=args.device, requests=args.requests,
                                      prompt_len=args.prompt_len, new_tokens=args.new_tokens)])
        return
    prov = provenance()
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
        "model": model, "engine_device": args.device, "requests": args.requests, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "sequential_tok_s": round(seq_rate, 1), "concurrent_tok_s": round(con_rate, 1),
        "ratio": round(con_rate / seq_rate, 2),
    }
    print(f"one at a time : {seq_tok} tokens in {seq_s:.2f} s = {seq_rate:.1f} tok/s")
    print(f"{args.requests} concurrent : {con_tok} tokens in {con_s:.2f} s = {con_rate:.1f} tok/s")
    print(f"ratio         : {con_rate / seq_rate:.2f}x (goal >= 4x)")
    save("engine", [row], args, prov)

if __name__ == "__main__":
    main()
