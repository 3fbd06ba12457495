"""The worker-process side of ``ShardedRollout`` (``rollout/sharded.py``): one spawned process
that runs an ordinary ``RolloutClient`` over its share of the servers.

It owns the process's life (``worker_main``: it dies with its parent, runs its own event loop)
and the serving of one socket to the controller (``_serve``): every ``gen`` request becomes a
task of the client's ``generate`` and exactly one answer item goes back for it (the answer, the
error, or ``(rid, None)`` once the controller cancelled it); control calls (pause, continue,
health) are acknowledged after the answers sent before them; ``remove`` drops a server (the control
op ``add`` adds one); ``close`` or the end of the socket ends the process. The messages are ``rollout/sharded_wire.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from areal_fast.procutil import die_with_parent
from areal_fast.rollout.answer import TOKEN_ARRAY
from areal_fast.rollout.client import RolloutClient, RolloutError
from areal_fast.rollout.sharded_wire import Batcher, answer_item, as_array, frame, picklable, read_frame

log = logging.getLogger(__name__)


def worker_main(index: int, sock_path: str, urls: list[str], client_kwargs: dict, loop: str | None) -> None:
    """Entry point of worker ``index`` (spawned): serve requests for ``urls`` until told to close."""
    from areal_fast.rollout.loop import run_event_loop

    die_with_parent()  # killed by the kernel if the controller dies, even by SIGKILL
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rollout-worker-{index} %(levelname)s %(message)s")
    run_event_loop(_serve(index, sock_path, urls, client_kwargs), loop)


async def _serve(index: int, sock_path: str, urls: list[str], client_kwargs: dict) -> None:
    reader, writer = await asyncio.open_unix_connection(sock_path)
    writer.writelines(frame(("hello", index, os.getpid())))
    client = RolloutClient(urls, **client_kwargs)
    try:
        await client.start()
    except Exception as e:  # noqa: BLE001 - reported to the controller, which raises it
        writer.writelines(frame(("ready", picklable(e))))
        await writer.drain()
        await client.close()
        writer.close()
        return
    writer.writelines(frame(("ready", None)))
    out = Batcher(writer, "ans")
    tasks: dict[str, asyncio.Task] = {}

    closing = False
    cancelled: set[asyncio.Task] = set()  # tasks the controller cancelled: their one item is (rid, None)

    async def one(rid: str, ids: bytes, sampling: dict) -> None:
        """Generate ``rid``; exactly one item goes back for it: the answer, the error, or (rid, None)
        when the controller cancelled it (whatever the client made of the cancellation)."""
        try:
            # the prompt goes to the client as an array, the answer's columns back as their bytes: no
            # per-token Python object on either way
            r = await client.generate(as_array(ids, TOKEN_ARRAY), sampling, rid=rid)
            item = answer_item(rid, r)
            del r
        except asyncio.CancelledError:
            item = (rid, None)
        except Exception as e:  # noqa: BLE001 - the controller's generate raises it
            item = (rid, picklable(e))
        if closing:  # the controller asked us to stop: it expects nothing more
            return
        me = asyncio.current_task()
        if me in cancelled:
            cancelled.discard(me)
            item = (rid, None)
        out.add(item)
        if tasks.get(rid) is me:
            del tasks[rid]

    async def control(seq: int, op: str, arg) -> None:
        try:
            if op == "pause":
                t0 = time.perf_counter()
                await client.pause_all(arg)
                result = (dict(client.server_pause_modes), time.perf_counter() - t0)
            elif op == "continue":
                await client.continue_all()
                result = None
            elif op == "health":
                result = await client.health(arg)
            elif op == "add":  # a server that joined mid-run (it holds the current weights)
                result = await client.add_server(arg)
            else:
                raise RolloutError(f"rollout worker {index}: unknown control op {op!r}")
            reply = ("ack", seq, True, result)
        except Exception as e:  # noqa: BLE001 - raised on the controller's side
            reply = ("ack", seq, False, picklable(e))
        out.flush()  # answers that came before the acknowledgement leave first
        writer.writelines(frame(reply))

    try:
        while True:
            msg = await read_frame(reader)
            if msg is None or msg[0] == "close":
                break
            kind = msg[0]
            if kind == "gen":
                for rid, ids, sampling in msg[1]:
                    tasks[rid] = asyncio.create_task(one(rid, ids, sampling))
            elif kind == "cancel":  # the controller hears of it: (rid, None), or the answer already sent
                t = tasks.get(msg[1])
                if t is not None and not t.done():
                    cancelled.add(t)
                    t.cancel()
            elif kind == "remove":  # in order with the frames around it (a retried pause comes after)
                try:
                    client.remove_server(msg[1])
                except RolloutError as e:
                    log.warning("%s", e)
            elif kind == "ctl":
                asyncio.create_task(control(*msg[1:]))
    finally:
        closing = True
        for t in list(tasks.values()):
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await client.close()
        out.flush()
        writer.close()
