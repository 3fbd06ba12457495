"""Named tolerances for the tests, one home, by dtype and purpose; each says why it is that size.

Import them (``from tolerances import FP32_REORDER_TOL``; ``tests/`` is on ``sys.path`` under
pytest) instead of writing numbers into a test. A tolerance is a claim about how wrong a result
may be: when one has to grow, change it here, with the new reason, never loosen it in a test.
Integer, index and copy results are compared exactly (``torch.equal``), not with a tolerance.
``tests/package/test_test_hygiene.py`` fails on a tolerance written as a number in a test.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------- float64
# fp64 arithmetic on a handful of numbers of size ~1 (advantages, batch normalisation): a few ulps.
FP64_FEW_OPS_ATOL = 1e-12
# fp64 evaluation of the same formulas in another order (reference vs reference): rounding only.
FP64_REORDER_TOL = 1e-10
# Python-float (fp64) arithmetic of a few ops on values of any size (a learning-rate schedule): relative.
FP64_FEW_OPS_RTOL = 1e-12
# A closed-form fp64 gradient vs autograd through the same per-token formula: a few ulps either way.
FP64_CLOSED_FORM_TOL = dict(atol=1e-12, rtol=1e-12)

# ------------------------------------------------------------------------------------- float32
# fp32 arithmetic of a few ops on values of size ~1-10 (a log-softmax of one row computed two ways,
# a one-hot row's log-prob and entropy, an interpolation of log-probs): a few ulps, ~1e-7.
FP32_FEW_OPS_ATOL = 1e-6
# A value of any size after one or a few fp32 roundings (a clamped ratio e^20, a metric a sink stores
# as fp32) against its exact value: relative ~6e-8 a rounding, the floor a decade and more above.
FP32_FEW_ROUNDINGS_RTOL = 1e-6
# exp of an fp32 argument near 87 (the largest before overflow): the argument's own rounding,
# 87 x 6e-8 = 5e-6, becomes the value's relative error; this sits 20x above.
FP32_LARGE_EXP_RTOL = 1e-4
# Means of per-token statistics (ratios, KLs, clip fractions, of size ~1) in fp32 vs the same means
# in fp64 or by hand: fp32 accumulation over <= a few hundred tokens.
FP32_STAT_ATOL = 1e-5
# An op's fast backend vs its reference on the tiny cases of the package check (fp32, tiny inputs).
FP32_TINY_OP_TOL = dict(rtol=1e-5, atol=1e-6)
# A weight's element sum as a server's loader received it vs the sum of the tensor we sent, both fp64:
# equal but for the order unless an element changed.
# Real vLLM's loader runs in its own process after a copy through the wire; SGLang's stand-in loader
# runs in this one on the same fp32 tensors: a decade tighter.
VLLM_LOADED_SUM_ATOL = 1e-5
SGLANG_LOADED_SUM_ATOL = 1e-6
# Kernel vs reference doing fp32 math on the same inputs; only the summation order differs
# (online log-sum-exp over <= 5003 vocabulary terms: relative error ~1e-6, floor above it).
FP32_REORDER_TOL = dict(atol=2e-5, rtol=2e-5)
# The flash-attention style accuracy rule's floor: a kernel may be 2x as wrong as torch at the same
# precision, but no error below this counts (fp32 accumulation over <= 5003 terms is ~1e-6).
FP32_ERR_FLOOR = 2e-5
# fp32 GEMMs in another blocking (the fused-linear loss's token chunks) plus fp32 loss math:
# a few ulps of the largest term, relative.
FP32_CHUNKED_GEMM_TOL = dict(atol=2e-5, rtol=2e-4)
# fp32 gradients that differ only by summation order (kernel vs reference backend, 2 ranks vs 1) or
# by the closed form vs autograd on small well-conditioned inputs: ~1e-7 relative; the tiny absolute
# floor covers the exact zeros of masked tokens.
FP32_GRAD_TOL = dict(atol=1e-7, rtol=1e-4)
# The Triton kernel's gradient, closed form dz = (g (onehot - P) - e P (log P + H)) / tau with
# block-wise reductions, vs autograd through the reference (-inf logits, masked rows, strided
# views): near-zero elements differ by up to ~1e-7 absolute; the floor sits a decade above.
FP32_GRAD_VS_AUTOGRAD_TOL = dict(atol=1e-6, rtol=1e-4)
# fp32 attention over <= 40 tokens, packed/varlen vs dense: summation order, ~1e-7 seen.
FP32_SHORT_ATTN_ATOL = 1e-5
# Its dK and dV: each summed over a KV head's query group (the repeat's backward) in another order
# than the dense reference's, on gradients of size up to ~10.
FP32_SHORT_ATTN_GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
# Log-probs of a tiny 2-layer fp32 model, packed vs one sequence at a time: ~1e-7 seen.
FP32_PACKED_LOGPROB_ATOL = 1e-5
# The trainer's LoRA forward (x W + s (x A) B) vs PEFT's, or vs the merged weights: the same fp32
# products associated otherwise, on top of the packing above.
FP32_LORA_LOGPROB_ATOL = 2e-5
# A tiny fp32 MoE's log-probs, the trainer's (packed, recorded routing replayed or not) vs HF's:
# the weighted sum of the chosen experts in another order as well.
FP32_MOE_LOGPROB_ATOL = 1e-4
# The same arithmetic by two paths that differ only by a no-op (a prox interpolation with alpha = 0,
# gradient checkpointing's recomputed forward): the loss and the parameters after the step, ~1 ulp.
FP32_SAME_MATH_ATOL = 1e-7
# ... and the gradient norm of those two paths (a reduction over every parameter): relative.
FP32_SAME_MATH_NORM_RTOL = 1e-5
# Parameters after the same optimizer steps on 2 ranks with several micro-batches vs 1 rank with one:
# fp32 gradient sums in another order (~1e-7 relative) through Adam's normalised step.
FP32_MULTI_RANK_PARAM_ATOL = 1e-6
# A step's metrics (loss, grad norm, ratio and KL means) on 2 ranks vs 1: fp32 sums in another
# order and an all-reduce; the absolute floor covers the metrics that are ~0.
FP32_MULTI_RANK_METRIC_TOL = dict(rel=1e-4, abs=1e-6)
# A LoRA run's loss (~1) on 2 ranks vs 1: the same, for one number.
FP32_MULTI_RANK_LOSS_ATOL = 1e-5
# A LoRA adapter after the same steps on 2 ranks vs 1: Adam's normalised step on freshly initialised
# factors (B = 0 at the start) carries the gradient's summation order further than for full weights.
FP32_MULTI_RANK_ADAPTER_ATOL = 2e-5
# The ratio of two advantage conventions (std with and without Bessel's correction) when each adds
# eps = 1e-5 to a std of ~1: eps moves the ratio by ~1e-5 relative.
ADV_STD_EPS_RTOL = 1e-4
# Behaviour log-probs from the fp32 inference engine (KV cache, left padding, batched) vs a fresh
# fp32 forward (or the trainer's recompute): ~1e-5 seen; this is the project's bound for them.
ENGINE_LOGPROB_ATOL = 1e-4
# vLLM's CPU build (its own fp32 attention and matmul kernels) vs the HF forward, at the tiny shapes
# of the real-vLLM tests: other kernels, not only another order.
VLLM_CPU_LOGPROB_ATOL = 2e-3
# The CUDA trainer's log-probs in fp32 (param_dtype float32, TF32 off by torch's default) vs HF's fp32
# forward on the CPU: other kernels (cuBLAS), as for vLLM's CPU build; not yet seen on a GPU.
FP32_CUDA_TRAINER_LOGPROB_ATOL = 2e-3

# -------------------------------------------------------------------------------------- bfloat16
# The CUDA trainer's log-probs with bf16 compute (param_dtype bfloat16: weights and activations with
# 8 bits of mantissa) vs HF's fp32 forward on the CPU, on a tiny 2-layer model.
BF16_TRAINER_LOGPROB_ATOL = 0.1
# The loss from the same bf16 GEMMs on both sides (fused-linear vs materialised logits), fp32 loss
# math after them: fp32 reordering only.
BF16_SAME_GEMM_LOSS_TOL = dict(atol=1e-5, rtol=1e-5)
# ... on the GPU, where the chunked and the whole GEMM need not run the same cuBLAS kernels.
BF16_GPU_SAME_GEMM_LOSS_TOL = dict(atol=1e-4, rtol=1e-4)
# Gradients where one side rounds the logits gradient to bf16 before the gradient GEMMs (as any bf16
# training does) and the other does not: 2^-9 relative a rounding, summed over the hidden size; as
# a fraction of the largest element.
BF16_GRAD_REL_OF_MAX = 0.02
# fp32 accumulation of bf16 products by chunks vs the exact fp64 sum: ~2^-24 x sum |terms|, as a
# fraction of the largest element (bf16-rounded partial sums would be ~2^-9).
FP32_ACCUM_OF_BF16_REL_OF_MAX = 1e-5
# The Triton kernel's log-probs of bf16 logits (upcast in registers, fp32 math) vs torch's fp32
# log-softmax of the upcast logits: the order only, with margin for the worst of 70,000 rows.
BF16_INPUT_KERNEL_LOGPROB_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16 flash attention on the GPU vs the fp32 reference: bf16 inputs and P, ~2^-9 relative each.
BF16_ATTN_OUT_TOL = dict(atol=2e-2, rtol=2e-2)
# ... its dQ, dK, dV: a second bf16 product chain on top.
BF16_ATTN_GRAD_TOL = dict(atol=5e-2, rtol=5e-2)

# ------------------------------------------------------------------------------------ sampling
# Empirical token frequencies of 40,000 draws vs the sampling distribution: one standard error of
# a frequency is at most sqrt(0.25 / 40000) = 0.0025, so this is 4.8 standard errors (two-sided,
# a false failure about once in 600,000 runs per compared frequency, at worst).
SAMPLED_FREQ_40K_ATOL = 0.012

# ------------------------------------------------------------------------------ figures and rates
# A rate over a fixed window of a synthetic timeline: the window's edges may cut a step.
WINDOW_RATE_RTOL = 0.05
# A model's figure against the value written with two decimals (docs, comments): the rounding.
TWO_DECIMALS_ATOL = 0.01
