"""Weight sync with many senders against today's rank-0 path, and where a delta update stops paying.

``senders``: 1, 2 and 4 gloo trainer ranks (dim-0 sharded DTensors, FSDP2's layout) push a Qwen-like
model in bf16 to 2 servers that load through the embedded engine's ``WeightReceiver`` (the twin's
receive code: whole tensors and deltas, each server checked bitwise against the trainer after the
run), with ``weights.senders: one`` (rank 0 gathers and sends everything, today's path) and ``rank``
(every rank sends its share over its own groups); whole updates, then delta updates (``delta: on``,
a fixed fraction of the elements changed per update). Per case: seconds per update (median) and the
bytes each rank sent to the servers, sent and received through the exchange and the gather.

``breakeven``: the delta codec on CPU (native C++; the Triton kernel under its interpreter on a small
tensor, for its shape only): encode and apply seconds per GB of bf16 tensor at densities 0.1-33 %, the
loopback wire's bytes per second from the ``senders`` part, and the density above which a delta update
costs more than sending the tensor whole (encode + the delta's bytes + apply vs the whole bytes).

``gpu`` (the GPU day's ``sync_pieces`` step; ``skipped`` rows without CUDA): the codec on one 256 MiB bucket
(Triton, torch; C++ on the host) and a one-rank NCCL group's broadcast of it with the receiver's unpack: the
single-GPU inputs of ``tools/sync_model.py`` (``--pieces``; what one GPU can and cannot stand for: its docstring).

    python bench/bench_sync_senders.py [--parts senders,breakeven,gpu] [--params 55e6] [--frac 0.0236]
                                       [--results DIR] [--no-results] [--allow-dirty] [--dry-run]

Results: rows in ``bench/results/sync_senders.jsonl`` (docs/weight_sync.md, "Many senders").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_delta import _digest, _gloo_shapes, _receiver_main  # noqa: E402
from bench.common import add_harness_args, csv_list, print_dry_run, provenance, save, server_process  # noqa: E402
from tools.sync_model import CHANGED, codec_bytes, pieces_inputs  # noqa: E402

PARTS = ("senders", "breakeven", "gpu")
RANKS = (1, 2, 4)
DENSITIES = (0.001, 0.01, 0.0236, 0.05, 0.1, 0.2, 0.333)


def _trainer(rank: int, world: int, port: int, urls: list[str], shapes: dict, frac: float, updates: int,
             out_q) -> None:
    """One trainer rank: every case of this world size, one after the other; rank 0 reports rows."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
    from areal_fast.weights.sync import SyncCalls, WeightSyncConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    for senders in (("one",) if world == 1 else ("one", "rank")):
        state = {n: distribute_tensor(t.clone(), mesh, [Shard(0)]) for n, t in full.items()}
        gp = torch.Generator().manual_seed(1 + rank)
        name = f"bench-{world}-{senders}"
        cfg = WeightSyncConfig(bucket_bytes=64 << 20, dtype="bfloat16", collective="gloo", timeout_s=600,
                               delta="on", delta_full_every=2 * updates + 2, senders=senders, group_name=name)
        sync = DistributedWeightSync(urls, cfg)
        sync.config.delta = "off"  # whole updates first (the transport keeps its delta encoder for later)
        sync.update(state, f"{name}-0")  # the groups and the plan
        for mode in ("whole", "delta"):
            if mode == "delta":  # delta: on, one whole update to fill the shadow, then the timed deltas
                sync.config.delta = "on"
                sync.update(state, f"{name}-fill")
            secs, stats = [], []
            for v in range(1, updates + 1):
                with torch.no_grad():
                    for t in state.values():  # this rank's shard: ``frac`` of it moves a bf16 step
                        loc = t.to_local()
                        m = torch.rand(loc.shape, generator=gp) < frac
                        loc[m] *= 1 + 2**-7
                dist.barrier()
                t0 = time.perf_counter()
                sync.update(state, f"{name}-{mode}-{v}")
                secs.append(time.perf_counter() - t0)
                every = [None] * world
                dist.all_gather_object(every, dict(sync.stats))
                stats.append(every)
            fulls = {n: t.full_tensor().to(torch.bfloat16) for n, t in state.items()}
            if rank == 0:
                calls = SyncCalls()
                digests = [calls.call(u, "/digest", {})["digest"] for u in urls]
                calls.close()
                want = _digest(fulls.values())
                last = stats[-1]
                sent = [int(r.get("bytes_to_servers", 0)) for r in last]
                out_q.put({"part": "senders", "ranks": world, "senders": senders, "update": mode,
                           "params": sum(math.prod(s) for s in shapes.values()), "servers": len(urls),
                           "bytes_whole": sum(math.prod(s) * 2 for s in shapes.values()),
                           "changed_frac_target": frac, "updates": updates,
                           "update_s_median": float(np.median(secs)), "update_s": secs,
                           "bytes_to_servers_per_rank": sent,
                           "exchange_sent_per_rank": [int(r.get("exchange_sent", 0)) for r in last],
                           "exchange_received_per_rank": [int(r.get("exchange_received", 0)) for r in last],
                           "gather_received_rank0": int(last[0].get("gather_received", 0)),
                           "shadow_bytes_per_rank": [int(r.get("shadow_bytes", 0)) for r in last],
                           "bitwise_equal_to_trainer": all(d == want for d in digests)})
            del fulls
        sync.close()
    dist.barrier()
    dist.destroy_process_group()


