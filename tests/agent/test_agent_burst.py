"""A run's start on the agent endpoint: a few hundred episodes connect at once, their agents in the
controller's event loop, which a loaded machine makes late. The listeners' cap on connections
without a key (``areal_fast.http.conn_guard``: 64, the oldest closed once they had 1 s to send their
request) took the episodes' own fresh connections for idle ones: the openai SDK (``max_retries=0``:
a retried call could duplicate a turn) raised ``APIConnectionError`` from ``httpx.ReadError`` or
"Server disconnected", and more than half of the first episodes failing stopped the run. The cap now
counts connections beyond one per open episode, and never closes a connection whose request is
read and not yet answered.

A late loop is made here by setting the cap's grace to zero: every connection is as late with its
first request as a loaded loop makes it (a stall past the grace), with nothing timed."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

import pytest
from _shared import wait_until
from test_agent_session import EOS, MODEL, episode, ids, run

from areal_fast.agent import server as agent_server
from areal_fast.agent.server import AgentServer
from areal_fast.http import conn_guard
from areal_fast.http.conn_guard import ConnGuard, ConnLimits
from areal_fast.workflow.api import load_workflow

ROW = SimpleNamespace(text="1=", task={"answer": "1"})


async def _lists_models(row, client):
    """An agent of one call (the episode's SDK client of the shared endpoint)."""
    return float([m.id for m in (await client.models.list()).data] == [MODEL])


def test_episodes_beyond_the_cap_that_connect_at_once_are_all_served_on_a_late_loop(monkeypatch):
    """The production path (``openai_agent`` with ``transport: http``: the shared endpoint and one
    openai SDK per loop) with more episodes at once than the cap: every call is served."""
    pytest.importorskip("openai")
    cap = 4  # the shared endpoint's, for a small burst (64 by default)
    monkeypatch.setattr(agent_server, "ConnLimits", functools.partial(ConnLimits, max_unauthenticated=cap))
    monkeypatch.setattr(conn_guard, "CAP_GRACE_S", 0.0)
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    n = 3 * cap

    async def one(k: int):
        eng, _ = episode([ids("1") + [EOS]])
        eng.episode_id = f"burst{k}"
        try:
            await wf(ROW, eng, agent=f"{__name__}:_lists_models", transport="http")
        except Exception as e:  # noqa: BLE001 - the test reports what failed
            cause = e.__cause__
            return f"{type(e).__name__} from {cause!r} from {getattr(cause, '__cause__', None)!r}"
        return "ok"

    async def go():
        return await asyncio.gather(*[one(k) for k in range(n)])

    got = run(go())
    assert got == ["ok"] * n, sorted(set(got))


def test_connections_of_open_episodes_late_with_their_first_request_are_kept(monkeypatch):
    """Raw connections stand for the SDK's: each of the cap plus a few open episodes connects, and
    only once every connection is accepted (the loop late) sends its first request: all are answered."""
    monkeypatch.setattr(conn_guard, "CAP_GRACE_S", 0.0)
    cap, extra = 2, 4

    async def go():
        async with AgentServer(conn_limits=ConnLimits(max_unauthenticated=cap)) as server:
            clients = [episode([])[0].openai() for _ in range(cap + extra)]
            urls = [server.open(c) for c in clients]
            guard = conn_guard.guard_of(server.app)
            conns = [await asyncio.open_connection(server.host, server.port) for _ in clients]
            await wait_until(lambda: guard.unauthenticated + guard.evicted == len(conns),
                             "the listener to accept every connection")
            statuses = []
            for (reader, writer), c, url in zip(conns, clients, urls):
                path = url.split(str(server.port), 1)[1] + "/models"
                writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {c.api_key}\r\n\r\n".encode())
                try:
                    statuses.append(int((await reader.readline()).split()[1]))
                except (ConnectionError, IndexError):  # reset, or closed before a status line
                    statuses.append("closed")
            for _, writer in conns:
                writer.close()
            return statuses, guard.evicted

    statuses, evicted = run(go())
    assert statuses == [200] * (cap + extra) and evicted == 0


def test_the_cap_never_closes_a_connection_whose_request_is_read_and_not_yet_answered(monkeypatch):
    """aiohttp read the head (its wait for a request is over) but the handler has not checked the
    key yet: over the cap, the idle connection is closed, this one is not."""
    monkeypatch.setattr(conn_guard, "CAP_GRACE_S", 0.0)

    class Handler:
        def __init__(self, loop, read: bool):
            self._waiter = loop.create_future()  # aiohttp's RequestHandler waiting for a head
            if read:
                self._waiter.set_result(None)  # what its data_received does with a complete head
            self.closed = False

        def force_close(self):
            self.closed = True

    async def go():
        loop = asyncio.get_running_loop()
        server = SimpleNamespace(connection_made=lambda h, t: None, connection_lost=lambda h, e=None: None,
                                 request_factory=lambda *a: None)
        guard = ConnGuard(ConnLimits(max_unauthenticated=1))
        guard.install(server)
        transport = SimpleNamespace(get_extra_info=lambda name: None)
        read, idle = Handler(loop, True), Handler(loop, False)
        for h in (read, idle):  # the read one is the oldest: the first the cap would close
            server.connection_made(h, transport)
        return read.closed, idle.closed, guard.evicted

    assert run(go()) == (False, True, 1)
