"""A receiving end of SGLang's weight-update wire for the tests and benchmarks: a model of named zero
parameters (:func:`zero_model`) and an aiohttp handler that receives into it through the embedded engine's
``WeightReceiver`` (:func:`receiver_handler`: groups by name, flattened buckets, deltas), as the engine does."""

from __future__ import annotations

from collections.abc import Callable

import torch


def zero_model(shapes: dict, dtype: torch.dtype = torch.bfloat16,
               root: torch.nn.Module | None = None) -> torch.nn.Module:
    """``root`` (a new empty module by default) with a zero ``dtype`` parameter (no grad) for each
    ``name: shape`` of ``shapes``, registered under its dotted name (the parts before the last are
    nested submodules, as in a real model)."""
    model = torch.nn.Module() if root is None else root
    for name, shape in shapes.items():
        mod = model
        *parents, leaf = name.split(".")
        for part in parents:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
    return model


def receiver_handler(recv, after_update: Callable[[dict], None] | None = None,
                     routes: dict[str, Callable[[dict], dict]] | None = None):
    """An aiohttp handler (for every method and path) answering SGLang's weight-update calls through
    ``recv`` (a ``WeightReceiver``): ``/server_info`` (tp 1, engine ``areal_fast.embedded``),
    ``/init_weights_update_group``, ``/update_weights_from_distributed`` (received and loaded in a worker
    thread, as the engine does; then ``after_update(body)`` there too) and
    ``/destroy_weights_update_group``; ``routes`` adds paths answered with ``fn(body)``'s JSON. A call
    that fails is answered as SGLang does: 400, ``success`` false and the error."""
    import asyncio

    from aiohttp import web

    from areal_fast.embedded.weight_sync import TensorMeta, parse_dtype

    routes = routes or {}

    async def handle(request):
        body = await request.json() if request.method == "POST" else {}
        p, loop = request.path, asyncio.get_running_loop()
        try:
            if p in ("/server_info", "/get_server_info"):
                return web.json_response({"tp_size": 1, "version": "0.5.20", "engine": "areal_fast.embedded"})
            if p in routes:
                return web.json_response(routes[p](body))
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
                if after_update is not None:
                    await loop.run_in_executor(None, after_update, body)
            elif p == "/destroy_weights_update_group":
                await loop.run_in_executor(None, recv.destroy_group, body["group_name"])
        except Exception as e:  # noqa: BLE001 - SGLang's answer to a failed call
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        return web.json_response({"success": True, "message": ""})

    return handle