def model_shapes(n_params: float) -> dict[str, tuple[int, ...]]:
    """bench_delta's Qwen-like layers (16.8M parameters each), the embedding's rows sized to fill the rest:
    ``n_params`` to within one row (hidden 1024), where whole layers alone land up to a layer short."""
    shapes, emb = _gloo_shapes(n_params), "model.embed_tokens.weight"
    rest = n_params - sum(math.prod(s) for k, s in shapes.items() if k != emb)
    return shapes | {emb: (max(1, round(rest / shapes[emb][1])), shapes[emb][1])}


def bench_senders(n_params: float, frac: float, updates: int) -> list[dict]:
    import multiprocessing as mp

    from areal_fast.netutil import find_free_port

    shapes = model_shapes(n_params)
    rows = []
    with server_process(_receiver_main, (shapes,), start_timeout_s=120) as u1, \
            server_process(_receiver_main, (shapes,), start_timeout_s=120) as u2:
        for world in RANKS:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = find_free_port()
            procs = [ctx.Process(target=_trainer, args=(r, world, port, [u1, u2], shapes, frac, updates, q))
                     for r in range(world)]
            for p in procs:
                p.start()
            want = 2 if world == 1 else 4
            for _ in range(want):
                rows.append(q.get(timeout=1800))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "update_s"}), flush=True)
            for p in procs:
                p.join(120)
                if p.exitcode != 0:
                    raise RuntimeError(f"trainer rank process exited with {p.exitcode}")
    return rows


def _time(fn, reps: int = 3, cuda: bool = False) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        cuda and torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        cuda and torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def codec_rows(part: str, cases, wire_bytes_per_s: float | None = None) -> list[dict]:
    """``cases``: (backend, device, elements, densities): encode and apply, bitwise; with a wire, its side."""
    from areal_fast.weights.delta_codec import delta_apply, delta_encode

    rows = []
    for backend, device, n, densities in cases:
        g = torch.Generator(device=device).manual_seed(0)
        old = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
        for d in densities:
            a, b = old, old.clone()
            idx = torch.randperm(n, generator=g, device=device)[: max(1, int(d * n))]
            b[idx] = (b[idx].float() * (1 + 2**-6)).to(torch.bfloat16)
            reps, cuda = (3 if backend != "interpret" else 1), device != "cpu"
            try:
                enc_s = _time(lambda a=a, b=b, k=backend: delta_encode(a, b, backend=k), reps, cuda)
                i, v = delta_encode(a, b, backend=backend)
                dst = a.clone()
                app_s = _time(lambda dst=dst, i=i, v=v, k=backend: delta_apply(dst, i, v, backend=k), reps, cuda)
                assert torch.equal(dst.view(torch.int16), b.view(torch.int16))
            except Exception as e:  # noqa: BLE001 - the interpreter may be missing: recorded, not fatal
                rows.append({"part": part, "backend": backend, "density": d, "error": f"{type(e).__name__}: {e}"})
                continue
            size_gb, k = n * 2 / 1e9, int(i.numel())
            r = {"part": part, "backend": backend, "device": device, "numel": n, "density": d, "changed": k,
                 "encode_s_per_gb": enc_s / size_gb, "apply_s_per_gb": app_s / size_gb,
                 "codec_bytes_per_s": codec_bytes(n, k) / (enc_s + 2 * app_s), "bitwise_equal": True}
            if wire_bytes_per_s:
                whole_wire_s, delta_s = n * 2 / wire_bytes_per_s, enc_s + app_s + 6 * k / wire_bytes_per_s
                r.update(wire_bytes_per_s=wire_bytes_per_s, whole_wire_s_per_gb=whole_wire_s / size_gb,
                         delta_s_per_gb=delta_s / size_gb, delta_pays=delta_s < whole_wire_s)
            rows.append(r)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_breakeven(wire_bytes_per_s: float, numel: int = 32 << 20, interp_numel: int = 1 << 16) -> list[dict]:
    cases = [("native", "cpu", numel, DENSITIES), ("interpret", "cpu", interp_numel, (CHANGED,))]
    rows = codec_rows("breakeven", cases, wire_bytes_per_s)
    native = [r for r in rows if r.get("backend") == "native" and "error" not in r]
    paying = [r["density"] for r in native if r["delta_pays"]]
    losing = [r["density"] for r in native if not r["delta_pays"]]
    rows.append({"part": "breakeven_summary", "numel": numel, "gb": numel * 2 / 1e9,
                 "wire_bytes_per_s": wire_bytes_per_s,
                 "highest_paying_density": max(paying) if paying else None,
                 "lowest_losing_density": min(losing) if losing else None,
                 "encode_only_s_per_gb_at_0": native[0]["encode_s_per_gb"] if native else None})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_nccl(nbytes: int, reps: int = 10) -> dict:
    """A one-rank NCCL group on GPU 0 (no second GPU, no network)."""
    import torch.distributed as dist

    from areal_fast.netutil import find_free_port

    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{find_free_port('127.0.0.1')}", world_size=1,
                                rank=0, device_id=torch.device("cuda", 0))
    except Exception as e:  # noqa: BLE001 - recorded as the row's reason
        return {"part": "gpu_nccl", "error": f"NCCL refused a one-rank group: {type(e).__name__}: {e}"[:300]}
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out, dsts = torch.empty_like(buf), list(torch.empty_like(buf).chunk(16))
    t = {k: _time(f, reps, cuda=True) for k, f in (
        ("broadcast_bucket_s", lambda: dist.broadcast(buf, src=0)), ("broadcast_4KiB_s", lambda: dist.broadcast(
            buf[:4096], src=0)), ("allgather_copy_s", lambda: dist.all_gather_into_tensor(out, buf)),
        ("unpack_s", lambda: [d.copy_(p) for d, p in zip(dsts, buf.chunk(16))]))}
    dist.destroy_process_group()
    return {"part": "gpu_nccl", "ranks": 1, "bucket_bytes": nbytes, **t,
            "sender_bytes_per_s_local_bound": nbytes / (t["broadcast_bucket_s"] + t["unpack_s"])}


