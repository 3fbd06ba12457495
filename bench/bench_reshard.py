"""Benchmark the reshard planner, the interval copy and a full weight sync.

    python bench/bench_reshard.py [--out] [--sync-params 100e6] [--skip-sync]

* plan: build time of the FSDP2 -> flattened-bucket plan and of one TP rank's SGLang-layout
  plan for a 7B-shaped model (Qwen2.5-7B shapes; goal <= 5 ms), C++ vs the Python reference;
* cpu_copy: GB/s of the C++ interval copy (fp32 -> bf16 pack of a whole model into one
  buffer, and a same-dtype byte copy) vs torch ``copy_`` per tensor doing the same work;
* cuda_copy (with a GPU): the CUDA kernel vs a same-size ``copy_`` (goal >= 80%);
* sync (CPU, gloo): bytes/s of DistributedWeightSync.update to a receiver process over
  loopback vs a raw ``dist.broadcast`` of one flat buffer of the same size in the same group
  (goal >= 0.9x).
``--out`` writes bench/results/reshard_<device>.json with device, versions, commit and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

from areal_fast.weights.interval_copy import interval_copy
from areal_fast.weights.layout import ModelSpec
from areal_fast.weights.plan import plan_fsdp_buckets, plan_tp_shard, rows_cols

QWEN25_7B = ModelSpec("qwen2", num_layers=28, hidden_size=3584, intermediate_size=18944, num_heads=28, num_kv_heads=4,
                      head_dim=128, vocab_size=152064, qkv_bias=True)


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


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
            lambda impl=impl: plan_tp_shard(spec, 4, 1, names, shapes, [1] * n, torch.bfloat16, n_ranks=8, backend=impl),
            r)
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


def bench_cuda_copy(reps: int = 20) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    spec = ModelSpec("qwen2", num_layers=28, hidden_size=1536, intermediate_size=8960, num_heads=12, num_kv_heads=2,
                     head_dim=128, vocab_size=151936, qkv_bias=True)  # Qwen2.5-1.5B
    ts = [t.cuda() for t in _model_tensors(spec)]
    n = len(ts)
    rc = np.array([rows_cols(t.shape) for t in ts])
    plan = plan_fsdp_buckets(rc[:, 0], rc[:, 1], [1] * n, [2] * n, 1, 1 << 40)
    iv = plan.pack_intervals(0, 0)
    buf = torch.empty(int(plan.seg_bytes[0]), dtype=torch.uint8, device="cuda")
    flat = torch.cat([t.reshape(-1) for t in ts])
    flat_out = torch.empty(flat.numel(), dtype=torch.bfloat16, device="cuda")

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / reps

    moved = flat.numel() * 6
    ours = timed(lambda: interval_copy(ts, [buf], iv, check=False))
    same = timed(lambda: flat_out.copy_(flat))
    views = [buf[o : o + 2 * t.numel()].view(torch.bfloat16).view(t.shape) for o, t in zip(plan.offset.tolist(), ts)]
    per_tensor = timed(lambda: [v.copy_(t) for v, t in zip(views, ts)])
    ok = all(torch.equal(v, t.to(torch.bfloat16)) for v, t in zip(views, ts))
    return {"params": int(flat.numel()), "tensors": n, "kernel_GBps": _gbps(moved, ours),
            "same_size_copy_GBps": _gbps(moved, same), "ratio": same / ours,
            "torch_per_tensor_GBps": _gbps(moved, per_tensor), "bitwise_equal_torch": ok}


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

    async def amain():
        app = web.Application()
        app.router.add_route("*", "/{t:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(site._server.sockets[0].getsockname()[1])
        while not stop_ev.is_set():
            await asyncio.sleep(0.1)
        await runner.cleanup()

    asyncio.run(amain())


def bench_sync(n_params: float, reps: int = 3, bucket_mb: int = 64) -> dict:
    import torch.distributed as dist

    from areal_fast.weights._http import call
    from areal_fast.weights.sync import DistributedWeightSync, WeightSyncConfig

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_receiver_main, args=(q, stop), daemon=True)
    proc.start()
    try:
        url = f"http://127.0.0.1:{q.get(timeout=60)}"
        layers = max(1, int(n_params // (12 * 1024 * 1024 * 1.0 + 1)))
        spec = ModelSpec("qwen2", num_layers=layers, hidden_size=1024, intermediate_size=4096, num_heads=8,
                         num_kv_heads=8, head_dim=128, vocab_size=16384, qkv_bias=True)
        state = {n: torch.randn(s) for n, s in spec.hf_shapes().items()}
        nbytes = sum(t.numel() * 2 for t in state.values())
        sync = DistributedWeightSync([url], WeightSyncConfig(bucket_bytes=bucket_mb << 20, dtype=torch.bfloat16,
                                                             backend="gloo", timeout_s=300))
        sync.connect()
        sync.update(state, 0)  # warm-up: plan, buffers
        raw = torch.empty(nbytes, dtype=torch.uint8)
        sync_s, raw_s = [], []
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as ex:
            for v in range(reps):  # interleaved, so both see the same machine load
                t = time.perf_counter()
                sync.update(state, v + 1)
                sync_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                f = ex.submit(call, url, "/bench_raw", {"nbytes": nbytes})
                dist.broadcast(raw, src=0, group=sync.pg)
                f.result()
                raw_s.append(time.perf_counter() - t)
        sync.close()
        s, r = float(np.median(sync_s)), float(np.median(raw_s))
        return {"bytes": nbytes, "params": nbytes // 2, "sync_GBps": nbytes / s / 1e9, "raw_broadcast_GBps":
                nbytes / r / 1e9, "ratio": r / s, "bucket_bytes": bucket_mb << 20, "cast": "fp32->bf16"}
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def provenance() -> dict:
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         cwd=os.path.dirname(__file__)).strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86_64'}, " \
        f"{os.cpu_count()} cores)"
    return {"device": dev, "torch": torch.__version__, "python": platform.python_version(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_1m": os.getloadavg()[0]}  # CPU numbers on a shared, loaded box are noisy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", action="store_true", help="write bench/results/reshard_<device>.json")
    ap.add_argument("--sync-params", type=float, default=100e6)
    ap.add_argument("--skip-sync", action="store_true")
    ap.add_argument("--bucket-mb", type=int, default=32)
    a = ap.parse_args()
    res = {"provenance": provenance(), "plan": bench_plan()}
    print(json.dumps(res["plan"], indent=1), flush=True)
    res["cpu_copy"] = bench_cpu_copy()
    print(json.dumps(res["cpu_copy"], indent=1), flush=True)
    res["cuda_copy"] = bench_cuda_copy()
    print(json.dumps(res["cuda_copy"], indent=1), flush=True)
    if not a.skip_sync:
        res["sync_gloo"] = bench_sync(a.sync_params, bucket_mb=a.bucket_mb)
        print(json.dumps(res["sync_gloo"], indent=1), flush=True)
    if a.out:
        d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(d, exist_ok=True)
        tag = "gpu" if torch.cuda.is_available() else "cpu"
        path = os.path.join(d, f"reshard_{tag}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
