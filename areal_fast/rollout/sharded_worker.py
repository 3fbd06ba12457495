"""The worker-process side of ``ShardedRollout`` (``rollout/sharded.py``): one spawned process
that runs an ordinary rollout client (the backend's adapter) over its share of the servers.

It owns the process's life (``worker_main``: it dies with its parent, runs its own event loop)
and the serving of one socket to the controller (``_serve``, then ``_Session``): every ``gen`` request becomes a
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

from areal_fast.columns import TOKEN_ARRAY
from areal_fast.procutil import die_with_parent
from areal_fast.rollout.client import RolloutClient, RolloutError
from areal_fast.rollout.sharded_wire import Batcher, answer_item, as_array, frame, picklable, read_frame

log = logging.getLogger(__name__)


def worker_main(index: int, sock_path: str, urls: list[str], client_class: type[RolloutClient], client_kwargs: dict,
                loop: str | None) -> None:
    """Entry point of worker ``index`` (spawned): serve requests for ``urls`` until told to close.
    ``client_class``: the backend's client adapter (a ``RolloutClient`` subclass, picked by the
    layer above), built here with ``client_kwargs``."""
    from areal_fast.rollout.loop import run_event_loop

    die_with_parent()  # killed by the kernel if the controller dies, even by SIGKILL
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rollout-worker-{index} %(levelname)s %(message)s")
    run_event_loop(_serve(index, sock_path, client_class, urls, client_kwargs), loop)


async def _serve(index: int, sock_path: str, client_class: type[RolloutClient], urls: list[str],
                 client_kwargs: dict) -> None:
    """Say hello, start the client (its failure goes back to the controller), then serve until closed."""
    reader, writer = await asyncio.open_unix_connection(sock_path)
    writer.writelines(frame(("hello", index, os.getpid())))
    client = client_class(urls, **client_kwargs)
    try:
        await client.start()
    except Exception as e:  # noqa: BLE001 - reported to the controller, which raises it
        writer.writelines(frame(("ready", picklable(e))))
        await writer.drain()
        await client.close()
        writer.close()
        return
    writer.writelines(frame(("ready", None)))
    session = _Session(index, client, writer)
    try:
        while True:
            msg = await read_frame(reader)
            if msg is None or msg[0] == "close":
                break
            session.dispatch(msg)
    finally:
        await session.shutdown()


class _Session:
    """One worker's serving of the controller's socket: the generate tasks and the control calls."""

    def __init__(self, index: int, client: RolloutClient, writer: asyncio.StreamWriter):
        self.index, self.client, self.writer = index, client, writer
        self.out = Batcher(writer, "ans")
        self.tasks: dict[str, asyncio.Task] = {}
        self.closing = False
        self.cancelled: set[asyncio.Task] = set()  # tasks the controller cancelled: their one item is (rid, None)

    def dispatch(self, msg: tuple) -> None:
        """Act on one frame from the controller (``rollout/sharded_wire.py`` has the messages)."""
        kind = msg[0]
        if kind == "gen":
            for rid, ids, sampling, priority in msg[1]:
                self.tasks[rid] = asyncio.create_task(self.one(rid, ids, sampling, priority))
        elif kind == "cancel":  # the controller hears of it: (rid, None), or the answer already sent
            t = self.tasks.get(msg[1])
            if t is not None and not t.done():
                self.cancelled.add(t)
                t.cancel()
        elif kind == "remove":  # in order with the frames around it (a retried pause comes after)
            try:
                self.client.remove_server(msg[1])
            except RolloutError as e:
                log.warning("%s", e)
        elif kind == "ctl":
            asyncio.create_task(self.control(*msg[1:]))

    async def one(self, rid: str, ids: bytes, sampling: dict, priority: int = 0) -> None:
        """Generate ``rid``; exactly one item goes back for it: the answer, the error, or (rid, None)
        when the controller cancelled it (whatever the client made of the cancellation)."""
        try:
            # the prompt goes to the client as an array, the answer's columns back as their bytes: no
            # per-token Python object on either way
            r = await self.client.generate(as_array(ids, TOKEN_ARRAY), sampling, rid=rid, priority=priority)
            item = answer_item(rid, r)
            del r
        except asyncio.CancelledError:
            item = (rid, None)
        except Exception as e:  # noqa: BLE001 - the controller's generate raises it
            item = (rid, picklable(e))
        if self.closing:  # the controller asked us to stop: it expects nothing more
            return
        me = asyncio.current_task()
        if me in self.cancelled:
            self.cancelled.discard(me)
            item = (rid, None)
        self.out.add(item)
        if self.tasks.get(rid) is me:
            del self.tasks[rid]

    async def control(self, seq: int, op: str, arg) -> None:
        """Run control call ``op``; its acknowledgement leaves after the answers that came before it."""
        try:
            reply = ("ack", seq, True, await self._control_op(op, arg))
        except Exception as e:  # noqa: BLE001 - raised on the controller's side
            reply = ("ack", seq, False, picklable(e))
        self.out.flush()
        self.writer.writelines(frame(reply))

    async def _control_op(self, op: str, arg):
        client = self.client
        if op == "pause":
            t0 = time.perf_counter()
            await client.pause_all(arg)
            return dict(client.server_pause_modes), time.perf_counter() - t0
        if op == "continue":
            await client.continue_all()
            return None
        if op == "health":
            return await client.health(arg)
        if op == "add":  # a server that joined mid-run (it holds the current weights)
            return await client.add_server(arg)
        raise RolloutError(f"rollout worker {self.index}: unknown control op {op!r}")

    async def shutdown(self) -> None:
        """Cancel what still runs, close the client, send what is batched and close the socket."""
        self.closing = True
        for t in list(self.tasks.values()):
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.client.close()
        self.out.flush()
        self.writer.close()