def bench_gpu(bucket_bytes: int = 256 << 20) -> list[dict]:
    if not torch.cuda.is_available():
        print("gpu: skipped, no CUDA device")
        return [{"part": p, "skipped": "no CUDA device"} for p in ("gpu_codec", "gpu_nccl")]
    n = bucket_bytes // 2
    rows = codec_rows("gpu_codec", [(b, dev, n if dev == "cuda" else n // 4, (CHANGED, 0.25)) for b, dev in
                                    (("triton", "cuda"), ("reference", "cuda"), ("native", "cpu"))])
    rows += [bench_nccl(bucket_bytes)]
    rows += [pieces_inputs(rows)]
    print(*map(json.dumps, rows[-2:]), sep="\n", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=csv_list(PARTS), default=list(PARTS[:2]), help=f"a subset of {','.join(PARTS)}")
    ap.add_argument("--params", type=float, default=55e6, help="parameters of the Qwen-like model (hidden 1024)")
    ap.add_argument("--frac", type=float, default=0.0236, help="changed fraction per delta update")
    ap.add_argument("--updates", type=int, default=3, help="timed updates per case and kind")
    ap.add_argument("--wire-bytes-per-s", type=float, default=None,
                    help="the wire for the break-even (default: whole updates of the senders part, rank 0 alone)")
    add_harness_args(ap)
    a = ap.parse_args(argv)
    if {"breakeven", "gpu"} <= set(a.parts):
        ap.error("--parts: breakeven runs Triton under its interpreter, gpu on the GPU: run them apart")
    if a.dry_run:
        print_dry_run("sync_senders", [{"part": p, "params": a.params, "frac": a.frac} for p in a.parts])
        return
    if "breakeven" in a.parts:  # the Triton kernel runs on CPU only under its interpreter, set before import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    prov = provenance()
    wire = a.wire_bytes_per_s
    for part in a.parts:
        if part == "senders":
            rows = bench_senders(a.params, a.frac, a.updates)
            one = [r for r in rows if r["senders"] == "one" and r["update"] == "whole" and r["ranks"] == 1]
            if wire is None and one:
                wire = one[0]["bytes_whole"] * one[0]["servers"] / one[0]["update_s_median"]
        else:
            rows = bench_breakeven(wire or 1e9) if part == "breakeven" else bench_gpu()
        save("sync_senders", rows, a, prov)


if __name__ == "__main__":
    sys.exit(main())
