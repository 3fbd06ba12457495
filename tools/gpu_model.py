"""The GPU-time model of the loop at the AReaL paper's scale: the paper's models, every constant with
its source or labelled an assumption (:data:`CONSTANTS`), one training step's seconds and one SGLang
server's batching decode model. Read by the simulated runs (``bench/bench_async_speedup.py``,
``bench/bench_autoscale.py``, ``tools/sim_loop.py``) and by the weight-sync constants of
``bench/bench_delta.py``, so they all agree; docs/scale.md says where each number comes from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tools import sim_sglang as sim


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


# Architectures from the models' Hugging Face config.json (the models the paper trains).
MODELS = {
    "1.5B": ModelSpec("DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9, 28, 1536, 2, 128),
    "7B": ModelSpec("DeepSeek-R1-Distill-Qwen-7B", 7.62e9, 28, 3584, 4, 128),
}

CONSTANTS = {
    "gpu": ("H800 / H100 SXM", "NVIDIA H100 datasheet; the H800 differs only in NVLink (400 GB/s) and FP64"),
    "hbm_bytes_per_s": (3.35e12, "H100 SXM HBM3 bandwidth, NVIDIA datasheet"),
    "bf16_flops": (989e12, "H100 SXM dense BF16 tensor-core peak, NVIDIA datasheet (1,979 with sparsity)"),
    "hbm_efficiency": (0.7, "assumption: fraction of HBM peak a decode step achieves (weights + KV reads)"),
    "step_overhead_s": (0.003, "assumption: per decode step scheduling, sampling and launch time with CUDA graphs"),
    "per_seq_overhead_s": (10e-6, "assumption: per running request per step (batch bookkeeping, sampling)"),
    "decode_mfu": (0.5, "assumption: compute efficiency of the per-token matmuls in a large decode batch"),
    "prefill_mfu": (0.5, "assumption: prefill efficiency (2 x params FLOPs per token)"),
    "train_mfu": (0.35, "assumption: FSDP training MFU on long packed sequences (public reports 30-50%)"),
    "kv_mem_fraction": (0.85, "assumption: SGLang --mem-fraction-static-like share of 80 GB for weights + KV"),
    "nccl_bytes_per_s": (25e9, "assumption: trainer -> servers weight broadcast, ~half of a 400 Gb/s NIC"),
    "sync_fixed_s": (1.0, "assumption: pause, update call, continue around a weight broadcast"),
    "colocated_switch_s": (3.0, "assumption: sync arm, per step: release and reload the engine's memory"),
    "host_bytes_per_s": (20e9, "assumption: sync arm weight reload into the colocated engine (PCIe-class)"),
    "len_median": (4000, "assumption: median answer length (log-normal, sigma 1.0) of R1-distilled models"),
    "len_sigma": (1.0, "assumption: 1.9% of answers reach 8x the median"),
    "len_max": (32768, "the paper's maximum generation length (32k context)"),
    "prompt_tokens": (512, "assumption: math prompt with chat template"),
    "group_size": (16, "the paper: 16 answers per prompt"),
    "batch_prompts": (512, "the paper: 512 prompts per step"),
    "eta": (4, "the paper's default maximum staleness"),
    "paper_speedup": ("2.57-2.77x", "AReaL paper: end-to-end training throughput of AReaL vs the synchronous system"),
    "no_overlap_slowdown": (1.10, "assumption: decode step time with --disable-overlap-schedule (needed by in_place "
                                  "pauses) over with it; the overlap scheduler's published gain is of this order "
                                  "(SGLang v0.4 announcement); 'in_place_ideal' arms take 1.0"),
}


def c(name: str):
    return CONSTANTS[name][0]


def train_seconds(model: ModelSpec, seq_lens: list[int], gpus: int) -> float:
    """One step: forward + backward (3 forward passes' FLOPs) + the proximal log-prob forward = 4
    forwards of 2 * params FLOPs per token, plus causal attention (2 * layers * hidden * n^2 per
    forward of a sequence of n tokens), at ``train_mfu`` of ``gpus`` GPUs' peak."""
    fwd = sum(2 * model.params * n + 2 * model.layers * model.hidden * n * n for n in seq_lens)
    return 4 * fwd / (gpus * c("bf16_flops") * c("train_mfu"))


def decode_config(model: ModelSpec, s: int, k: float, seed: int) -> sim.SimConfig:
    """The batching decode model of one SGLang server on one GPU (see CONSTANTS)."""
    bw = c("hbm_bytes_per_s") * c("hbm_efficiency")
    a = c("step_overhead_s") + model.weight_bytes / bw
    b = c("per_seq_overhead_s") + 2 * model.params / (c("bf16_flops") * c("decode_mfu"))
    kv_tokens = (80e9 * c("kv_mem_fraction") - model.weight_bytes) / model.kv_bytes_per_token
    mean_len = c("len_median") * math.exp(c("len_sigma") ** 2 / 2)
    return sim.SimConfig(decode_a_s=a, decode_b_s=b, decode_c_s=model.kv_bytes_per_token / bw,
                         prefill_tokens_per_s=c("bf16_flops") * c("prefill_mfu") / (2 * model.params),
                         max_running=max(1, min(1024, int(kv_tokens / (c("prompt_tokens") + mean_len)))),
                         len_median=c("len_median"), len_sigma=c("len_sigma"), len_max=c("len_max"),
                         tokens_per_token=s, time_scale=k, seed=seed, api_key="bench-key")
