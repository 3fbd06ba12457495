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
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: the repository root, for tools.*
from tools.weight_receiver import receiver_handler, zero_model  # noqa: E402


async def amain(a) -> None:
    from aiohttp import web

    from areal_fast.embedded.weight_sync import WeightReceiver
    from areal_fast.weights.experts import to_checkpoint_state

    model = zero_model(json.loads(a.shapes))
    recv = WeightReceiver(model, timeout_s=60)
    dump_lock = threading.Lock()

    def dump(body: dict) -> None:
        with dump_lock:
            state = {k: v.detach().clone() for k, v in to_checkpoint_state(dict(model.named_parameters())).items()}
            torch.save({"full": state}, os.path.join(a.dump, f"v{body['weight_version']}_rank0.pt"))

    handle = receiver_handler(recv, after_update=dump)
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
