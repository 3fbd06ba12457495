"""What top-p / top-k sampling does to the behaviour log-probs the trainer weighs (docs/config.md,
"Sampling"): the recipe's warm-started tiny model served by the embedded engine (fp32, CPU), sampled
with a truncation, and for every sampled token the log-prob of the distribution it was drawn from
(the truncated one, renormalised: ``log q``, what vLLM reports with ``processed_logprobs``) against the
trainer's full-softmax recompute (``log p``). The gap is ``-log Z`` (Z: the probability mass the
truncation kept at that step) and the importance weight the trainer would form for an on-policy
token, ``p / q = Z``, is biased by ``1 - Z``; an untruncated case is the control (gap exactly 0).

    python bench/bench_top_p_bias.py [--cases 0.9:-1,1.0:8,0.9:8,1.0:-1] [--prompts 64] [--new-tokens 16]

One row per case (``top_p``, ``top_k``) goes to ``bench/results/top_p_bias.jsonl``: the sampled
tokens, the mean and largest |log q - log p|, the mean and smallest weight Z, the share of tokens
whose step truncated anything, the share outside the truncated support (0: the engine draws from it),
and the largest |engine's log-prob - log p| (the engine reports the full softmax, as SGLang does).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, csv_list, provenance, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _case(text: str) -> tuple[float, int]:
    p, k = text.split(":")
    return float(p), int(k)


def measure(model: str, prompts: list[list[int]], top_p: float, top_k: int, new_tokens: int, seed: int,
            temperature: float) -> dict:
    """Sample ``prompts`` on the embedded engine with (top_p, top_k); compare per sampled token."""
    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.data.tiny_models import load_hf
    from areal_fast.embedded import start_engine_in_thread
    from areal_fast.embedded.sampling import SamplingParams, _filter_probs

    sampling = {"max_new_tokens": new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "ignore_eos": True}
    h = start_engine_in_thread(model, seed=seed, dtype="float32")
    try:
        async def gen():
            async with SGLangRolloutClient([h.url], gc_tuning=False) as c:
                return await asyncio.gather(*(c.generate(p, sampling) for p in prompts))
        samples = asyncio.run(gen())
    finally:
        h.stop()
    hf = load_hf(model)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    gaps, weights, reported_gap, truncated, outside = [], [], [], 0, 0
    with torch.no_grad():
        for s in samples:
            ids = list(s.prompt_ids) + list(s.output_ids)
            n_out = len(s.output_ids)
            logits = hf(torch.tensor([ids])).logits[0, len(s.prompt_ids) - 1:-1].float()
            full = torch.log_softmax(logits / temperature, dim=-1)  # the trainer's recompute
            probs = full.exp()
            kept = _filter_probs(probs, [params] * n_out)  # the engine's truncation (SGLang's rule)
            cut = (probs - kept).double().sum(-1)  # the mass truncated away (exactly 0 when nothing is)
            z = 1 - cut
            tok = torch.tensor(s.output_ids)[:, None]
            log_p = full.gather(1, tok)[:, 0].double()
            in_support = kept.gather(1, tok)[:, 0] > 0
            log_q = log_p - z.log()  # the truncated, renormalised distribution the token was drawn from
            gaps.append((log_q - log_p).abs())
            weights.append(z)
            reported_gap.append((torch.tensor(list(s.output_logprobs)).double() - log_p).abs())
            truncated += int((cut > 0).sum())
            outside += int((~in_support).sum())
    gap, w, rep = torch.cat(gaps), torch.cat(weights), torch.cat(reported_gap)
    n = int(gap.numel())
    return {"top_p": top_p, "top_k": top_k, "temperature": temperature, "tokens": n,
            "mean_abs_gap": gap.mean().item(), "max_abs_gap": gap.max().item(),
            "mean_weight": w.mean().item(), "min_weight": w.min().item(), "weight_bias": 1 - w.mean().item(),
            "truncated_share": truncated / n, "outside_support_share": outside / n,
            "reported_vs_full_max": rep.max().item()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="0.9:-1,1.0:8,0.9:8,1.0:-1", type=csv_list(cast=_case),
                    help="top_p:top_k pairs (top_k -1: off)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    add_harness_args(ap, dry_run=None)
    a = ap.parse_args(argv)
    prov = provenance(native=False)
    torch.set_num_threads(1)
    from areal_fast.config import load_config
    from areal_fast.data import load_tokenizer
    from areal_fast.data.warm_start import ensure_warm_start
    from areal_fast.launch.rank import load_data

    with tempfile.TemporaryDirectory(prefix="areal_bench_top_p_") as work:
        cfg = load_config(ROOT / "examples" / "tiny_reverse.yaml",
                          [f"experiment.output_dir={work}/run", f"experiment.seed={a.seed}"])
        model = str(ensure_warm_start(cfg.warm_start_recipe()))
        tok = load_tokenizer(model)
        _, evals = load_data(cfg, tok)
        prompts = [tok.encode(r.text) for r in evals[:a.prompts]]
        rows = [measure(model, prompts, p, k, a.new_tokens, a.seed, a.temperature) for p, k in a.cases]
    for r in rows:
        print(f"top_p {r['top_p']} top_k {r['top_k']}: {r['tokens']} tokens | |log q - log p| mean "
              f"{r['mean_abs_gap']:.4f} max {r['max_abs_gap']:.4f} | weight p/q mean {r['mean_weight']:.4f} "
              f"min {r['min_weight']:.4f} (bias {r['weight_bias']:.4f}) | truncated steps "
              f"{100 * r['truncated_share']:.1f} % | outside support {r['outside_support_share']} | engine vs "
              f"log p {r['reported_vs_full_max']:.2e}")
    save("top_p_bias", [{"seed": a.seed, "prompts": len(prompts), "new_tokens": a.new_tokens, **r} for r in rows],
         a, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
