"""FP8 serving in the embedded engine (``--quantization fp8``, the flag SGLang and vLLM take).

GPU servers hold a block-quantised linear weight as E4M3 elements plus one fp32 scale per 128 x 128
block and multiply with it (DeepGEMM / CUTLASS / Triton block-FP8 GEMMs). The embedded engine holds
the same weights *dequantised per block at load*: every FP8 weight it receives (and, at launch, every
linear weight of its checkpoint, quantised by the trainer's codec as a GPU server's FP8 checkpoint
would be) is stored as ``fp8 x scale`` in its compute dtype, so the rollout samples from the weights
a GPU server would use. What differs is the GEMM: ours multiplies those values in fp32 (CPU) or bf16
(CUDA), a GPU server in FP8 with fp32 accumulation, after quantising the *activations* per token and
128 channels as well (``activation_scheme: dynamic``); the embedded engine leaves activations as they
are (see ``docs/mismatch.md``). No FP8 matmul serves this on CPU: torch 2.13's ``torch._scaled_mm``
runs on CPU but only with one scale per tensor or per row/column, not per 128 x 128 block.

The weights arriving from the trainer are dequantised by :meth:`WeightReceiver.load
<areal_fast.embedded.weight_sync.WeightReceiver.load>` (``weights.fp8.dequantize_state``).
"""

from __future__ import annotations

import torch

from areal_fast.weights.experts import checkpoint_views
from areal_fast.weights.fp8 import dequantize, is_quantized, quantize

QUANTIZATIONS = (None, "fp8")


def serve_fp8(model: torch.nn.Module) -> int:
    """Replace every linear weight of ``model`` (per expert for fused MoE experts, in place) by its
    block-FP8 value, as a server loading the FP8 checkpoint of these weights holds it. Returns how
    many weights were quantised."""
    params = dict(model.named_parameters())
    params.update(checkpoint_views(params))
    n = 0
    with torch.no_grad():
        for name, p in params.items():
            if is_quantized(name, p.shape):
                p.copy_(dequantize(*quantize(p), dtype=p.dtype))
                n += 1
    return n
