"""Idle connections on our listeners (``areal_fast.http.conn_guard``), shown on the embedded engine
(the agent endpoint shares the guard: ``tests/agent/test_agent_session.py``), and the raised limit on
open descriptors (``areal_fast.procutil.raise_nofile_limit``).

Without the guard a connection that never sent a request was kept for about an hour and counted
nowhere: enough of them used up the process's descriptors and locked every client out. Waits here
are bounded (a connection must be closed within ``CLOSE_WITHIN_S``), never timed."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from _shared import CLOSE_WITHIN_S, closed_by_server, connect, request_answer, tiny_model
from _shared import request as shared_request

from areal_fast.embedded import start_engine_in_thread
from areal_fast.http.conn_guard import ConnLimits

KEY = "guard-key"
CAP = 8  # unauthenticated connections kept by the capped engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny_guard")


@pytest.fixture(scope="module")
def quick_head(model_dir):
    """An engine that gives a connection 0.5 s for its first request head (and 120 s of keep-alive)."""
    h = start_engine_in_thread(model_dir, api_key=KEY,
                               conn_limits=ConnLimits(head_timeout_s=0.5, keepalive_s=120, max_unauthenticated=64))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def quick_keepalive(model_dir):
    """An engine that keeps an idle connection 0.5 s after an answer."""
    h = start_engine_in_thread(model_dir, api_key=KEY,
                               conn_limits=ConnLimits(head_timeout_s=120, keepalive_s=0.5))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def capped(model_dir):
    """An engine with long timeouts and room for only CAP unauthenticated connections."""
    h = start_engine_in_thread(model_dir, api_key=KEY,
                               conn_limits=ConnLimits(head_timeout_s=120, keepalive_s=120, max_unauthenticated=CAP))
    yield h
    h.stop()


def request(s: socket.socket, path: str, key: str | None = KEY) -> int:
    """One keep-alive GET on ``s`` with the engine's key (``_shared.request``)."""
    return shared_request(s, path, key)


def test_idle_connections_without_a_request_are_closed_after_the_head_timeout(quick_head):
    quick = quick_head
    idle = [connect(quick.url) for _ in range(64 + 20)]  # 20 beyond the cap: the others time out
    partial = connect(quick.url)  # a request head that never ends
    partial.sendall(b"GET /server_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n")
    try:
        for s in [*idle, partial]:
            assert closed_by_server(s, CLOSE_WITHIN_S), "an idle connection outlived the head timeout"
        with connect(quick.url) as s:  # the listener still serves
            assert request(s, "/server_info") == 200
    finally:
        for s in [*idle, partial]:
            s.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(quick_keepalive):
    with connect(quick_keepalive.url) as s:
        assert request(s, "/server_info") == 200
        assert closed_by_server(s, CLOSE_WITHIN_S), "an idle keep-alive connection was kept past its timeout"


def test_an_authorized_client_gets_200_while_unauthenticated_connections_are_at_the_cap(capped):
    kept = connect(capped.url)
    assert request(kept, "/server_info") == 200  # authenticated: no longer counted
    idle = [connect(capped.url) for _ in range(CAP + 20)]
    try:
        # beyond the cap, the oldest unauthenticated connections are closed once they had 1 s to speak
        for s in idle[:20]:
            assert closed_by_server(s, CLOSE_WITHIN_S), "more unauthenticated connections than the cap were kept"
        for s in idle[20:]:
            assert not closed_by_server(s, 0.2), "a connection within the cap was closed"
        with connect(capped.url) as fresh:  # a new client with the key: served, at the cap
            assert request(fresh, "/server_info") == 200
            assert request(fresh, "/server_info") == 200
        assert request(kept, "/server_info") == 200  # an authenticated connection is never evicted
        # a request without the key does not authenticate its connection: it stays counted
        refused = connect(capped.url)
        assert request(refused, "/server_info", key=None) == 401
        probe = connect(capped.url)
        assert request(probe, "/health", key=None) == 200  # no key needed there, so none proved
        more = [connect(capped.url) for _ in range(CAP)]
        assert closed_by_server(refused, CLOSE_WITHIN_S), "a connection refused its key escaped the cap"
        assert closed_by_server(probe, CLOSE_WITHIN_S), "a probe without the key escaped the cap"
        for s in more:
            s.close()
    finally:
        kept.close()
        for s in idle:
            s.close()


def test_a_burst_of_clients_beyond_the_cap_is_served(capped):
    """The cap closes a connection only once it has had time to send its request: clients that
    connect together (the rollout client opens one connection per request in flight) are served."""
    burst = [connect(capped.url) for _ in range(5 * CAP)]
    try:
        for s in burst:
            s.sendall(f"GET /server_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        assert all(request_answer(s) == 200 for s in burst)
    finally:
        for s in burst:
            s.close()


def test_the_engine_keeps_as_many_connections_without_a_key_as_requests_it_runs(model_dir, monkeypatch):
    """The rollout client opens one connection per request in flight (the launcher sizes
    --max-running-requests to the run's requests in flight): a start burst past the default cap of 64,
    every connection late with its first request (a loaded controller loop; here the cap's grace is
    zero), is the engine's own clients, not a flood, and none is closed."""
    from areal_fast.http import conn_guard

    monkeypatch.setattr(conn_guard, "CAP_GRACE_S", 0.0)
    n = 80
    def answer(s: socket.socket) -> int | None:  # None: the engine closed it
        try:
            s.sendall(f"GET /server_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            return request_answer(s)
        except (AssertionError, OSError):
            return None

    for running in (96, 8):  # 8: the cap stays 64, and the burst past it loses connections
        h = start_engine_in_thread(model_dir, api_key=KEY, max_running_requests=running)
        burst = [connect(h.url) for _ in range(n)]
        try:
            answers = [answer(s) for s in burst]  # every head only after all connected
            lost = sum(a != 200 for a in answers)
            assert lost == 0 if running >= n else lost > 0, (running, answers)
        finally:
            for s in burst:
                s.close()
            h.stop()


_LIMIT_SCRIPT = textwrap.dedent("""
    import resource
    from areal_fast.procutil import raise_nofile_limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(128, hard), hard))
    raise_nofile_limit()
    print(*resource.getrlimit(resource.RLIMIT_NOFILE))
""")


def test_the_soft_nofile_limit_is_raised_to_the_hard_limit():
    out = subprocess.run([sys.executable, "-c", _LIMIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    soft, hard = map(int, out.stdout.split())
    assert soft == hard


class _Raised(Exception):
    pass


def _refuse():
    raise _Raised


def test_the_engine_and_controller_entry_points_raise_the_nofile_limit_first(monkeypatch):
    from areal_fast import cli
    from areal_fast.embedded import __main__ as engine_main

    monkeypatch.setattr(cli, "raise_nofile_limit", _refuse)
    monkeypatch.setattr(engine_main, "raise_nofile_limit", _refuse)
    with pytest.raises(_Raised):
        cli.main(["info"])
    with pytest.raises(_Raised):
        engine_main.main(["--model-path", "/nonexistent"])
