"""Benchmark of the fused decoupled-PPO loss (areal_fast.ops) against the PyTorch reference.

    python bench/bench_ppo_loss.py [--quick] [--out [DIR]] [--skip-compile] [--skip-fused] [--skip-logits]

On a GPU, two tables:
  * from logits, bf16, forward + backward: time, effective GB/s (logits read once + gradient
    written once, over the time), the same against a same-size copy (read + write) timed in the
    same run, the speed-up over the eager reference and over torch.compile of the reference, and
    the peak memory above the inputs;
  * fused linear (hidden @ W^T + loss), bf16, forward + backward: time against the bare lm_head
    GEMMs (one forward, two backward) timed in the same run, and the peak memory against the
    materialised path (F.linear + the Triton loss on the full logits).
``--out`` writes bench/results/ppo_loss_<device>_<date>.json (or into DIR) with device, versions,
commit and date.
On CPU it runs tiny shapes of the reference only, and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import subprocess
import sys

import torch

from areal_fast.ops import decoupled_ppo_loss, decoupled_ppo_loss_ref, fused_linear_decoupled_ppo_loss

# H100 SXM HBM3 peak from the datasheet; the copy measured in the same run is the practical roof.
HBM_PEAK_GBS = {"H100": 3350.0, "H200": 4800.0}
OPTS = dict(eps_clip=0.2, eps_clip_higher=0.28, behav_weight_cap=5.0, importance_level="token",
            loss_agg="token-mean")


def timed(fn, warmup=2, iters=7):
    """Median milliseconds of fn() over CUDA events, and the peak memory above the start (bytes)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def try_timed(fn, **kw):
    try:
        return timed(fn, **kw)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def inputs(T, V, device, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    z = torch.randn(T, V, device=device, dtype=dtype, generator=g) * 2
    y = torch.randint(0, V, (T,), device=device, generator=g)
    with torch.no_grad():
        b = torch.log_softmax(z[:, :1].float(), -1)[:, 0] - 10.0 + 0.1 * torch.randn(T, device=device, generator=g)
    p = b + 0.1 * torch.randn(T, device=device, generator=g)
    A = torch.randn(T, device=device, generator=g)
    m = torch.ones(T, device=device)  # every token in the loss: no row is skipped, honest GB/s
    return z, y, b, p, A, m


def loss_step(fn, z, y, b, p, A, m, **kw):
    def step():
        leaf = z.detach().requires_grad_()
        out = fn(leaf, y, b, A, m, prox_logprobs=p, **OPTS, **kw)
        (g,) = torch.autograd.grad(out.loss, leaf)
        return g

    return step


def _time_copy(z):
    out_buf = torch.empty_like(z)
    return timed(lambda: out_buf.copy_(z))[0]


def _time_inplace(z, y, b, p, A, m):
    # the logits buffer receives the gradient (values change between iterations; the kernels'
    # cost does not depend on them)
    buf = z.clone()

    def step():
        leaf = buf.detach().requires_grad_()
        out = decoupled_ppo_loss(leaf, y, b, A, m, prox_logprobs=p, grad_inplace=True, backend="triton", **OPTS)
        torch.autograd.grad(out.loss, leaf)

    return timed(step)


def bench_logits_shape(T, V, device_peak, compiled):
    z, y, b, p, A, m = inputs(T, V, "cuda")
    nbytes = 2 * z.numel() * z.element_size()
    t_copy = _time_copy(z)
    t_ours, mem_ours = timed(loss_step(decoupled_ppo_loss, z, y, b, p, A, m, backend="triton"))
    t_inpl, mem_inpl = _time_inplace(z, y, b, p, A, m)
    t_fwd, _ = timed(lambda: decoupled_ppo_loss(z, y, b, A, m, prox_logprobs=p, backend="triton", **OPTS))
    t_eager, mem_eager = try_timed(loss_step(decoupled_ppo_loss_ref, z, y, b, p, A, m), warmup=1, iters=3)
    t_comp = mem_comp = None
    if compiled is not None:
        t_comp, mem_comp = try_timed(loss_step(compiled, z, y, b, p, A, m), warmup=2, iters=3)
    return dict(
        table="from_logits", T=T, V=V, dtype="bf16", ms_copy=t_copy, ms_fwd_bwd=t_ours, ms_fwd_bwd_inplace=t_inpl,
        ms_fwd=t_fwd, ms_ref_eager=t_eager, ms_ref_compiled=t_comp,
        gbs_effective=nbytes / t_ours / 1e6, gbs_copy=nbytes / t_copy / 1e6,
        frac_hbm_peak=(nbytes / t_ours / 1e6) / device_peak if device_peak else None,
        time_vs_copy=t_ours / t_copy, time_inplace_vs_copy=t_inpl / t_copy,
        speedup_vs_eager=(t_eager / t_ours) if t_eager else None,
        speedup_vs_compiled=(t_comp / t_ours) if t_comp else None,
        peak_mem_gib=mem_ours / 2**30, peak_mem_inplace_gib=mem_inpl / 2**30,
        peak_mem_ref_eager_gib=None if mem_eager is None else mem_eager / 2**30,
        peak_mem_ref_compiled_gib=None if mem_comp is None else mem_comp / 2**30,
    )


def _time_gemms(h, W):
    dz = torch.randn(h.shape[0], W.shape[0], device="cuda", dtype=h.dtype)

    def gemms():
        z = h @ W.T
        _ = dz @ W
        _ = dz.T @ h
        return z

    return timed(gemms)[0]


def bench_fused_shape(T, H, V):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5
    _, _, b, p, A, m = inputs(T, 2, "cuda")
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    t_gemm = _time_gemms(h, W)
    torch.cuda.empty_cache()

    def fused():
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        out = fused_linear_decoupled_ppo_loss(hh, WW, y, b, A, m, prox_logprobs=p, backend="triton", **OPTS)
        torch.autograd.grad(out.loss, (hh, WW))

    def materialised():
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        out = decoupled_ppo_loss(hh @ WW.T, y, b, A, m, prox_logprobs=p, backend="triton", **OPTS)
        torch.autograd.grad(out.loss, (hh, WW))

    t_fused, mem_fused = timed(fused, warmup=1, iters=5)
    t_mat, mem_mat = try_timed(materialised, warmup=1, iters=3)
    return dict(table="fused_linear", T=T, H=H, V=V, dtype="bf16", ms_gemms=t_gemm, ms_fused=t_fused,
                ms_materialised=t_mat, time_vs_gemms=t_fused / t_gemm,
                peak_mem_fused_gib=mem_fused / 2**30,
                peak_mem_materialised_gib=None if mem_mat is None else mem_mat / 2**30,
                mem_fused_vs_materialised=(mem_fused / mem_mat) if mem_mat else None)


def run_rows(fn, shapes, rows, *extra):
    for shape in shapes:
        try:
            row = fn(*shape, *extra)
        except torch.cuda.OutOfMemoryError as e:
            row = dict(shape=shape, error=f"OOM: {e}"[:200])
        rows.append(row)
        print(fmt(row), flush=True)
        torch.cuda.empty_cache()


def fmt(row):
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def provenance():
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=pathlib.Path(__file__).parent, timeout=10).stdout.strip() or None
    except Exception:
        commit = None
    import triton

    return dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, commit=commit,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=sys.version.split()[0])


