"""Named tolerances for the tests, one home, by dtype and purpose; each says why it is that size.

Import them (``from tolerances import FP32_REORDER_TOL``; ``tests/`` is on ``sys.path`` under
pytest) instead of writing numbers into a test. A tolerance is a claim about how wrong a result
may be: when one has to grow, change it here, with the new reason, never loosen it in a test.
Integer, index and copy results are compared exactly (``torch.equal``), not with a tolerance.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------- float64
# fp64 arithmetic on a handful of numbers of size ~1 (advantages, batch normalisation): a few ulps.
FP64_FEW_OPS_ATOL = 1e-12
# fp64 evaluation of the same formulas in another order (reference vs reference): rounding only.
FP64_REORDER_TOL = 1e-10

# ------------------------------------------------------------------------------------- float32
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
# Log-probs of a tiny 2-layer fp32 model, packed vs one sequence at a time: ~1e-7 seen.
FP32_PACKED_LOGPROB_ATOL = 1e-5
# Parameters after the same optimizer steps on 2 ranks with several micro-batches vs 1 rank with one:
# fp32 gradient sums in another order (~1e-7 relative) through Adam's normalised step.
FP32_MULTI_RANK_PARAM_ATOL = 1e-6
# Behaviour log-probs from the fp32 inference engine (KV cache, left padding, batched) vs a fresh
# fp32 forward (or the trainer's recompute): ~1e-5 seen; this is the project's bound for them.
ENGINE_LOGPROB_ATOL = 1e-4

# ------------------------------------------------------------------------------------ sampling
# Empirical token frequencies of 40,000 draws vs the sampling distribution: one standard error of
# a frequency is at most sqrt(0.25 / 40000) = 0.0025, so this is 4.8 standard errors (two-sided,
# a false failure about once in 600,000 runs per compared frequency, at worst).
SAMPLED_FREQ_40K_ATOL = 0.012
