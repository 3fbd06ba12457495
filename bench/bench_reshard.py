"""Benchmark the reshard planner, the interval copy and a full weight sync (the parts: docs/benchmarks.md):
``plan`` (7B plan build, C++ vs Python), ``cpu_copy`` (C++ interval copy vs torch ``copy_``), ``cuda_copy``
(the CUDA kernel on the Qwen2.5-7B layout vs a same-size copy, and the SGLang TP shard build), ``sync``
(DistributedWeightSync over gloo vs a raw broadcast) and ``gpu_sync`` (NCCL on one GPU, or why not).

    python bench/bench_reshard.py [--parts plan,cpu_copy,cuda_copy,sync,gpu_sync] [--layers 28]
                                  [--sync-params 100e6] [--results DIR] [--no-results] [--dry-run]

Rows go to bench/results/reshard.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.weights.interval_copy import interval_copy  # noqa: E402
from areal_fast.weights.layout import ModelSpec  # noqa: E402
from areal_fast.weights.plan import plan_fsdp_buckets, plan_tp_shard, rows_cols  # noqa: E402
from bench.common import (  # noqa: E402
    add_harness_args,
    csv_list,
    print_dry_run,
    provenance,
    save,
    serve_until_stopped,
    server_process,
    time_fn,
)

QWEN25_7B = ModelSpec("qwen2", num_layers=28, hidden_size=3584, intermediate_size=18944, num_heads=28, num_kv_heads=4,
                      head_dim=128, vocab_size=152064, qkv_bias=True)


def _median_ms(fn, reps: int) -> float:
    return time_fn(fn, warmup=1, reps=reps, cuda=False).median_ms


def bench_plan(reps: int = 20) -> dict:
    spec = QWEN25_7B
    shapes = list(spec.hf_shapes().values())
    names = list(spec.hf_shapes())
    rc = np.array([rows_cols(s) for s in shapes])
    n = len(shapes)
    out = {"model": "qwen2.5-7b shapes", "tensors": n}
    for impl in ("native", "reference"):
        r = reps if impl == "native" else 3
        out[f"fsdp8_buckets_ms_{impl}"] = _median_ms(
            lambda impl=impl: plan_fsdp_buckets(rc[:, 0], rc[:, 1], [1] * n, [2] * n, 8, 512 << 20, backend=impl), r)
        out[f"tp4_shard_ms_{impl}"] = _median_ms(
            lambda impl=impl: plan_tp_shard(spec, 4, 1, names, shapes, [1] * n, torch.bfloat16, n_ranks=8,
                                            backend=impl), r)
    return out


def _model_tensors(spec: ModelSpec) -> list[torch.Tensor]:
    shapes = list(spec.hf_shapes().values())
    return [torch.randn(s) for s in shapes]


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def bench_cpu_copy(reps: int = 5) -> dict:
    spec = ModelSpec("qwen2", num_layers=4, hidden_size=1536, intermediate_size=8960, num_heads=12, num_kv_heads=2,
                     head_dim=128, vocab_size=32768, qkv_bias=True)  # Qwen2.5-1.5B layers, ~0.3B params
    ts = _model_tensors(spec)
    n = len(ts)
    rc = np.array([rows_cols(t.shape) for t in ts])
    plan = plan_fsdp_buckets(rc[:, 0], rc[:, 1], [1] * n, [2] * n, 1, 1 << 40)
    iv = plan.pack_intervals(0, 0)
    buf = torch.empty(int(plan.seg_bytes[0]), dtype=torch.uint8)
    views = [buf[o : o + 2 * t.numel()].view(torch.bfloat16).view(t.shape) for o, t in zip(plan.offset.tolist(), ts)]
    moved = sum(t.numel() * 6 for t in ts)  # read fp32 + write bf16
    interval_copy(ts, [buf], iv)
    ours = _median_ms(lambda: interval_copy(ts, [buf], iv, check=False), reps)
    torch_ms = _median_ms(lambda: [v.copy_(t) for v, t in zip(views, ts)], reps)
    ok = all(torch.equal(v.view(torch.int16), t.to(torch.bfloat16).view(torch.int16)) for v, t in zip(views, ts))
    # same dtype: bytes of the packed buffer -> another buffer, split in the plan's tensors
    buf2 = torch.empty_like(buf)
    iv_b = np.array([[0, o, 0, 0, o, 0, 2 * t.numel(), 1, 0, 0] for o, t in zip(plan.offset.tolist(), ts)], np.int64)
    byte_ms = _median_ms(lambda: interval_copy([buf], [buf2], iv_b, check=False), reps)
    torch_byte_ms = _median_ms(lambda: buf2.copy_(buf), reps)
    return {"params": int(sum(t.numel() for t in ts)), "cast_bitwise_equal": ok, "threads": torch.get_num_threads(),
            "f32_to_bf16_GBps": _gbps(moved, ours), "torch_copy_per_tensor_GBps": _gbps(moved, torch_ms),
            "bytes_GBps": _gbps(2 * buf.numel(), byte_ms),
            "torch_flat_copy_GBps": _gbps(2 * buf.numel(), torch_byte_ms)}


def _qwen25_7b(layers: int) -> ModelSpec:
    return ModelSpec("qwen2", num_layers=layers, hidden_size=3584, intermediate_size=18944, num_heads=28,
                     num_kv_heads=4, head_dim=128, vocab_size=152064, qkv_bias=True)


def cuda_copy_bytes(layers: int) -> dict:
    """Parameters and peak device bytes of the cuda_copy part (for --dry-run and the memory check)."""
    n = sum(int(np.prod(s)) for s in _qwen25_7b(layers).hf_shapes().values())
    return {"params": n, "peak_gib": max(6 * n, 4 * n + 2 * n + 2 * n) / 2**30}


def bench_cuda_copy(layers: int = 28, reps: int = 10) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    spec = _qwen25_7b(layers)
    sizes = cuda_copy_bytes(layers)
    free = torch.cuda.mem_get_info()[0]
    if sizes["peak_gib"] * 2**30 > 0.9 * free:
        return {"skipped": f"needs ~{sizes['peak_gib']:.1f} GiB, {free / 2**30:.1f} GiB free; use fewer --layers"}
    n_params = sizes["params"]
    moved = n_params * 6  # read fp32 + write bf16
    # the roof first, alone on the device: the same bytes through torch's copy (read 3N + write 3N)
    a = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    same = time_fn(lambda: b.copy_(a), warmup=2, reps=reps)
    a = b = None
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = spec.hf_shapes()
    ts = [torch.randn(s, device="cuda", generator=g) for s in shapes.values()]
    n = len(ts)
    rc = np.array([rows_cols(t.shape) for t in ts])
    plan = plan_fsdp_buckets(rc[:, 0], rc[:, 1], [1] * n, [2] * n, 1, 1 << 40)
    iv = plan.pack_intervals(0, 0)
    buf = torch.empty(int(plan.seg_bytes[0]), dtype=torch.uint8, device="cuda")
    ours = time_fn(lambda: interval_copy(ts, [buf], iv, check=False), warmup=2, reps=reps)
    views = [buf[o : o + 2 * t.numel()].view(torch.bfloat16).view(t.shape) for o, t in zip(plan.offset.tolist(), ts)]
    ok = all(torch.equal(v, t.to(torch.bfloat16)) for v, t in zip(views, ts))
    per_tensor = time_fn(lambda: [v.copy_(t) for v, t in zip(views, ts)], warmup=1, reps=max(3, reps // 3))
    buf = views = None
    torch.cuda.empty_cache()
    # the colocated path's shard build: SGLang TP layout (qkv / gate_up stacked), tp = 1
    from areal_fast.weights.colocated import build_tp_shard

    full = dict(zip(shapes, ts))
    _, _, tp_plan = build_tp_shard(full, spec, 1, 0)
    tp = time_fn(lambda: build_tp_shard(full, spec, 1, 0, plan=tp_plan), warmup=1, reps=max(3, reps // 3))
    return {"model": f"qwen2.5-7b layout, {layers} layers", "params": n_params, "tensors": n,
            "bitwise_equal_torch": ok, "kernel_ms": ours.median_ms, "kernel_p10_ms": ours.p10_ms,
            "kernel_p90_ms": ours.p90_ms, "kernel_GBps": _gbps(moved, ours.median_ms),
            "same_size_copy_GBps": _gbps(moved, same.median_ms), "frac_copy": same.median_ms / ours.median_ms,
            "torch_per_tensor_GBps": _gbps(moved, per_tensor.median_ms),
            "sglang_tp1_shard_ms": tp.median_ms, "sglang_tp1_shard_GBps": _gbps(moved, tp.median_ms),
            "bytes_model": "read fp32 + write bf16 = 6 B per parameter"}


# ------------------------------------------------------------------------- NCCL on one GPU
def _nccl_rank(rank: int, port: int, nbytes: int, reps: int, q) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
                                device_id=torch.device("cuda", 0))
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        t = time_fn(lambda: dist.broadcast(buf, src=0), warmup=1, reps=reps)
        dist.destroy_process_group()
        q.put((rank, "ok", t.median_ms))
    except Exception as e:  # noqa: BLE001 - reported as the row's reason
        q.put((rank, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))


def bench_gpu_sync(nbytes: int = 1 << 30, reps: int = 5, timeout_s: float = 120.0) -> dict:
    """A raw NCCL broadcast between two processes sharing GPU 0, or why NCCL would not."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from areal_fast.netutil import find_free_port

    port = find_free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, nbytes, reps, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(2):
            rank, status, val = q.get(timeout=timeout_s)
            results[rank] = (status, val)
    except Exception:  # noqa: BLE001 - queue.Empty: a rank hung
        results.setdefault(0, ("error", f"no answer within {timeout_s:.0f} s"))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    status, val = results.get(0, ("error", "rank 0 gave no answer"))
    if status != "ok":
        other = results.get(1, ("", ""))[1]
        return {"nccl_one_gpu": "refused", "reason": val, "rank1": other,
                "fallback": "colocated path: see cuda_copy.sglang_tp1_shard_* (CUDA IPC, no NCCL group)"}
    return {"nccl_one_gpu": "ok", "bytes": nbytes, "broadcast_ms": val, "broadcast_GBps": _gbps(nbytes, val)}


