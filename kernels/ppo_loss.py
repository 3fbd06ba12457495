"""Triton kernels of the decoupled-PPO loss: per-row log-softmax statistics and dloss/dlogits.

One program per row (token), a 1-D grid: grid dimension 0 allows 2**31 - 1 programs, so there
is no limit on T in practice (Liger's cross-entropy uses a 2-D launch that fails at T >= 65,536).
Row offsets are computed in int64 (T * V passes 2**31 at T = 14,124 for V = 152,064).

Forward (``token_stats_fwd``): one pass over the vocabulary in blocks with an online
log-sum-exp kept *per lane* (each of the BLOCK_V lanes carries its own running max m, s = sum
exp(x - m) and t = sum exp(x - m) x across the loop), and one cross-lane reduction after it:
the loop body has no barrier or shuffle (the first version reduced three block-wide values per
block: 6 barriers and 24 shuffles per iteration in the sm_90a code). Exponentials are exp2 with
log2(e) folded into the 1/tau scale, one exp2 per element (the max either moves, and the old sums
are rescaled, or it does not, and the new term is exponentiated). Then lse = m + log s,
H = lse - t / s and l = x_y - lse. Nothing of size [T, V] is written. Non-finite logits give what
torch.logsumexp gives (docs/objective.md, "Non-finite logits"): the floors are NaN-propagating
maxima (``max.NaN.f32``, same instruction count), so a lane's running max turns NaN at a NaN
logit and stays NaN; after the loop a NaN lane makes lse, l and H NaN, a +inf maximum makes lse
+inf and H NaN (the sums, which saw inf - inf, are not used then).

Compiled for sm_90a (bf16, V = 151,936: BLOCK_V 4096, 8 warps, maxnreg 80; figures from
``tools/static_sm90.py``, committed in bench/results/static_sm90-triton*.json):
Triton 3.9 (ptxas 13.4) 72 registers, no spill, 13.7 SASS instructions per element in the loop
(the first version with block-wide reductions: 19.6 and 48 registers); Triton 3.6 (ptxas 12.8)
72 registers, no spill, 14.7 per element (without maxnreg it stopped at 64 registers and spilled
4 bytes inside the loop: 15.6 per element). 3 blocks = 24 warps per SM, ~24 KB of loads in
flight per SM.

Backward (``token_stats_bwd``): given g = dloss/dl and e = dloss/dH per row (computed by the
shared [T]-sized objective), recompute P blockwise from z and lse and write
``dz = (g (onehot(y) - P) - e P (log P + H)) / tau`` in the dtype of the output buffer, which may
be the logits buffer itself (each block is read before it is overwritten by the same program).
Rows with g = e = 0 (prompt and padding tokens) write zeros without reading the logits. Also in
base 2 with the 1/tau scale folded in: 15.1 SASS instructions per element (was 23.2), 32 registers,
no spill, under Triton 3.6 and 3.9 alike.

All arithmetic is fp32 right after the load (bf16 arithmetic gives zeros in the interpreter).
Loads and stores are 16-byte vectors when the row stride is a multiple of 16 elements (Triton's
JIT specialises on it; V = 32000, 151936, 152064 all are), else scalar: checked by compiling for
sm_90 ahead of time in tests/ops/test_ppo_loss_kernels.py. Not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_fast.dispatch import interpreter_enabled

# 4096 bf16 elements = 8 KiB per block and 8 warps: 16 elements per thread per iteration,
# enough loads in flight to keep HBM busy; V = 152,064 is 38 iterations per row.
MAX_BLOCK_V = 4096
# The forward's 48 per-lane accumulators (16 elements x m, s, t per thread at 8 warps) need ~72
# registers. Left to itself, Triton 3.6's ptxas (CUDA 12.8) caps the kernel at 64 registers and
# spills 4 bytes inside the vocabulary loop (2 STL/LDL per iteration, 15.6 SASS per element);
# allowing 80 gives 72 registers, no spill, 14.7 per element. Triton 3.9 (ptxas 13.4) uses 71-72
# either way. 72 registers x 256 threads still fit 3 blocks (24 warps) per SM, as 71 did.
FWD_MAXNREG = 80
# Under the interpreter each block costs Python overhead; small blocks also make the tiny test
# vocabularies (V ~ 200..1000) take several iterations, exercising the online update and tails.
INTERPRET_BLOCK_V = 128


def _block_v(V: int) -> int:
    cap = INTERPRET_BLOCK_V if interpreter_enabled() else MAX_BLOCK_V
    return max(16, min(triton.next_power_of_2(V), cap))


def launch_config(V: int, forward: bool) -> dict:
    """The meta-parameters the launchers pass for a vocabulary of ``V`` (one place, so that the
    ahead-of-time compile in ``tools/static_sm90.py`` checks exactly what runs)."""
    block_v = _block_v(V)
    meta = dict(BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)
    if forward and not interpreter_enabled():
        meta["maxnreg"] = FWD_MAXNREG
    return meta


@triton.jit
def _ppo_token_stats_fwd_kernel(Z, stride_z, LABELS, LOGP, ENT, LSE, V, inv_tau, BLOCK_V: tl.constexpr):
    # Work in base 2: u = z * inv_tau * log2(e), so exp(x) = exp2(u) with one multiply per element.
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    # Scaled logits below -1e30 count as -inf (a logit that low has probability 0 in fp32 anyway).
    NEG_FLOOR: tl.constexpr = -1e30
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    scale = inv_tau * LOG2E
    # Per-lane online statistics, reduced across lanes once after the loop: m = running max of u,
    # s = sum exp2(u - m), t = sum exp2(u - m) * u. No cross-lane reduction (barrier) per block.
    m = tl.full((BLOCK_V,), NEG_FLOOR, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    t = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        u = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
        # -inf (tail, masked vocabulary) -> a finite floor: no inf - inf or 0 * inf, no selects. A
        # floored entry counts 1 at scale 2^NEG_FLOOR, rescaled to exactly 0 once the lane (or,
        # after the loop, the row) sees a real value. NaN stays NaN (max.NaN.f32: the plain
        # max.f32, like the interpreter's np.fmax, returns the other operand, which turned a NaN
        # logit into probability 0 and a finite log-prob).
        u = tl.maximum(u, NEG_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        # One exp2 per element: with d = u - m, either the max moves (d > 0: rescale the old sums
        # by exp2(-d), the new term is 1) or it does not (the new term is exp2(d)).
        d = u - m
        e = tl.exp2(-tl.abs(d))
        up = d > 0
        alpha = tl.where(up, e, 1.0)
        p = tl.where(up, 1.0, e)
        s = s * alpha + p
        t = t * alpha + p * u
        # a lane that saw a NaN keeps m = NaN (and s, t NaN) to the end; +inf and -inf never make
        # m NaN, so NaN in m means a NaN logit, whatever inf - inf the sums went through
        m = tl.maximum(m, u, propagate_nan=tl.PropagateNan.ALL)
    has_nan = tl.sum((m != m).to(tl.int32), 0) > 0
    m_row = tl.max(m, 0)
    w = tl.exp2(m - m_row)
    s_row = tl.sum(s * w, 0)
    t_row = tl.sum(t * w, 0)
    lse2 = m_row + tl.log2(s_row)  # log-sum-exp in base-2 units of u
    # Non-finite rows as torch.logsumexp has them: a NaN logit makes lse NaN; else a +inf logit
    # makes it +inf (the sums, inf - inf in them, are not used); a row whose logits are all -inf (or
    # below the floor) has no distribution: lse = -inf. The entropy of all three is NaN, as in torch.
    lse2 = tl.where(m_row > NEG_FLOOR, lse2, float("-inf"))
    lse2 = tl.where(m_row == float("inf"), float("inf"), lse2)
    lse2 = tl.where(has_nan, float("nan"), lse2)
    lse = lse2 * LN2
    ent = (lse2 - t_row / s_row) * LN2
    ent = tl.where(has_nan | (m_row == float("inf")) | (m_row <= NEG_FLOOR), float("nan"), ent)
    label = tl.load(LABELS + row).to(tl.int64)
    valid = (label >= 0) & (label < V)
    x_y = tl.load(z_row + tl.where(valid, label, 0)).to(tl.float32) * inv_tau
    logp = tl.where(valid, x_y - lse, 0.0)
    tl.store(LOGP + row, logp)
    tl.store(ENT + row, ent)
    tl.store(LSE + row, lse)


@triton.jit
def _ppo_token_stats_bwd_kernel(Z, stride_z, G, stride_g, LABELS, LSE, ENT, GRAD_LOGP, GRAD_ENT, V, inv_tau,
                                BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    g_row = G + row * stride_g
    offs = tl.arange(0, BLOCK_V)
    g = tl.load(GRAD_LOGP + row).to(tl.float32)
    e = tl.load(GRAD_ENT + row).to(tl.float32)
    if (g == 0.0) & (e == 0.0):
        zeros = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            tl.store(g_row + cols, zeros.to(G.dtype.element_ty), mask=cols < V)
    else:
        LOG2E: tl.constexpr = 1.4426950408889634
        LN2: tl.constexpr = 0.6931471805599453
        # exp2 of anything below -200 is exactly 0 in fp32 (the smallest denormal is 2^-149), so
        # flooring log2 P there changes no value and keeps -inf logits out of 0 * inf.
        LOG2P_FLOOR: tl.constexpr = -200.0
        scale = inv_tau * LOG2E
        # lse = -inf (a row of -inf logits) -> a finite floor: no -inf - -inf below. NaN and +inf stay.
        lse2 = tl.maximum(tl.load(LSE + row).to(tl.float32) * LOG2E, -1e30, propagate_nan=tl.PropagateNan.ALL)
        ent = tl.load(ENT + row).to(tl.float32)
        label = tl.load(LABELS + row).to(tl.int64)
        g_s = g * inv_tau
        e_s = e * inv_tau
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            # base 2 as in the forward: P = exp2(u - lse2), log P = (u - lse2) ln 2;
            # dz = (g (onehot - P) - e P (log P + H)) / tau, regrouped as below
            u = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
            # NaN-propagating floor: a NaN logit (or lse) gives a NaN gradient, not P = 0
            logP2 = tl.maximum(u - lse2, LOG2P_FLOOR, propagate_nan=tl.PropagateNan.ALL)
            P = tl.exp2(logP2)
            dz = tl.where(cols == label, g_s, 0.0) - P * (g_s + e_s * (logP2 * LN2 + ent))
            tl.store(g_row + cols, dz.to(G.dtype.element_ty), mask=cols < V)


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, V] with unit stride on V, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if labels.shape != (logits.shape[0],) or (labels.numel() > 0 and labels.stride(0) != 1):
        raise ValueError(f"labels must be a contiguous [T] tensor, got {tuple(labels.shape)}")


def token_stats_fwd(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """(logp, entropy, lse) fp32 [T] of softmax(logits / temperature); lse is of logits / temperature."""
    _check(logits, labels)
    T, V = logits.shape
    logp = torch.empty(T, dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    if T == 0:
        return logp, ent, lse
    _ppo_token_stats_fwd_kernel[(T,)](logits, logits.stride(0), labels, logp, ent, lse, V, 1.0 / temperature,
                                      **launch_config(V, forward=True))
    return logp, ent, lse


def token_stats_bwd(grad_out: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                    ent: torch.Tensor, grad_logp: torch.Tensor, grad_ent: torch.Tensor, temperature: float) -> None:
    """Write dloss/dlogits into ``grad_out`` (may be ``logits`` itself for an in-place gradient)."""
    _check(logits, labels)
    T, V = logits.shape
    if grad_out.shape != logits.shape or grad_out.stride(1) != 1:
        raise ValueError(f"grad_out must be [T, V] with unit stride on V, got {tuple(grad_out.shape)}")
    if T == 0:
        return
    _ppo_token_stats_bwd_kernel[(T,)](logits, logits.stride(0), grad_out, grad_out.stride(0), labels, lse, ent,
                                      grad_logp.contiguous(), grad_ent.contiguous(), V, 1.0 / temperature,
                                      **launch_config(V, forward=False))