def cpu_note():
    print("No CUDA device: running tiny shapes of the PyTorch reference only (no Triton kernels, "
          "no meaningful rates). Run on a GPU for the real benchmark.")
    import time

    for T, V in ((256, 4096), (1024, 8192)):
        z, y = torch.randn(T, V), torch.randint(0, V, (T,))
        b, A, m = torch.full((T,), -8.0), torch.randn(T), torch.ones(T)
        leaf = z.requires_grad_()
        t0 = time.perf_counter()
        out = decoupled_ppo_loss_ref(leaf, y, b, A, m, **OPTS)
        out.loss.backward()
        print(f"reference cpu T={T} V={V}: {(time.perf_counter() - t0) * 1e3:.1f} ms fwd+bwd")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small shape per table")
    ap.add_argument("--out", nargs="?", const=str(pathlib.Path(__file__).parent / "results"), default=None,
                    metavar="DIR", help="write DIR/ppo_loss_<device>_<date>.json (default DIR: bench/results)")
    ap.add_argument("--skip-compile", action="store_true", help="no torch.compile baseline")
    ap.add_argument("--skip-fused", action="store_true")
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        cpu_note()
        return
    prov = provenance()
    print(json.dumps(prov))
    peak = next((v for k, v in HBM_PEAK_GBS.items() if k in prov["device"]), None)
    rows: list[dict] = []
    if args.quick:
        logit_shapes, fused_shapes = [(4096, 32000)], [(4096, 1536, 151936)]
    else:
        logit_shapes = [(T, V) for V in (32000, 151936) for T in (4096, 16384, 32768)]
        fused_shapes = [(T, H, 151936) for H in (1536, 3584) for T in (4096, 16384, 32768)]
    if not args.skip_logits:
        compiled = None if args.skip_compile else torch.compile(decoupled_ppo_loss_ref, dynamic=True)
        run_rows(bench_logits_shape, logit_shapes, rows, peak, compiled)
    if not args.skip_fused:
        run_rows(bench_fused_shape, fused_shapes, rows)
    if args.out:
        out_dir = pathlib.Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        name = "ppo_loss_{}_{}.json".format(prov["device"].replace(" ", "_"), prov["date"][:10])
        (out_dir / name).write_text(json.dumps(dict(provenance=prov, options=OPTS, hbm_peak_gbs=peak,
                                                    rows=rows), indent=1))
        print(f"wrote {out_dir / name}")



