"""A server that receives through the embedded engine's ``WeightReceiver`` (the twin's SGLang-wire receive
code: groups by name, flattened buckets, deltas, per-expert names written into fused expert parameters).

Its model holds zero bf16 parameters of ``--shapes`` (JSON ``{name: shape}``). Every update call is
received and loaded in a worker thread, as the engine does (calls of different groups may overlap).
After each call it saves ``{dump}/v{version}_rank0.pt``: ``{"full": the parameters in checkpoint layout}``.
Prints ``PORT <n>`` once it listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading

import torch


def build(shapes: dict) -> torch.nn.Module:
    model = torch.nn.Module()
    for n, s in shapes.items():
        mod = model
        for part in n.split(".")[:-1]:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(n.split(".")[-1], torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16),
                                                                    requires_grad=False))
    return model


async def amain(a) -> None:
    from aiohttp import web

    from areal_fast.embedded.weight_sync import TensorMeta, WeightReceiver, parse_dtype
    from areal_fast.weights.experts import to_checkpoint_state

    model = build(json.loads(a.shapes))
    recv = WeightReceiver(model, timeout_s=60)
    dump_lock = threading.Lock()

    def dump(version: str) -> None:
        with dump_lock:
            state = {k: v.detach().clone() for k, v in to_checkpoint_state(dict(model.named_parameters())).items()}
            torch.save({"full": state}, os.path.join(a.dump, f"v{version}_rank0.pt"))

    async def handle(request):
        body = await request.json() if request.method == "POST" else {}
        p, loop = request.path, asyncio.get_running_loop()
        try:
            if p in ("/server_info", "/get_server_info"):
                return web.json_response({"tp_size": 1, "version": "0.5.20", "engine": "areal_fast.embedded"})
            if p == "/init_weights_update_group":
                await loop.run_in_executor(None, lambda: recv.init_group(
                    body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
                    body["group_name"], body["backend"]))
            elif p == "/update_weights_from_distributed":
                metas = [TensorMeta(n, parse_dtype(d), tuple(s)) for n, d, s in
                         zip(body["names"], body["dtypes"], body["shapes"])]
                named = await loop.run_in_executor(None, recv.receive, metas, body["group_name"],
                                                   body["load_format"])
                await loop.run_in_executor(None, recv.load, named)
                await loop.run_in_executor(None, dump, body["weight_version"])
            elif p == "/destroy_weights_update_group":
                await loop.run_in_executor(None, recv.destroy_group, body["group_name"])
        except Exception as e:  # noqa: BLE001 - SGLang's answer to a failed call
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        return web.json_response({"success": True, "message": ""})

    app = web.Application(client_max_size=1 << 26)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)
    while True:
        await asyncio.sleep(3600)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--dump", required=True)
    asyncio.run(amain(ap.parse_args()))
