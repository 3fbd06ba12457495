"""Rank 0's server watchdog: a server that answers anything (a 503 while it is paused for a weight
update included) is alive; only refused connections, several in a row, drop it from the pool."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _shared import wait_until

from areal_fast.elastic.liveness import server_alive, server_ready
from areal_fast.launch import rank
from areal_fast.netutil import find_free_port


class _Paused(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(503)  # what SGLang's /health answers during a long pause
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def paused_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Paused)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_paused_server_is_reachable_a_closed_port_is_not(paused_server):
    assert not server_ready(paused_server)  # not healthy...
    assert server_alive(paused_server)  # ...but alive
    assert not server_alive(f"http://127.0.0.1:{find_free_port('127.0.0.1')}")


class _Pool:
    def __init__(self, urls):
        self.urls = list(urls)
        self.removed: list[str] = []

    def remove_server(self, url):
        self.urls.remove(url)
        self.removed.append(url)


def test_watchdog_keeps_a_paused_server_and_drops_a_dead_one(paused_server, monkeypatch):
    monkeypatch.setattr(rank, "_WATCH_S", 0.01)
    dead = f"http://127.0.0.1:{find_free_port('127.0.0.1')}"
    pool = _Pool([paused_server, dead])
    probed: list[str] = []  # every url the watchdog asked, round after round
    state = rank.server_state
    monkeypatch.setattr(rank, "server_state", lambda url, timeout_s: probed.append(url) or state(url, timeout_s))

    async def run():
        task = asyncio.create_task(rank._watch_servers(pool, "logs"))
        # the dead one is dropped after a few refused rounds
        await wait_until(lambda: pool.removed or task.done(), "the dead server to be dropped", 30)
        mark = probed.count(paused_server)
        await wait_until(lambda: probed.count(paused_server) >= mark + 5 or task.done(),
                         "five more rounds of the watchdog", 30)
        assert not task.done(), task  # the paused server stays, and so does the watchdog
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert pool.removed == [dead] and pool.urls == [paused_server]


def test_watchdog_fails_when_the_last_server_is_gone(monkeypatch):
    monkeypatch.setattr(rank, "_WATCH_S", 0.01)
    dead = f"http://127.0.0.1:{find_free_port('127.0.0.1')}"
    with pytest.raises(RuntimeError, match=rf"last inference server {dead}.*see logs"):
        asyncio.run(rank._watch_servers(_Pool([dead]), "logs"))