# pytest-benchmark form: `python -m pytest bench/bench_ppo_loss.py --benchmark-only`. On a GPU it
# times the Triton path against the eager reference and a same-size copy on the shapes;
# on CPU only tiny shapes of the reference run (and the report says so in extra_info).
_ON_GPU = torch.cuda.is_available()
_BENCH_SHAPES = [(4096, 32000), (16384, 151936), (32768, 151936)] if _ON_GPU else [(256, 4096)]


def _bench_inputs(T, V):
    if _ON_GPU:
        return inputs(T, V, "cuda")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(T, V, generator=g)
    return z, torch.randint(0, V, (T,), generator=g), torch.full((T,), -8.0), None, torch.randn(T, generator=g), \
        torch.ones(T)


def _sync():
    if _ON_GPU:
        torch.cuda.synchronize()


import pytest  # noqa: E402  (only the pytest form needs it)


@pytest.mark.parametrize("T,V", _BENCH_SHAPES)
def test_bench_ppo_loss_fast_path(benchmark, T, V):
    z, y, b, p, A, m = _bench_inputs(T, V)
    step = loss_step(decoupled_ppo_loss, z, y, b, p, A, m, **({"backend": "triton"} if _ON_GPU else {}))
    benchmark(lambda: (step(), _sync()))
    nbytes = 2 * z.numel() * z.element_size()
    benchmark.extra_info.update(device=torch.cuda.get_device_name() if _ON_GPU else "cpu (reference only)",
                                gbs_effective=nbytes / benchmark.stats["median"] / 1e9)


@pytest.mark.parametrize("T,V", _BENCH_SHAPES)
def test_bench_ppo_loss_eager_reference(benchmark, T, V):
    z, y, b, p, A, m = _bench_inputs(T, V)
    step = loss_step(decoupled_ppo_loss_ref, z, y, b, p, A, m)
    benchmark.pedantic(lambda: (step(), _sync()), rounds=3, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("T,V", _BENCH_SHAPES)
def test_bench_same_size_copy(benchmark, T, V):
    z = _bench_inputs(T, V)[0]
    buf = torch.empty_like(z)
    benchmark(lambda: (buf.copy_(z), _sync()))
    benchmark.extra_info.update(gbs=2 * z.numel() * z.element_size() / benchmark.stats["median"] / 1e9)

if __name__ == "__main__":
    main()