# ------------------------------------------------------------------------------------ sync (gloo)
def _receiver_main(port_q, stop_ev):
    """A minimal server side of the protocol (tp 1): receives buckets, keeps nothing."""
    import asyncio

    import torch.distributed as dist
    from aiohttp import web

    from areal_fast.weights.sync import init_custom_process_group

    st = {}

    async def handle(request):
        body = await request.json() if request.method == "POST" else {}
        p = request.path
        loop = asyncio.get_running_loop()
        if p == "/get_server_info":
            return web.json_response({"tp_size": 1, "version": "0.5.23"})
        if p == "/init_weights_update_group":
            st["pg"] = await loop.run_in_executor(None, lambda: init_custom_process_group(
                body["backend"], f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
                body["rank_offset"], body["group_name"], 120))
        elif p == "/update_weights_from_distributed":
            end = 0
            for d, s in zip(body["dtypes"], body["shapes"]):
                es = getattr(torch, d).itemsize
                end = -(-end // es) * es + es * int(np.prod(s, dtype=np.int64))
            buf = torch.empty(end, dtype=torch.uint8)
            await loop.run_in_executor(None, lambda: dist.broadcast(buf, src=0, group=st["pg"]))
        elif p == "/bench_raw":
            buf = torch.empty(body["nbytes"], dtype=torch.uint8)
            await loop.run_in_executor(None, lambda: dist.broadcast(buf, src=0, group=st["pg"]))
        elif p == "/destroy_weights_update_group":
            dist.destroy_process_group(st.pop("pg"))
        return web.json_response({"success": True, "message": ""})

    serve_until_stopped(handle, port_q, stop_ev)


def bench_sync(n_params: float, reps: int = 3, bucket_mb: int = 64) -> dict:
    import torch.distributed as dist

    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
    from areal_fast.weights.sync import SyncCalls, WeightSyncConfig

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with server_process(_receiver_main, start_timeout_s=60) as url:
        layers = max(1, int(n_params // (12 * 1024 * 1024 * 1.0 + 1)))
        spec = ModelSpec("qwen2", num_layers=layers, hidden_size=1024, intermediate_size=4096, num_heads=8,
                         num_kv_heads=8, head_dim=128, vocab_size=16384, qkv_bias=True)
        state = {n: torch.randn(s) for n, s in spec.hf_shapes().items()}
        nbytes = sum(t.numel() * 2 for t in state.values())
        sync = DistributedWeightSync([url], WeightSyncConfig(bucket_bytes=bucket_mb << 20, dtype="bfloat16",
                                                             collective="gloo", timeout_s=300))
        sync.connect()
        sync.update(state, 0)  # warm-up: plan, buffers
        raw = torch.empty(nbytes, dtype=torch.uint8)
        sync_s, raw_s = [], []
        from concurrent.futures import ThreadPoolExecutor

        raw_calls = SyncCalls()
        with ThreadPoolExecutor(1) as ex:
            for v in range(reps):  # interleaved, so both see the same machine load
                t = time.perf_counter()
                sync.update(state, v + 1)
                sync_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                f = ex.submit(raw_calls.call, url, "/bench_raw", {"nbytes": nbytes})
                dist.broadcast(raw, src=0, group=sync.pg)
                f.result()
                raw_s.append(time.perf_counter() - t)
        sync.close()
        raw_calls.close()
        s, r = float(np.median(sync_s)), float(np.median(raw_s))
        return {"bytes": nbytes, "params": nbytes // 2, "sync_GBps": nbytes / s / 1e9, "raw_broadcast_GBps":
                nbytes / r / 1e9, "ratio": r / s, "bucket_bytes": bucket_mb << 20, "cast": "fp32->bf16"}


PARTS = ("plan", "cpu_copy", "cuda_copy", "sync", "gpu_sync")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=csv_list(PARTS), default=list(PARTS), help=f"a subset of {','.join(PARTS)}")
    ap.add_argument("--layers", type=int, default=28, help="Qwen2.5-7B layers in the cuda_copy model (28: all)")
    ap.add_argument("--sync-params", type=float, default=100e6)
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--nccl-mb", type=int, default=1024, help="bytes of the one-GPU NCCL broadcast (MiB)")
    add_harness_args(ap)
    a = ap.parse_args(argv)
    parts = a.parts
    if a.dry_run:
        cases = [{"part": p} for p in parts]
        for c in cases:
            if c["part"] == "cuda_copy":
                c.update(layers=a.layers, **cuda_copy_bytes(a.layers))
            elif c["part"] == "sync":
                c.update(params=a.sync_params, bucket_mb=a.bucket_mb)
            elif c["part"] == "gpu_sync":
                c.update(nccl_mb=a.nccl_mb)
        print_dry_run("reshard", cases)
        return
    prov = provenance()
    rows = []
    for part in parts:
        if part == "plan":
            res = bench_plan()
        elif part == "cpu_copy":
            res = bench_cpu_copy()
        elif part == "cuda_copy":
            res = bench_cuda_copy(a.layers)
        elif part == "sync":
            res = bench_sync(a.sync_params, bucket_mb=a.bucket_mb)
        else:
            res = bench_gpu_sync(a.nccl_mb << 20)
        rows.append({"part": part, **res})
        print(json.dumps(rows[-1], indent=1), flush=True)
        save("reshard", rows[-1:], a, prov)  # at once: a run cut short keeps what it measured


if __name__ == "__main__":
    sys.exit(main())
