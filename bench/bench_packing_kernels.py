"""Packing kernels benchmark: pack / unpack / gather_segments / scatter_segments in GB/s against a
same-size ``dst.copy_(src)`` timed in the same run and against the PyTorch references, on lognormal
segment lengths (the workload and bytes model: docs/benchmarks.md). ``kernel`` times the launcher
alone, ``api`` the public function.

    python bench/bench_packing_kernels.py                     # GPU: kernels; CPU: references only
    python bench/bench_packing_kernels.py --interpret         # CPU smoke run of the kernel paths
    python bench/bench_packing_kernels.py --dry-run           # list the cases, run nothing

Rows go to bench/results/packing_kernels.jsonl, each as soon as it is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.packing import (  # noqa: E402
    gather_segments,
    gather_segments_ref,
    pack,
    pack_ref,
    scatter_segments,
    scatter_segments_ref,
    unpack,
    unpack_ref,
)
from bench.common import add_harness_args, print_dry_run, print_table, provenance, save, time_fn  # noqa: E402


def lognormal_lengths(n: int, max_len: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(7.0, 1.2, n).astype(np.int64), 1, max_len).tolist()


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()`` (the harness: CUDA events on GPU, wall clock on CPU)."""
    return time_fn(fn, warmup=3 if device.type == "cuda" else 1, reps=reps, cuda=device.type == "cuda").median_ms


def per_token_tensors(T: int, device) -> list[torch.Tensor]:
    """ids int64, logprobs fp32, advantages fp32, versions int32, loss mask bool: 21 bytes per token."""
    return [
        torch.randint(0, 150_000, (T,), device=device),
        torch.randn(T, device=device),
        torch.randn(T, device=device),
        torch.randint(0, 10, (T,), device=device, dtype=torch.int32),
        torch.rand(T, device=device) > 0.1,
    ]


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def cases(B: int, L: int, H: int, device, kernels: bool):
    """Yield (name, bytes moved, {label: callable}) for every op and shape."""
    lengths = lognormal_lengths(B, L)
    T, M = sum(lengths), max(lengths)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.to(device)
    lengths_dev = torch.tensor(lengths, device=device)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(0)).to(device)
    backend = "interpret" if device.type == "cpu" else None

    for label, padded in (("ids int64", torch.randint(0, 150_000, (B, L), device=device)),
                          (f"hidden bf16 H={H}", torch.randn(B, L, H, device=device, dtype=torch.bfloat16))):
        row = nbytes(padded[0, 0:1])
        fns = {"ref": lambda p=padded: pack_ref(p, lengths_dev)}
        if kernels:
            fns["api"] = lambda p=padded: pack(p, lengths, backend=backend)
            fns["kernel"] = _pack_launcher(padded, cu, T)
        yield f"pack {label}", 2 * T * row + 8 * T, fns
        del padded

    for label, packed in (("logprobs fp32", torch.randn(T, device=device)),
                          (f"hidden bf16 H={H}", torch.randn(T, H, device=device, dtype=torch.bfloat16))):
        row = nbytes(packed[0:1])
        fns = {"ref": lambda p=packed: unpack_ref(p, cu, M)}
        if kernels:
            fns["api"] = lambda p=packed: unpack(p, cu, M, backend=backend, validate=False)
            fns["kernel"] = _unpack_launcher(packed, cu, M)
        yield f"unpack {label}", T * row + B * M * row, fns
        del packed

    small = per_token_tensors(T, device)
    hidden = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    for label, ts in (("5 per-token", small), (f"5 per-token + hidden H={H}", [*small, hidden])):
        for op, api, ref, scatter in (("gather", gather_segments, gather_segments_ref, False),
                                      ("scatter", scatter_segments, scatter_segments_ref, True)):
            fns = {"ref": lambda ts=ts, ref=ref: ref(ts, cu, order)}
            if kernels:
                fns["api"] = lambda ts=ts, api=api: api(ts, cu, order, backend=backend, validate=False)
                fns["kernel"] = _segment_launcher(ts, cu, order, scatter)
            yield f"{op} {label}", 2 * nbytes(*ts), fns


