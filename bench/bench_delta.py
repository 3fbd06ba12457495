"""Delta weight sync: how much of a bf16 model changes per optimizer step (``fraction``: a Qwen3-0.6B
shape under AdamW), what sending only that saves over gloo to a receiver that applies it (``gloo``,
checked bitwise), and at 7B / 32B across nodes from a network model (``sim``). docs/weight_sync.md.

    python bench/bench_delta.py [--parts fraction,gloo,sim] [--layers 4] [--steps 4]
                                [--results DIR] [--no-results] [--dry-run]

Results: ``bench/results/delta_fraction.json`` / ``.md``, ``delta_gloo.json``, ``delta_sim.json`` (and
rows in ``bench/results/delta.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    RESULTS_DIR,
    add_harness_args,
    csv_list,
    print_dry_run,
    provenance,
    save,
    serve_until_stopped,
    server_process,
)

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


# ------------------------------------------------------------------------------------------ gloo
def _gloo_shapes(n_params: float) -> dict[str, tuple[int, ...]]:
    """Qwen-like tensors (hidden 1024, MLP 4096, vocab 16384) summing to about ``n_params``."""
    h, inter = 1024, 4096
    out = {"model.embed_tokens.weight": (16384, h), "model.norm.weight": (h,)}
    layer = 4 * h * h + 3 * h * inter
    for i in range(max(1, int((n_params - 16384 * h) // layer))):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h, h),
                p + "self_attn.v_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,)}
    return out


def _digest(tensors) -> str:
    import hashlib

    d = hashlib.sha256()
    for t in tensors:
        d.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return d.hexdigest()


def _receiver_main(shapes, port_q, stop_ev):
    """A server (tp 1) that loads through the embedded engine's WeightReceiver: whole tensors and
    deltas, exactly as the engine does; says engine: areal_fast.embedded like the engine."""
    from areal_fast.embedded.weight_sync import WeightReceiver
    from tools.weight_receiver import receiver_handler, zero_model

    model = zero_model(shapes)
    recv = WeightReceiver(model, timeout_s=300)
    handle = receiver_handler(recv, routes={
        "/digest": lambda _body: {"digest": _digest(p for _n, p in model.named_parameters())}})
    serve_until_stopped(handle, port_q, stop_ev, client_max_size=1 << 26)


def _perturb(state: dict[str, torch.Tensor], frac: float, g: torch.Generator) -> None:
    """Move ``frac`` of the fp32 master by 1/128 relative: every moved element changes its bf16 value."""
    for t in state.values():
        m = torch.rand(t.shape, generator=g) < frac
        t[m] *= 1 + 2**-7


def bench_gloo(n_params: float, frac: float, updates: int = 4, bucket_mb: int = 64) -> list[dict]:
    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
    from areal_fast.weights.sync import SyncCalls, WeightSyncConfig

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    shapes = _gloo_shapes(n_params)
    rows = []
    for mode in ("off", "on"):  # "on": auto sends whole from a CPU trainer (docs/weight_sync.md)
        with server_process(_receiver_main, (shapes,), start_timeout_s=120) as url:
            g = torch.Generator().manual_seed(0)
            state = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
            sync = DistributedWeightSync([url], WeightSyncConfig(bucket_bytes=bucket_mb << 20, dtype="bfloat16",
                                                                 collective="gloo", timeout_s=300, delta=mode,
                                                                 delta_full_every=updates + 1))
            sync.connect()
            sync.update(state, 0)  # whole: plan, buffers, the shadow
            secs, sent, whole, changed = [], [], [], []
            for v in range(1, updates + 1):
                _perturb(state, frac, g)
                t = time.perf_counter()
                sync.update(state, v)
                secs.append(time.perf_counter() - t)
                st = sync.delta.stats if sync.delta is not None else None
                nbytes = sum(math.prod(s) * 2 for s in shapes.values())
                sent.append(st.bytes_sent if st else nbytes)
                whole.append(st.bytes_whole if st else nbytes)
                changed.append(st.changed_frac if st else float("nan"))
            calls = SyncCalls()
            got = calls.call(url, "/digest", {})["digest"]
            calls.close()
            want = _digest(t.to(torch.bfloat16) for t in state.values())
            sync.close()
            rows.append({"part": "gloo", "delta": mode, "params": sum(math.prod(s) for s in shapes.values()),
                         "target_changed_frac": frac, "changed_frac": float(np.nanmean(changed)),
                         "updates": updates, "bytes_whole": int(np.median(whole)), "bytes_sent": int(np.median(sent)),
                         "sent_over_whole": float(np.median(sent) / np.median(whole)),
                         "update_s_median": float(np.median(secs)), "update_s": secs,
                         "bitwise_equal_to_trainer": got == want, "bucket_bytes": bucket_mb << 20})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------------------------------- sim
SIM_MODELS = {"Qwen2.5-7B": 7.62e9, "Qwen2.5-32B": 32.76e9}  # parameters, from their config.json
# GPU side of a delta, per update: the encode reads the shadow and the new bucket (2 x 2 bytes per
# element) and writes 6 bytes per change, plus the shadow update (a scatter); the server's apply
# is a scatter. A scattered 2-byte write costs a 32-byte sector: 32 bytes per change, each side.
HBM_BYTES_PER_S = 3.35e12 * 0.7  # H100 SXM HBM3 at 70 %, as bench_async_speedup's decode model
SECTOR_BYTES = 32


def sim_constants() -> dict:
    """The weight-sync constants of the GPU simulator (bench/bench_async_speedup.py), so both agree."""
    try:
        from tools.gpu_model import CONSTANTS

        return {"nccl_bytes_per_s": CONSTANTS["nccl_bytes_per_s"][0], "sync_fixed_s": CONSTANTS["sync_fixed_s"][0]}
    except Exception:  # noqa: BLE001 - the simulator is being edited or cannot import: its values of today
        return {"nccl_bytes_per_s": 25e9, "sync_fixed_s": 1.0}


def bench_sim(frac: float, full_every: int = 10) -> list[dict]:
    c = sim_constants()
    rows = []
    for name, n in SIM_MODELS.items():
        for f in (frac, 0.8):
            whole_b = 2 * n
            delta_b = 6 * f * n if f <= 0.25 else whole_b  # above delta_max_changed every tensor goes whole
            if f <= 0.25:  # count + encode passes, shadow scatter; the server's scatter
                encode_s = (4 * n + (6 + 2 * SECTOR_BYTES) * f * n) / HBM_BYTES_PER_S
                apply_s = (6 * f * n + SECTOR_BYTES * f * n) / HBM_BYTES_PER_S
            else:  # the count refuses every tensor: one read of both, then the shadow copied
                encode_s, apply_s = 6 * n / HBM_BYTES_PER_S, 0.0
            whole_s = c["sync_fixed_s"] + whole_b / c["nccl_bytes_per_s"]
            delta_s = c["sync_fixed_s"] + delta_b / c["nccl_bytes_per_s"] + encode_s + apply_s
            shadow_s = 2 * n / HBM_BYTES_PER_S  # a whole update in delta mode also fills the shadow
            mean_s = ((full_every - 1) * delta_s + whole_s + shadow_s) / full_every
            rows.append({"part": "sim", "model": name, "params": n, "changed_frac": f, "bytes_whole": whole_b,
                         "bytes_delta": delta_b, "wire_s_whole": whole_b / c["nccl_bytes_per_s"],
                         "wire_s_delta": delta_b / c["nccl_bytes_per_s"], "encode_s": encode_s, "apply_s": apply_s,
                         "sync_s_whole": whole_s, "sync_s_delta": delta_s, "full_every": full_every,
                         "sync_s_delta_mean": mean_s, "speedup": whole_s / mean_s, **c,
                         "hbm_bytes_per_s": HBM_BYTES_PER_S})
    return rows


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
    ap.add_argument("--parts", type=csv_list(PARTS), default=list(PARTS), help=f"a subset of {','.join(PARTS)}")
    ap.add_argument("--layers", type=int, default=4, help="Qwen3-0.6B layers in the fraction model (of 28)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per learning rate")
    ap.add_argument("--gloo-params", type=float, default=100e6, help="bf16 parameters pushed in the gloo part")
    ap.add_argument("--gloo-frac", type=float, default=None,
                    help="changed fraction per update in the gloo part (default: fraction's lr 1e-6 steady state, "
                         "else 0.028)")
    ap.add_argument("--updates", type=int, default=4, help="updates per mode in the gloo part")
    add_harness_args(ap)
    a = ap.parse_args(argv)
    parts = a.parts
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
