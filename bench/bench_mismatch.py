"""The train/inference mismatch of bf16 and FP8 serving against the fp32 trainer on the tiny recipe's
warm start (dense, or the Qwen3-MoE one with ``--arches qwen3_moe``), measured on CPU: per server
(embedded engine, real vLLM's CPU build), dtype (``fp8``: the embedded engine in bf16 serving the
block-FP8 weights, ``--quantization fp8``), temperature and shape (``task``: the recipe's sampling;
``long``: ``--long-tokens`` with ``ignore_eos``), the dashboard's k1 / k3 and quantiles of
w = exp(p - b), the share outside [0.5, 2] and [0.8, 1.25], the per-sequence |sum log w|, the share
of tokens each correction acts on as the trainer's loss computes it (``acts_*``: TIS C = 2, IcePop
[0.5, 2], sequence MIS [0.5, 2], M2PO tau = 0.04), and for FP8 the same k1 / k3 against bf16
serving (``bf16_k1``, ``bf16_k3``: the served tokens scored by the bf16 model), docs/mismatch.md.

    python bench/bench_mismatch.py [--engines embedded,vllm] [--dtypes bfloat16,float32,fp8]
        [--arches qwen2,qwen3_moe] [--temperatures 1.0,0.6] [--samples 64] [--long-tokens 96]
        [--python PATH] [--results DIR | --no-results] [--dry-run]

Writes ``<results>/mismatch_<date>.{json,md}`` and one row per case to ``mismatch.jsonl`` (with ``fp8`` or
the MoE model: to ``mismatch_fp8.jsonl``).
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
# The corrections of the mismatch ablation (bench_mismatch_ablation.py), as trainer loss options.
CORRECTIONS = {"tis": {"tis_cap": 2.0}, "icepop": {"token_mis_lower": 0.5, "token_mis_upper": 2.0},
               "seq_mis": {"seq_mis_lower": 0.5, "seq_mis_upper": 2.0}, "m2po": {"m2po_tau": 0.04}}
ACTED = {"tis": "tis_truncated", "icepop": "token_mis_masked", "seq_mis": "seq_mis_masked", "m2po": "m2po_masked"}


def cases(args) -> list[dict]:
    return [{"arch": a, "engine": e, "dtype": d, "temperature": t, "shape": s}
            for a in args.arches for e in args.engines for d in args.dtypes for t in args.temperatures
            for s in ("task", "long") if not (e == "vllm" and d == "fp8")]


def acts_on(behav: list[list[float]], prox: list[list[float]]) -> dict:
    """The share of tokens each correction truncates or masks, computed by the trainer's loss
    constants (``ops.objective.token_constants``) on these per-sequence log-probs."""
    import torch

    from areal_fast.ops.loss_config import PPOLossConfig
    from areal_fast.ops.objective import token_constants

    b = torch.tensor([x for s in behav for x in s], dtype=torch.float64)
    p = torch.tensor([x for s in prox for x in s], dtype=torch.float64)
    cu = torch.tensor([0] + [len(s) for s in behav]).cumsum(0)
    ones = torch.ones_like(b)
    out = {}
    for name, kw in CORRECTIONS.items():
        c = token_constants(b, ones, ones, p, None, torch.float64, b.device, PPOLossConfig(**kw), cu_seqlens=cu)
        out[f"acts_{name}"] = float(getattr(c, ACTED[name]).double().mean())
    return out


def stats(samples: list[tuple[list[int], list[int], list[float]]], trainer, temperature: float,
          bf16_model=None) -> dict:
    """The mismatch of ``samples`` ((prompt, output, behaviour log-probs) each) against ``trainer``
    (and, given ``bf16_model``, k1 / k3 against it: FP8 serving against bf16 serving)."""
    import torch

    from areal_fast.data.tiny_models import hf_logprobs
    from areal_fast.ops.objective import mismatch_stats

    behav, prox, seq, per_b, per_p, bf16 = [], [], [], [], [], []
    for prompt, out, lps in samples:
        if not out:
            continue
        p = hf_logprobs(trainer, list(prompt), list(out), temperature)
        behav += lps
        prox += p
        per_b.append(list(lps))
        per_p.append(p)
        seq.append(abs(sum(a - b for a, b in zip(p, lps))))
        if bf16_model is not None:
            bf16 += hf_logprobs(bf16_model, list(prompt), list(out), temperature)
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
    row.update(acts_on(per_b, per_p))
    if bf16_model is not None:
        q = torch.tensor(bf16, dtype=torch.float64)
        vs = mismatch_stats(b, q, q, torch.ones_like(b))
        row["bf16_k1"], row["bf16_k3"] = vs["mismatch_k1"], vs["mismatch_k3"]
    return row


async def generate(client, prompts: list[list[int]], sampling: dict) -> list[tuple]:
    outs = await asyncio.gather(*(client.generate(p, sampling, rid=f"m{i}") for i, p in enumerate(prompts)))
    return [(p, list(s.output_ids), list(s.output_logprobs)) for p, s in zip(prompts, outs)]


def run_server(engine: str, dtype: str, model: Path, work: Path, args, prompts, task_sampling, trainer,
               arch: str = "qwen2", bf16_model=None) -> list[dict]:
    """Every temperature and shape on one server; the rows."""
    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.backends.vllm.client import VLLMRolloutClient
    from areal_fast.embedded import start_engine_in_thread
    from areal_fast.netutil import find_free_port

    if engine == "embedded":
        handle = (start_engine_in_thread(str(model), seed=1, dtype="bfloat16", quantization="fp8") if dtype == "fp8"
                  else start_engine_in_thread(str(model), seed=1, dtype=dtype))
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
                row = {"arch": arch, "engine": engine, "dtype": dtype, "temperature": t, "shape": shape,
                       **stats(samples, trainer, t, bf16_model if dtype == "fp8" else None)}
                print(json.dumps(row))
                rows.append(row)
    finally:
        stop()
    return rows


def write_md(path: Path, rows: list[dict], prov: dict, args) -> None:
    cols = ["arch", "engine", "dtype", "temperature", "shape", "tokens", "mismatch_k1", "mismatch_k3",
            "mismatch_ratio_p50", "mismatch_ratio_p99", "mismatch_ratio_max", "outside_0.5_2.0",
            "outside_0.8_1.25", "seq_abs_log_w_mean", "seq_abs_log_w_p90", "acts_tis", "acts_icepop",
            "acts_seq_mis", "acts_m2po", "bf16_k1", "bf16_k3"]

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"# bf16 / FP8 serving vs the fp32 trainer: the mismatch ({prov.get('date', '')})", "",
             f"`python bench/bench_mismatch.py --engines {','.join(args.engines)} --dtypes {','.join(args.dtypes)} "
             f"--arches {','.join(args.arches)} --temperatures {','.join(map(str, args.temperatures))} "
             f"--samples {args.samples} --long-tokens {args.long_tokens}` "
             f"on {prov.get('cpu', 'CPU')}, commit {prov.get('commit', '?')}.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default=["embedded", "vllm"], type=csv_list(("embedded", "vllm")))
    ap.add_argument("--dtypes", default=["bfloat16", "float32"], type=csv_list(("bfloat16", "float32", "fp8")),
                    help="fp8: the embedded engine only (vLLM's CPU build has block-FP8 kernels for AMX CPUs only)")
    ap.add_argument("--arches", default=["qwen2"], type=csv_list(("qwen2", "qwen3_moe")),
                    help="the warm start's model: the dense recipe's, or the Qwen3-MoE one")
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

    torch.set_num_threads(1)
    rows = []
    for arch in args.arches:
        cache = Path(tempfile.gettempdir()) / f"areal_fast_bench_mismatch{'' if arch == 'qwen2' else '_' + arch}"
        cfg = load_config(RECIPE, [f"experiment.output_dir={cache}", f"model.warm_start.arch={arch}"])
        rows += run_arch(arch, cfg, args, ap)
    prov = provenance(native=False)
    print_table(rows)
    if not args.no_results:
        stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M")
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"mismatch_{stamp}.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1) + "\n")
        write_md(out / f"mismatch_{stamp}.md", rows, prov, args)
        print(f"wrote {out / f'mismatch_{stamp}.md'}")
    # the FP8 / MoE study's rows in a file of their own: mismatch.jsonl's newest rows stay the dense bf16 study's
    save("mismatch" if args.arches == ["qwen2"] and "fp8" not in args.dtypes else "mismatch_fp8", rows, args, prov)
    return 0 if all(math.isfinite(r["mismatch_k3"]) for r in rows) else 1


def run_arch(arch: str, cfg, args, ap) -> list[dict]:
    """Every server and dtype on the warm start of ``arch``; the rows."""
    import torch

    from areal_fast.data import tiny_task
    from areal_fast.data.tiny_models import load_hf
    from areal_fast.data.tokenizer import CharTokenizer
    from areal_fast.data.warm_start import ensure_warm_start

    model = ensure_warm_start(cfg.warm_start_recipe())
    tok = CharTokenizer(tiny_task.vocabulary(cfg.data.synthetic))
    rows_eval = tiny_task.generate(cfg.data.synthetic, "eval", cfg.experiment.seed)
    prompts = [tok.encode(r["prompt"]) for r in (rows_eval * (1 + args.samples // max(1, len(rows_eval))))]
    prompts = prompts[:args.samples]
    if max(len(p) for p in prompts) + args.long_tokens > 128:
        ap.error(f"--long-tokens {args.long_tokens}: prompt + answer must fit the 128-token context")
    task_sampling = {"max_new_tokens": cfg.rollout.max_new_tokens, "stop_token_ids": [tok.eos_token_id]}
    trainer = load_hf(str(model))
    bf16_model = load_hf(str(model)).to(torch.bfloat16) if "fp8" in args.dtypes else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            for dtype in args.dtypes:
                if engine == "vllm" and dtype == "fp8":
                    continue  # no block-FP8 kernel in vLLM's CPU build without AMX (docs/mismatch.md)
                rows += run_server(engine, dtype, model, Path(tmp), args, prompts, task_sampling, trainer, arch,
                                   bf16_model)
    return rows


if __name__ == "__main__":
    sys.exit(main())