def _pack_launcher(padded, cu, T):
    from areal_fast.kernels import packing as K

    B, L = padded.shape[:2]
    src = padded.reshape(B * L, *padded.shape[2:])
    out = torch.empty((T, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    pos = torch.empty(T, dtype=torch.int64, device=padded.device)
    starts = torch.arange(B, device=padded.device) * L
    return lambda: K.segment_copy([src], [out], cu, starts, scatter=False, pos=pos)


def _unpack_launcher(packed, cu, M):
    from areal_fast.kernels import packing as K

    out = torch.empty((cu.numel() - 1, M, *packed.shape[1:]), dtype=packed.dtype, device=packed.device)
    return lambda: K.unpack_rows(packed, out, cu, M)


def _segment_launcher(ts, cu, order, scatter):
    from areal_fast.kernels import packing as K

    cu64 = cu.long()
    new_cu = torch.zeros_like(cu)
    new_cu[1:] = torch.cumsum(cu64.diff()[order], 0)
    starts = cu64[:-1][order].contiguous()
    outs = [torch.empty_like(t) for t in ts]
    return lambda: K.segment_copy(ts, outs, new_cu, starts, scatter=scatter)


def measure(B: int, L: int, H: int, device: torch.device, kernels: bool, reps: int):
    """Yield one row per case as soon as it is measured (so a run cut short keeps what it measured)."""
    for name, moved, fns in cases(B, L, H, device, kernels):
        # Same bytes through the copy engine of torch: read moved/2, write moved/2.
        src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = time_ms(lambda s=src, d=dst: d.copy_(s), device, reps)
        del src, dst
        row = {"op": name, "MB": moved / 1e6, "copy_GB/s": moved / copy_ms / 1e6}
        for label in ("kernel", "api", "ref"):
            if label in fns:
                ms = time_ms(fns[label], device, reps)
                row[f"{label}_ms"] = ms
                row[f"{label}_GB/s"] = moved / ms / 1e6
        if "kernel_ms" in row:
            row["vs_copy"] = row["kernel_GB/s"] / row["copy_GB/s"]
            row["vs_ref"] = row["ref_ms"] / row["kernel_ms"]
        yield row
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=None, help="sequences (GPU default 64, CPU 16)")
    ap.add_argument("--max-len", type=int, default=None, help="padded length L (GPU default 8192, CPU 512)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden width H (GPU default 4096, CPU 64)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--interpret", action="store_true",
                    help="on CPU also run the kernel paths in the Triton interpreter (a smoke test; "
                         "its timings say nothing about GPU speed)")
    add_harness_args(ap)
    args = ap.parse_args(argv)

    gpu = torch.cuda.is_available()
    B = args.batch or (64 if gpu else 16)
    L = args.max_len or (8192 if gpu else 512)
    H = args.hidden or (4096 if gpu else 64)
    reps = args.reps or (50 if gpu else 3)
    if args.dry_run:
        lengths = lognormal_lengths(B, L)
        print_dry_run("packing_kernels", [dict(B=B, L=L, H=H, tokens=sum(lengths), max_len=max(lengths),
                                               padded_hidden_gib=B * L * H * 2 / 2**30, reps=reps)])
        return
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        # One intra-op thread: on a loaded 2-core machine torch's thread pool made an 85 KB copy take
        # 28 ms instead of 1.6 us; the CPU numbers are only a sanity check of the references anyway.
        torch.set_num_threads(1)
    if not gpu and args.interpret:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is first imported
    prov = provenance()
    print(f"device: {prov['device']}  torch {prov.get('torch')}  triton {prov.get('triton', 'missing')}  "
          f"commit {prov['commit']}  {prov['date']}")
    print(f"B={B} sequences, lognormal lengths clipped to [1, {L}], H={H}")
    if not gpu:
        print("No CUDA device: timing the PyTorch references only; a GPU is needed for kernel timing."
              + ("  (--interpret: kernel rows run in the Triton interpreter, times meaningless)"
                 if args.interpret else ""))
    rows = []
    for r in measure(B, L, H, device, kernels=gpu or args.interpret, reps=reps):
        r.update(B=B, L=L, H=H, interpret=bool(not gpu and args.interpret))
        rows.append(r)
        save("packing_kernels", [r], args, prov)  # row by row: a run killed at its time limit keeps them
    print_table(rows)


if __name__ == "__main__":
    main()
