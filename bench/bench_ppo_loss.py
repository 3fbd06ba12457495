"""Benchmark of the fused decoupled-PPO loss (areal_fast.ops) against a same-size copy and torch, bf16
forward + backward on realistic batches (``realistic_batch``): ``from_logits`` [T, V] (our Triton
kernels, also with the gradient in place and forward alone, against the copy, the eager reference,
``torch.compile`` of it and Liger when installed) and ``fused_linear`` (hidden @ W^T + loss without
the whole logits, against the bare lm_head GEMMs and the materialised path). The bytes and FLOP
models and the memory guard: docs/benchmarks.md. ``bytes_moved`` counts what the kernels really move,
``(2 * T + active_rows) * V * 2``; ``ratio_to_3pass_roofline`` is the time over ``3 * T * V * 2`` bytes
at the datasheet HBM rate. On CPU it runs tiny shapes of the reference only, and says so.

    python bench/bench_ppo_loss.py [--quick | --production] [--skip-compile] [--skip-fused] [--skip-logits]
                                   [--skip-liger] [--results DIR] [--no-results] [--dry-run]

Rows go to bench/results/ppo_loss.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.ops import (  # noqa: E402
    decoupled_ppo_loss,
    decoupled_ppo_loss_ref,
    fused_linear_decoupled_ppo_loss,
    fused_linear_token_logprobs,
    token_logprobs,
)
from areal_fast.ops.custom_ops import weight_grad_path  # noqa: E402
from areal_fast.ops.fused_linear import default_chunk_size  # noqa: E402
from bench.common import add_harness_args, device_peaks, print_dry_run, print_table, provenance, save, time_fn  # noqa: E402

OPTS = dict(eps_clip=0.2, eps_clip_higher=0.28, token_mis_upper=5.0, importance_level="token",
            loss_agg="token-mean")
LOGIT_PASSES_FWD_BWD = 3  # forward read, backward read, gradient write
LOGIT_PASSES_COPY = 2  # read + write
FREE_FRACTION = 0.9  # leave 10% of the free memory to the allocator's fragmentation and workspaces

QUICK = {"logits": [(4096, 32000)], "fused": [(4096, 1536, 151936)]}
DEFAULT = {"logits": [(T, V) for V in (32000, 151936) for T in (4096, 16384, 32768)],
           "fused": [(T, H, 151936) for H in (1536, 3584) for T in (4096, 16384, 32768)]}
# the GPU suite's shapes: 16k also, where the eager reference (EAGER_BYTES_PER_LOGIT: ~74 GiB) fits an H200
PRODUCTION = {"logits": [(16384, 151936), (32768, 151936)], "fused": [(32768, 3584, 151936)]}


# ------------------------------------------------------------------------------- memory estimates
# The eager reference's peak beyond its bf16 logits, per logit: its autograd graph holds 23 T V bytes
# live at once (the fp32 upcast, log-softmax, softmax, the gradient's fp32 terms, the bf16 gradient;
# counted tensor by tensor on CPU by tests/bench/test_bench_gpu_guards.py), and on CUDA the
# caching allocator's blocks and fragmentation took the peak to 27-31 T V. 32 bounds that; the old
# 22 let the reference start at 32k x 151,936 on a 141 GB card, where it cannot fit.
EAGER_BYTES_PER_LOGIT = 32


def logits_extra_bytes(T: int, V: int) -> dict[str, int]:
    """Bytes each from-logits variant allocates beyond the bf16 logits (2 T V) it is given."""
    tv = T * V
    return {
        "copy": 2 * tv,  # the destination
        "ours": 2 * tv,  # the bf16 gradient; per-row stats are O(T)
        "ours_inplace": 2 * tv,  # a clone of the logits that receives the gradient
        "fwd": 0,
        "eager": EAGER_BYTES_PER_LOGIT * tv,  # ~6 fp32 [T, V] and the bf16 grad, with the allocator's overhead
        "compiled": 12 * tv + 2 * tv,  # ~3 fp32 [T, V] survive fusion + bf16 grad
        "liger": 2 * tv,  # a clone of its [1, T + 1, V] logits per call (its backward overwrites them)
    }


def fused_extra_bytes(T: int, H: int, V: int) -> dict[str, int]:
    chunk = default_chunk_size(T, H, V)  # rows of logits the fused path holds at a time (no memory bound)
    return {
        "gemms": 2 * T * V * 2,  # dz and z, bf16
        "fused": chunk * V * 6 + V * H * 4 + T * H * 2,  # chunk logits, fp32 weight-gradient accumulator, dh
        "materialised": T * V * 2 * 2 + V * H * 2 + T * H * 2,  # logits + their gradient, dW, dh
    }


def fits(need: int, free: int | None = None) -> tuple[bool, str]:
    """Whether ``need`` more bytes fit in ``free`` bytes (default: the current device's free memory
    as the driver sees it, plus what torch's caching allocator holds but does not use)."""
    if free is None:
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if need > FREE_FRACTION * free:
        return False, f"skipped: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return True, ""


def guarded(fn, need: int, *, warmup: int, reps: int, memory: bool = True):
    """``time_fn`` when the estimate fits, else ``(None, reason)``; out-of-memory is caught too."""
    ok, reason = fits(need)
    if not ok:
        return None, reason
    try:
        return time_fn(fn, warmup=warmup, reps=reps, memory=memory), ""
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return None, f"OOM: {str(e).splitlines()[0][:120]}"


# ------------------------------------------------------------------------------------------- cases
PROMPT_FRACTION = 0.15  # prompt tokens per sequence, masked out of the loss (10-20% in RL batches)
SEQ_LEN = 2048  # tokens per sequence of the benchmark batches
RATIO_NOISE = 0.05  # behaviour / proximal log-probs = current ones + N(0, 0.05): ratios ~ 1 +- 5%


def realistic_mask(T: int, device, *, seq_len: int = SEQ_LEN, prompt_fraction: float = PROMPT_FRACTION):
    """float [T]: sequences of ``seq_len`` tokens (the last one shorter), each starting with
    ``round(prompt_fraction * len)`` prompt tokens (0) followed by its response tokens (1)."""
    pos = torch.arange(T, device=device)
    start = pos - pos % seq_len
    length = torch.clamp(T - start, max=seq_len)
    return (pos - start >= torch.round(prompt_fraction * length)).float()


def realistic_batch(z, y, generator, *, logp=None):
    """(behav, prox, advantages, mask) for logits ``z`` and labels ``y``: the current log-probs
    ``logp`` (computed from ``z`` when None) plus small noise, so importance ratios are near 1 and
    few tokens are clipped, as in an asynchronous RL batch; prompt tokens masked."""
    T, device = y.shape[0], y.device
    if logp is None:
        with torch.no_grad():
            logp = token_logprobs(z[:T], y)
    b = logp + RATIO_NOISE * torch.randn(T, device=device, generator=generator)
    p = logp + RATIO_NOISE * torch.randn(T, device=device, generator=generator)
    A = torch.randn(T, device=device, generator=generator)
    return b, p, A, realistic_mask(T, device)


def inputs(T, V, device, dtype=torch.bfloat16, extra_rows=0):
    g = torch.Generator(device=device).manual_seed(0)
    z = torch.randn(T + extra_rows, V, device=device, dtype=dtype, generator=g) * 2
    y = torch.randint(0, V, (T,), device=device, generator=g)
    b, p, A, m = realistic_batch(z, y, g)
    return z, y, b, p, A, m


def logits_bytes_moved(T: int, V: int, active_rows: int, itemsize: int = 2) -> int:
    """Bytes the from-logits fwd+bwd kernels move: the forward reads every row, the backward
    reads the rows with a non-zero gradient and writes every row."""
    return (2 * T + active_rows) * V * itemsize


def roofline_3pass_ms(T: int, V: int, hbm_gbs: float, itemsize: int = 2) -> float:
    """The 3-pass roofline: the logits read by the forward and the backward and the gradient
    written, at ``hbm_gbs`` GB/s."""
    return LOGIT_PASSES_FWD_BWD * T * V * itemsize / hbm_gbs / 1e6


def active_rows(grad: torch.Tensor) -> int:
    """Rows of dloss/dlogits that are not all zero (the backward read their logits)."""
    return int((grad != 0).any(dim=1).sum())


def loss_step(fn, z, y, b, p, A, m, **kw):
    def step():
        leaf = z.detach().requires_grad_()
        out = fn(leaf, y, b, A, m, prox_logprobs=p, **OPTS, **kw)
        (g,) = torch.autograd.grad(out.loss, leaf)
        return g

    return step


def _liger_step(T, V):
    """Liger's Triton GRPO loss from logits [1, T + 1, V] (its layout), in place, or None."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None
    z, y, b, _, A, m = inputs(T, V, "cuda", extra_rows=1)

    def step():
        leaf = z.detach()[None].clone().requires_grad_()  # its backward overwrites the logits
        loss, _ = triton_grpo_loss(leaf, b[None], None, y[None], A[:1], m[None], temperature=1.0, beta=0.0,
                                   eps_low=0.2, eps_high=0.28, inplace=True, loss_type="bnpo", reduce=True)
        loss.backward()

    return step


def bench_logits_shape(T, V, peaks, compiled, liger: bool) -> dict:
    z, y, b, p, A, m = inputs(T, V, "cuda")
    need = logits_extra_bytes(T, V)
    tv_bytes = T * V * z.element_size()
    row = dict(table="from_logits", T=T, V=V, dtype="bf16", masked_frac=1.0 - float(m.mean()),
               bytes_model="fwd+bwd (2 T + active_rows) V 2 B moved; roofline 3 T V 2 B; copy 2 T V 2 B")
    dst = torch.empty_like(z)
    t_copy, why = guarded(lambda: dst.copy_(z), 0, warmup=3, reps=20, memory=False)
    dst = None
    if t_copy is None:
        return row | {"error": f"copy baseline: {why}"}
    t_ours, why = guarded(loss_step(decoupled_ppo_loss, z, y, b, p, A, m, backend="triton"), need["ours"],
                          warmup=2, reps=10)
    if t_ours is None:
        return row | {"error": why}
    act = active_rows(loss_step(decoupled_ppo_loss, z, y, b, p, A, m, backend="triton")())
    grad_buf = z.clone()

    def inplace():
        leaf = grad_buf.detach().requires_grad_()
        out = decoupled_ppo_loss(leaf, y, b, A, m, prox_logprobs=p, grad_inplace=True, backend="triton", **OPTS)
        torch.autograd.grad(out.loss, leaf)

    t_inpl, _ = guarded(inplace, 0, warmup=2, reps=10)
    grad_buf = None
    t_fwd, _ = guarded(lambda: decoupled_ppo_loss(z, y, b, A, m, prox_logprobs=p, backend="triton", **OPTS), 0,
                       warmup=2, reps=10)
    t_eager, why_eager = guarded(loss_step(decoupled_ppo_loss_ref, z, y, b, p, A, m), need["eager"], warmup=1,
                                 reps=3)
    t_comp, why_comp = (None, "skipped: --skip-compile")
    if compiled is not None:
        t_comp, why_comp = guarded(loss_step(compiled, z, y, b, p, A, m), need["compiled"], warmup=2, reps=3)
    t_liger, why_liger = (None, "skipped: --skip-liger")
    if liger:
        del z
        torch.cuda.empty_cache()
        step = _liger_step(T, V)
        t_liger, why_liger = (None, "skipped: liger-kernel not installed") if step is None else \
            guarded(step, need["liger"], warmup=2, reps=5)
    moved = logits_bytes_moved(T, V, act)
    gbs = moved / t_ours.median_ms / 1e6
    gbs_copy = LOGIT_PASSES_COPY * tv_bytes / t_copy.median_ms / 1e6
    roof_ms = roofline_3pass_ms(T, V, peaks["hbm_gbs"]) if peaks["hbm_gbs"] else None
    row |= dict(
        active_rows=act, active_frac=act / T, bytes_moved=moved, roofline_3pass_ms=roof_ms,
        ratio_to_3pass_roofline=(t_ours.median_ms / roof_ms) if roof_ms else None,
        ratio_to_3pass_copy_roofline=t_ours.median_ms / (1.5 * t_copy.median_ms),
        ms_copy=t_copy.median_ms, ms_fwd_bwd=t_ours.median_ms, ms_fwd_bwd_p10=t_ours.p10_ms,
        ms_fwd_bwd_p90=t_ours.p90_ms, ms_fwd_bwd_inplace=t_inpl.median_ms if t_inpl else None,
        ms_fwd=t_fwd.median_ms if t_fwd else None,
        gbs_fwd_bwd=gbs, gbs_fwd=(tv_bytes / t_fwd.median_ms / 1e6) if t_fwd else None, gbs_copy=gbs_copy,
        frac_copy_bw=gbs / gbs_copy, frac_hbm_peak=gbs / peaks["hbm_gbs"] if peaks["hbm_gbs"] else None,
        time_vs_copy=t_ours.median_ms / t_copy.median_ms,
        ms_ref_eager=t_eager.median_ms if t_eager else why_eager,
        ms_ref_compiled=t_comp.median_ms if t_comp else why_comp,
        ms_liger_grpo=t_liger.median_ms if t_liger else why_liger,
        speedup_vs_eager=(t_eager.median_ms / t_ours.median_ms) if t_eager else None,
        speedup_vs_compiled=(t_comp.median_ms / t_ours.median_ms) if t_comp else None,
        speedup_vs_liger=(t_liger.median_ms / t_ours.median_ms) if t_liger else None,
        peak_mem_gib=t_ours.peak_mem_bytes / 2**30,
        peak_mem_inplace_gib=t_inpl.peak_mem_bytes / 2**30 if t_inpl else None,
        peak_mem_ref_eager_gib=t_eager.peak_mem_bytes / 2**30 if t_eager else None,
    )
    return row


def bench_fused_shape(T, H, V, peaks) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    b, p, A, m = realistic_batch(None, y, g, logp=fused_linear_token_logprobs(h, W, y, backend="triton"))
    need = fused_extra_bytes(T, H, V)
    chunk = default_chunk_size(T, H, V, itemsize=h.element_size(),
                               free_bytes=torch.cuda.mem_get_info()[0])
    # which GEMM accumulates grad_weight (the fp32-upcast fallback is ~0.6 s a step at 32k x 3584)
    row = dict(table="fused_linear", T=T, H=H, V=V, dtype="bf16", flops_model="3 GEMMs: 6*T*H*V",
               masked_frac=1.0 - float(m.mean()), chunk_rows=chunk,
               weight_grad_path=weight_grad_path(h.device, h.dtype))

    ok, why_gemm = fits(need["gemms"])
    t_gemm = None
    if ok:
        dz = torch.randn(T, V, device="cuda", dtype=h.dtype, generator=g)

        def gemms():
            z = h @ W.T
            _ = dz @ W
            _ = dz.T @ h
            return z

        t_gemm, why_gemm = guarded(gemms, 0, warmup=2, reps=5, memory=False)
        del dz
    torch.cuda.empty_cache()

    def fused():
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        out = fused_linear_decoupled_ppo_loss(hh, WW, y, b, A, m, prox_logprobs=p, backend="triton", **OPTS)
        torch.autograd.grad(out.loss, (hh, WW))

    def materialised():
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        out = decoupled_ppo_loss(hh @ WW.T, y, b, A, m, prox_logprobs=p, backend="triton", **OPTS)
        torch.autograd.grad(out.loss, (hh, WW))

    t_fused, why = guarded(fused, need["fused"], warmup=1, reps=5)
    if t_fused is None:
        return row | {"error": why}
    t_mat, why_mat = guarded(materialised, need["materialised"], warmup=1, reps=3)
    flops = 6 * T * H * V
    tflops = flops / t_fused.median_ms / 1e9
    return row | dict(
        ms_gemms=t_gemm.median_ms if t_gemm else why_gemm, ms_fused=t_fused.median_ms, ms_fused_p10=t_fused.p10_ms,
        ms_fused_p90=t_fused.p90_ms, ms_materialised=t_mat.median_ms if t_mat else why_mat,
        time_vs_gemms=(t_fused.median_ms / t_gemm.median_ms) if t_gemm else None,
        tflops_fused=tflops, tflops_gemms=(flops / t_gemm.median_ms / 1e9) if t_gemm else None,
        frac_bf16_peak=tflops / peaks["bf16_tflops"] if peaks["bf16_tflops"] else None,
        peak_mem_fused_gib=t_fused.peak_mem_bytes / 2**30,
        peak_mem_materialised_gib=t_mat.peak_mem_bytes / 2**30 if t_mat else None,
    )


def run_rows(fn, shapes, keep, *extra):
    """One row per shape, handed to ``keep`` at once (a run cut short keeps what it measured)."""
    for shape in shapes:
        try:
            row = fn(*shape, *extra)
        except torch.cuda.OutOfMemoryError as e:
            row = dict(shape=list(shape), error=f"OOM: {str(e).splitlines()[0][:160]}")
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        keep(row)
        torch.cuda.empty_cache()


def cpu_rows() -> list[dict]:
    print("No CUDA device: tiny shapes of the PyTorch reference only (no Triton kernels, no meaningful rates). "
          "Run on a GPU for the real benchmark.")
    rows = []
    g = torch.Generator().manual_seed(0)
    for T, V in ((256, 4096), (1024, 8192)):
        z, y = torch.randn(T, V, generator=g), torch.randint(0, V, (T,), generator=g)
        b, p, A, m = realistic_batch(z, y, g)
        step = loss_step(decoupled_ppo_loss_ref, z, y, b, p, A, m)
        act = active_rows(step())
        t = time_fn(step, warmup=1, reps=3)
        rows.append(dict(table="reference_cpu", T=T, V=V, dtype="fp32", masked_frac=1.0 - float(m.mean()),
                         active_rows=act, bytes_moved=logits_bytes_moved(T, V, act, 4), **t.as_row("ref_")))
    rows.append(fused_cpu_row())
    return rows


def fused_cpu_row(T: int = 256, H: int = 64, V: int = 1024) -> dict:
    """The fused-linear loss in bf16 on CPU (reference backend): which grad_weight GEMM path this
    torch takes here (CPU torch 2.13 has no fp32-output bf16 GEMM: the upcast fallback, which warns)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).bfloat16()
    W = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    y = torch.randint(0, V, (T,), generator=g)
    b, p, A, m = realistic_batch(None, y, g, logp=fused_linear_token_logprobs(h, W, y, backend="reference"))
    chunk = default_chunk_size(T, H, V, itemsize=2)

    def step():
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        out = fused_linear_decoupled_ppo_loss(hh, WW, y, b, A, m, prox_logprobs=p, backend="reference",
                                              chunk_size=max(1, T // 4), **OPTS)
        torch.autograd.grad(out.loss, (hh, WW))

    t = time_fn(step, warmup=1, reps=3)
    return dict(table="fused_linear_cpu", T=T, H=H, V=V, dtype="bf16", masked_frac=1.0 - float(m.mean()),
                chunk_rows=min(chunk, T), weight_grad_path=weight_grad_path(h.device, h.dtype), **t.as_row("ref_"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one small shape per table")
    size.add_argument("--production", action="store_true", help="16k/32k x 152k only (H = 3584 fused, 32k)")
    ap.add_argument("--skip-compile", action="store_true", help="no torch.compile baseline")
    ap.add_argument("--skip-liger", action="store_true", help="no Liger GRPO baseline")
    ap.add_argument("--skip-fused", action="store_true")
    ap.add_argument("--skip-logits", action="store_true")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    shapes = QUICK if args.quick else PRODUCTION if args.production else DEFAULT
    logit_shapes = [] if args.skip_logits else shapes["logits"]
    fused_shapes = [] if args.skip_fused else shapes["fused"]
    if args.dry_run:
        cases = [dict(table="from_logits", T=T, V=V, masked_frac=1.0 - float(realistic_mask(T, "cpu").mean()),
                      roofline_3pass_ms_h100=roofline_3pass_ms(T, V, 3350.0),
                      **{f"gib_{k}": v / 2**30 for k, v in logits_extra_bytes(T, V).items()})
                 for T, V in logit_shapes]
        cases += [dict(table="fused_linear", T=T, H=H, V=V, **{f"gib_{k}": v / 2**30 for k, v in
                                                               fused_extra_bytes(T, H, V).items()})
                  for T, H, V in fused_shapes]
        print_dry_run("ppo_loss", cases)
        return
    prov = provenance()
    if not torch.cuda.is_available():
        rows = cpu_rows()
        print_table(rows)
        save("ppo_loss", rows, args, prov)
        return
    peaks = device_peaks(prov["device"])

    def keep(row):
        save("ppo_loss", [row], args, prov)

    if fused_shapes and args.production:  # first: the from-logits table spends minutes compiling the baseline
        run_rows(bench_fused_shape, fused_shapes, keep, peaks)
    if logit_shapes:
        compiled = None if args.skip_compile else torch.compile(decoupled_ppo_loss_ref, dynamic=True)
        run_rows(bench_logits_shape, logit_shapes, keep, peaks, compiled, not args.skip_liger)
    if fused_shapes and not args.production:
        run_rows(bench_fused_shape, fused_shapes, keep, peaks)


if __name__ == "__main__":
    main()
