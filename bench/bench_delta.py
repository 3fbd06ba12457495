"""Delta weight sync: how much of a bf16 model changes per optimizer step, and what sending only
that saves.

    python bench/bench_delta.py [--parts fraction,gloo,sim] [--layers 4] [--steps 4]
                                [--results DIR] [--no-results] [--dry-run]

* fraction: a Qwen3-0.6B-shaped model (its real config: hidden 1024, 16 heads, 8 KV heads,
  head_dim 128, MLP 3072, vocab 151936, tied embeddings; random weights, ``--layers`` of its 28
  layers because 2 CPU cores and shared memory cannot hold AdamW over 0.6B parameters; every
  layer has the same tensors, so per-tensor fractions do not depend on the count) trains with
  fp32 master weights and AdamW (the trainer's defaults: betas 0.9/0.999, eps 1e-8, no weight
  decay, global-norm clip 1.0) on a next-token loss over random tokens, at lr 1e-6 (the GPU
  example) and 2e-4 (the tiny example). After every step the bf16 cast that weight sync would
  send is compared bit for bit with the previous one: the fraction of changed elements per
  tensor, and the bytes of each encoding (indices + values ``6n``, bitmask + values
  ``N/8 + 2n``, whole ``2N``).
* gloo: ``DistributedWeightSync`` (CPU, gloo over loopback) pushing a bf16 model to a receiver
  process that applies what it gets (whole buckets, or deltas through
  ``areal_fast.weights.delta.apply_named``) with and without ``delta``: bytes on the wire and
  seconds per update, at a changed fraction taken from ``fraction`` (or ``--gloo-frac``); the
  receiver's weights are checked bitwise against the trainer's after the run.
* sim: the same for Qwen2.5-7B / 32B across nodes, from the wire bytes and a network model
  (400 Gb/s InfiniBand per node at 80 % efficiency, as the GPU simulator's weight-sync cost) plus
  the encode and apply passes at HBM speed (H100, 3.35 TB/s at 70 %).

Results: ``bench/results/delta_fraction.json`` / ``.md``, ``delta_gloo.json``, ``delta_sim.json`` (and
rows in ``bench/results/delta.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, add_harness_args, print_dry_run, provenance, save  # noqa: E402

# Qwen3-0.6B's config.json (the fields that set tensor shapes)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rms_norm_eps=1e-6,
                 max_position_embeddings=40960, rope_theta=1000000.0)
LRS = {"gpu_example_1e-6": 1e-6, "tiny_example_2e-4": 2e-4}


def _kind(name: str) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.N.", name)


def encodings(n_changed: int, numel: int) -> dict:
    """Wire bytes of each encoding of ``n_changed`` changes among ``numel`` bf16 elements."""
    return {"indices_values": 6 * n_changed, "bitmask_values": -(-numel // 8) + 2 * n_changed, "whole": 2 * numel}


def bench_fraction(layers: int = 4, steps: int = 4, tokens: int = 128, seed: int = 0) -> list[dict]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rows = []
    for tag, lr in LRS.items():
        torch.manual_seed(seed)
        cfg = Qwen3Config(num_hidden_layers=layers, **QWEN3_06B)
        model = Qwen3ForCausalLM(cfg).float()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        params = dict(model.named_parameters())
        prev = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        g = torch.Generator().manual_seed(seed + 1)
        for step in range(1, steps + 1):
            ids = torch.randint(0, cfg.vocab_size, (2, tokens // 2), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tot_n = tot_c = 0
            per = {}
            for n, p in params.items():
                cur = p.detach().to(torch.bfloat16)
                c = int((cur.view(torch.int16) != prev[n].view(torch.int16)).sum())
                per[n] = (c, p.numel())
                tot_n, tot_c = tot_n + p.numel(), tot_c + c
                prev[n] = cur
            kinds: dict[str, list[int]] = {}
            for n, (c, num) in per.items():
                k = kinds.setdefault(_kind(n), [0, 0])
                k[0] += c
                k[1] += num
            enc = encodings(tot_c, tot_n)
            rows.append({"part": "fraction", "lr_tag": tag, "lr": lr, "step": step, "layers": layers,
                         "tokens": tokens, "loss": float(loss.detach()), "params": tot_n, "changed": tot_c,
                         "changed_frac": tot_c / tot_n, **{f"bytes_{k}": v for k, v in enc.items()},
                         "per_kind": {k: {"changed_frac": c / num, "numel": num} for k, (c, num) in kinds.items()},
                         "per_tensor": {n: c / num for n, (c, num) in per.items()}})
            print(f"{tag} step {step}: changed {tot_c / tot_n:.4%} of {tot_n} bf16 elements", flush=True)
        del model, opt, params, prev
    return rows


def fraction_markdown(rows: list[dict]) -> str:
    out = ["| lr | step | changed | indices+values | bitmask+values | whole |", "|---|---|---|---|---|---|"]
    for r in rows:
        w = r["bytes_whole"]
        out.append(f"| {r['lr']:g} | {r['step']} | {r['changed_frac']:.3%} | {r['bytes_indices_values'] / w:.2%} | "
                   f"{r['bytes_bitmask_values'] / w:.2%} | 100% |")
    kinds = sorted(rows[0]["per_kind"])
    out += ["", "Per tensor kind, mean over steps 2.. (step 1 of Adam moves every element by ~lr):", "",
            "| tensor | elements | " + " | ".join(f"lr {r}" for r in LRS.values()) + " |",
            "|---|---|" + "---|" * len(LRS)]
    for k in kinds:
        cells = []
        for tag in LRS:
            fr = [r["per_kind"][k]["changed_frac"] for r in rows if r["lr_tag"] == tag and r["step"] > 1]
            cells.append(f"{np.mean(fr):.3%}" if fr else "-")
        out.append(f"| `{k}` | {rows[0]['per_kind'][k]['numel']:,} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


PARTS = ("fraction", "gloo", "sim")


def _write(name: str, rows: list[dict], prov: dict, a, md: str | None = None) -> None:
    if a.no_results:
        return
    out = Path(a.results) if a.results else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1, default=str) + "\n")
    if md is not None:
        (out / f"{name}.md").write_text(md)
    save("delta", [{k: v for k, v in r.items() if k != "per_tensor"} for r in rows], a, prov)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--layers", type=int, default=4, help="Qwen3-0.6B layers in the fraction model (of 28)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per learning rate")
    ap.add_argument("--gloo-params", type=float, default=100e6, help="bf16 parameters pushed in the gloo part")
    ap.add_argument("--gloo-frac", type=float, default=None,
                    help="changed fraction per update in the gloo part (default: fraction's lr 1e-6 steady state, "
                         "else 0.028)")
    ap.add_argument("--updates", type=int, default=4, help="updates per mode in the gloo part")
    add_harness_args(ap)
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {PARTS}")
    if a.dry_run:
        print_dry_run("delta", [{"part": p, "layers": a.layers, "steps": a.steps, "gloo_params": a.gloo_params}
                                for p in parts])
        return
    prov = provenance()
    frac = a.gloo_frac
    for part in parts:
        if part == "fraction":
            rows = bench_fraction(a.layers, a.steps)
            _write("delta_fraction", rows, prov, a, fraction_markdown(rows))
            steady = [r["changed_frac"] for r in rows if r["lr"] == 1e-6 and r["step"] > 1]
            frac = frac if frac is not None else float(np.mean(steady))
        elif part == "gloo":
            rows = bench_gloo(a.gloo_params, 0.028 if frac is None else frac, a.updates)
            _write("delta_gloo", rows, prov, a)
            print(json.dumps(rows, indent=1))
        else:
            rows = bench_sim(0.028 if frac is None else frac)
            _write("delta_sim", rows, prov, a)
            print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
