"""Test receiver: the server side of SGLang's weight-update protocol with real TP ranks.

An aiohttp server (127.0.0.1, free port, printed as ``PORT <n>`` on stdout) plus one spawned
worker process per TP rank, each joining the weight-update group as ``rank_offset + r``
exactly like an SGLang scheduler. Every worker keeps the full HF tensors it received and,
after each update, saves ``{dump}/v{version}_rank{r}.pt`` with those tensors and its
SGLang-layout TP shard built by the planner + interval copy (the fast path under test).

``--fail-tensor NAME``: the first update containing NAME is received, then answered 400 with
success=false, like a server whose load_weights rejects a tensor; later ones succeed.

From ``--version`` 0.5.21 on, weight-update sessions are enforced as SGLang does: a second
begin, an end without begin and a distributed update outside a session are refused (400,
before any broadcast is joined); disk updates need no session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import traceback

from packaging.version import Version


def _receive(pg, names, dtypes, shapes, load_format):
    import torch
    import torch.distributed as dist

    from areal_fast.weights.sync import init_custom_process_group  # noqa: F401 same helper as SGLang's

    metas = [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
    out = {}
    if load_format == "flattened_bucket":
        offs, end = [], 0
        for _, dt, shp in metas:
            es = dt.itemsize
            start = -(-end // es) * es
            offs.append(start)
            end = start + es * int(torch.Size(shp).numel())
        buf = torch.empty(end, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=pg)
        for (n, dt, shp), o in zip(metas, offs):
            out[n] = buf[o : o + dt.itemsize * torch.Size(shp).numel()].view(dt).view(shp).clone()
    elif load_format is None:
        for n, dt, shp in metas:
            t = torch.empty(shp, dtype=dt)
            dist.broadcast(t, src=0, group=pg)
            out[n] = t
    else:
        raise ValueError(f"load_format {load_format!r}")
    return out


def _tp_shard(state, spec, tp, rank):
    import torch

    from areal_fast.weights.interval_copy import interval_copy
    from areal_fast.weights.plan import dtype_code, plan_tp_shard

    names = list(spec.hf_shapes())
    srcs = [state[n].contiguous() for n in names]
    dt = srcs[0].dtype
    plan = plan_tp_shard(spec, tp, rank, names, [tuple(t.shape) for t in srcs], [dtype_code(t.dtype) for t in srcs], dt)
    buf = torch.zeros(plan.buffer_bytes, dtype=torch.uint8)
    interval_copy(srcs, [buf], plan.intervals[0])
    out = {}
    for n, shp, off in zip(plan.names, plan.shapes, plan.offsets.tolist()):
        nb = dt.itemsize * torch.Size(shp).numel()
        out[n] = buf[off : off + nb].view(dt).view(shp).clone()
    return out


def worker(conn, tp, rank, spec_json, dump):
    import torch

    from areal_fast.weights.delta_codec import delta_apply
    from areal_fast.weights.delta_wire import split_entries
    from areal_fast.weights.layout import ModelSpec
    from areal_fast.weights.sync import init_custom_process_group

    spec = ModelSpec(**json.loads(spec_json))
    pgs, state = {}, {}  # groups by name, as SGLang keeps them (one per trainer sender)
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "init":
                pgs[arg["group_name"]] = init_custom_process_group(
                    arg["backend"], f"tcp://{arg['master_address']}:{arg['master_port']}", arg["world_size"],
                    arg["rank_offset"] + rank, arg["group_name"], 60)
            elif cmd == "update":
                got = _receive(pgs[arg["group_name"]], arg["names"], arg["dtypes"], arg["shapes"], arg["load_format"])
                whole, deltas = split_entries(list(got.items()))
                state.update(whole)
                for n, (_shape, idx, val) in deltas.items():  # delta entries: only the changed elements
                    delta_apply(state[n], idx, val)
            elif cmd == "disk":
                import glob

                from safetensors.torch import load_file

                for f in sorted(glob.glob(os.path.join(arg["model_path"], "*.safetensors"))):
                    state.update(load_file(f))
            elif cmd == "destroy":
                import torch.distributed as dist

                dist.destroy_process_group(pgs.pop(arg["group_name"]))
            if cmd in ("update", "disk"):
                shard = _tp_shard(state, spec, tp, rank) if set(state) == set(spec.hf_shapes()) else None
                path = os.path.join(dump, f"v{arg['weight_version']}_rank{rank}.pt")
                torch.save({"full": state, "shard": shard}, path)
            conn.send(("ok", None))
        except Exception:  # noqa: BLE001 - reported to the HTTP handler
            conn.send(("error", traceback.format_exc()))


class Receiver:
    def __init__(self, args):
        self.args = args
        self.tp = args.tp
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(self.tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker, args=(b, self.tp, r, args.spec, args.dump), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.state = {"init_count": 0, "begin": 0, "end": 0, "weight_version": "default", "calls": [],
                      "session_open": False, "refused": 0}
        self.lock = asyncio.Lock()

    async def to_workers(self, cmd, arg):
        loop = asyncio.get_running_loop()

        def one(c):
            c.send((cmd, arg))
            return c.recv()

        res = await asyncio.gather(*(loop.run_in_executor(None, one, c) for c in self.conns))
        errs = [m for s, m in res if s != "ok"]
        if errs:
            raise RuntimeError(errs[0])

    async def handle(self, request):
        from aiohttp import web

        path = request.path
        if request.method == "GET":
            if path in ("/server_info", "/get_server_info"):
                return web.json_response({"tp_size": self.tp, "version": self.args.version,
                                          "weight_version": self.state["weight_version"]})
            if path == "/debug/state":
                return web.json_response(self.state)
            return web.json_response({"error": "not found"}, status=404)
        body = await request.json()
        sessions = Version(self.args.version) >= Version("0.5.21")
        st = self.state

        def refuse(message):
            st["refused"] += 1
            return web.json_response({"success": False, "message": message}, status=400)

        async with self.lock:
            try:
                if path == "/begin_weight_update" and sessions:
                    if st["session_open"]:
                        return refuse("a weight-update session is already open; call end_weight_update() first")
                    st["session_open"] = True
                    st["begin"] += 1
                elif path == "/end_weight_update" and sessions:
                    if not st["session_open"]:
                        return refuse("no weight-update session is open; call begin_weight_update() first")
                    st["session_open"] = False
                    st["end"] += 1
                elif path == "/update_weights_from_distributed" and sessions and not st["session_open"]:
                    return refuse("update_weights_from_distributed must run between begin_weight_update() and "
                                  "end_weight_update()")
                elif path == "/init_weights_update_group":
                    await self.to_workers("init", body)
                    self.state["init_count"] += 1
                elif path == "/update_weights_from_distributed":
                    if not (len(body["names"]) == len(body["dtypes"]) == len(body["shapes"])):
                        return web.json_response({"success": False, "message": "names/dtypes/shapes differ in length"})
                    await self.to_workers("update", body)
                    self.state["calls"].append({"n": len(body["names"]), "load_format": body["load_format"],
                                                "weight_version": body["weight_version"],
                                                "group": body["group_name"], "flush": body.get("flush_cache")})
                    if self.args.fail_tensor and self.args.fail_tensor in body["names"]:
                        name, self.args.fail_tensor = self.args.fail_tensor, None  # once
                        return refuse(f"Failed to update parameter online: shape mismatch for {name}")
                    self.state["weight_version"] = body["weight_version"]
                elif path == "/update_weights_from_disk":
                    await self.to_workers("disk", body)
                    self.state["calls"].append({"disk": body["model_path"], "weight_version": body["weight_version"]})
                    self.state["weight_version"] = body["weight_version"]
                elif path in ("/begin_weight_update", "/end_weight_update"):
                    return web.json_response({"detail": "Not Found"}, status=404)  # before 0.5.21
                elif path == "/destroy_weights_update_group":
                    await self.to_workers("destroy", body)
                else:
                    return web.json_response({"error": {"message": f"no route {path}"}}, status=404)
            except Exception as e:  # noqa: BLE001
                return web.json_response({"success": False, "message": str(e)[-2000:]}, status=400)
        return web.json_response({"success": True, "message": "ok"})


async def amain(args):
    from aiohttp import web

    rec = Receiver(args)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    while True:
        await asyncio.sleep(3600)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--spec", required=True, help="ModelSpec fields as JSON")
    ap.add_argument("--dump", required=True)
    ap.add_argument("--version", default="0.5.23")
    ap.add_argument("--fail-tensor", default=None)
    a = ap.parse_args()
    try:
        asyncio.run(amain(a))
    except KeyboardInterrupt:
        sys.exit(0)
