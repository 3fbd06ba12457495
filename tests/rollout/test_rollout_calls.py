"""The one module for calls to servers (``areal_fast.rollout.calls``): each rule of the retry
policy, the deadline against a hung server (watchdog threads, never a long wait), the one health
check (a 503 while paused is alive, a closed port is down, a hung server is alive but unhealthy),
the dead-server retry and the one server URL check."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from _shared import in_watched_thread

from areal_fast.netutil import check_server_url
from areal_fast.rollout.calls import (
    CONTROL_RETRY,
    DEAD_SERVER_RETRY,
    BlockingCalls,
    RequestError,
    RetryPolicy,
    ServerCalls,
    ServerError,
    health_now,
    is_caller_error,
    retry_dropping_dead,
)

WATCHDOG_S = 30.0  # a call that should end within a second or two; far longer means it hangs


class Scripted:
    """A raw HTTP/1.1 server: ``script(method, path, n)`` (n: requests so far on that path) returns
    ``(status, body)``, ``"hang"`` (read the request, never answer) or ``"close"`` (close without
    an answer). ``seen`` lists (method, path) of every request read."""

    def __init__(self, script):
        self.script, self.seen = script, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    conn.close()
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = dict(x.lower().split(": ", 1) for x in lines[1:])
            length = int(headers.get("content-length", 0))
            while len(buf) < length:
                buf += conn.recv(65536)
            buf = buf[length:]
            n = sum(p == path for _, p in self.seen)
            self.seen.append((method, path))
            what = self.script(method, path, n)
            if what == "hang":
                self._held.append(conn)
                return
            if what == "close":
                conn.close()
                return
            status, body = what
            conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (status, len(body), body))

    def count(self, path):
        return sum(p == path for _, p in self.seen)

    def close(self):
        self._stop.set()
        self.sock.close()
        for c in self._held:
            c.close()


@pytest.fixture
def serve():
    servers = []

    def make(script):
        servers.append(Scripted(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _watched(coro_fn, limit_s: float = WATCHDOG_S):
    """Run ``asyncio.run(coro_fn())`` in a thread; fail (not hang) when it outlives ``limit_s``."""
    box = in_watched_thread(lambda: asyncio.run(coro_fn()), limit_s)
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _call(url, path, policy, method="POST", **kw):
    async with ServerCalls(**kw) as calls:
        return await calls.call(url, method, path, {}, policy=policy)


# ------------------------------------------------------------------------------ the policy's rules
def test_the_default_policy_sends_once(serve):
    srv = serve(lambda m, p, n: (503, b'{"error": "busy"}'))
    with pytest.raises(ServerError, match=rf"{srv.url}/x answered 503"):
        _watched(lambda: _call(srv.url, "/x", RetryPolicy()))
    assert srv.count("/x") == 1


def test_a_retried_status_is_sent_again_until_it_passes(serve):
    srv = serve(lambda m, p, n: (400, b'{"m": "kv held"}') if n < 2 else (200, b'{"ok": 1}'))
    policy = RetryPolicy(attempts=None, deadline_s=20, backoff_s=0.01, backoff_max_s=0.01, retry_statuses={400})
    assert _watched(lambda: _call(srv.url, "/flush_cache", policy)) == {"ok": 1}
    assert srv.count("/flush_cache") == 3


def test_a_retried_status_stops_at_the_attempts(serve):
    srv = serve(lambda m, p, n: (400, b'{"m": "kv held"}'))
    policy = RetryPolicy(attempts=3, retry_statuses={400})
    with pytest.raises(RequestError, match=r"answered 400.*after 3 attempts") as e:
        _watched(lambda: _call(srv.url, "/flush_cache", policy))
    assert e.value.status == 400 and srv.count("/flush_cache") == 3


def test_other_statuses_are_never_retried(serve):
    srv = serve(lambda m, p, n: (401, b'{"error": "Unauthorized"}'))
    policy = RetryPolicy(attempts=5, retry_statuses={400}, retry_broken=True)
    with pytest.raises(RequestError, match="401"):
        _watched(lambda: _call(srv.url, "/pause_generation", policy))
    assert srv.count("/pause_generation") == 1


def test_a_broken_connection_is_retried_by_the_control_policy_only(serve):
    srv = serve(lambda m, p, n: "close" if n == 0 else (200, b"{}"))
    assert _watched(lambda: _call(srv.url, "/continue_generation", CONTROL_RETRY)) == {}
    assert srv.count("/continue_generation") == 2
    again = serve(lambda m, p, n: "close" if n == 0 else (200, b"{}"))
    with pytest.raises(ConnectionError):
        _watched(lambda: _call(again.url, "/continue_generation", RetryPolicy()))
    assert again.count("/continue_generation") == 1


def test_a_timeout_is_never_retried(serve):
    """The server may still run a request that timed out: it is not sent twice, whatever the policy."""
    srv = serve(lambda m, p, n: "hang")
    policy = RetryPolicy(timeout_s=0.3, attempts=3, retry_broken=True, retry_statuses={400, 503})
    with pytest.raises(TimeoutError):
        _watched(lambda: _call(srv.url, "/pause_generation", policy))
    assert srv.count("/pause_generation") == 1


def test_a_hung_server_hits_the_deadline(serve):
    """A deadline bounds every attempt: a server that reads the request and never answers ends
    the call at the deadline, not after the attempt's own (long) timeout."""
    srv = serve(lambda m, p, n: "hang")
    policy = RetryPolicy(timeout_s=600, attempts=None, deadline_s=0.5, retry_statuses={400})
    with pytest.raises(TimeoutError):
        _watched(lambda: _call(srv.url, "/flush_cache", policy))
    with BlockingCalls() as calls, pytest.raises(TimeoutError):  # the blocking wrapper too
        _watched(lambda: asyncio.to_thread(calls.call, srv.url, "POST", "/x", policy=policy))


def test_the_client_flush_ends_at_its_deadline_on_a_hung_server(serve):
    """flush_cache_all(timeout_s) used to check its deadline only between answers: a hung server
    held it for the control timeout (600 s)."""
    from areal_fast.backends.sglang.client import SGLangRolloutClient

    info = b'{"version": "0.5.23", "tp_size": 1, "weight_version": "0"}'
    srv = serve(lambda m, p, n: "hang" if p == "/flush_cache" else (200, info))

    async def run():
        async with SGLangRolloutClient([srv.url], gc_tuning=False) as c:
            await c.flush_cache_all(timeout_s=0.5)

    with pytest.raises(TimeoutError):
        _watched(run)


def test_backoff_attempts_and_deadline_arithmetic():
    p = RetryPolicy(attempts=4, backoff_s=0.2, backoff_max_s=0.5)
    assert [p.wait_s(k) for k in range(4)] == [0.2, 0.4, 0.5, 0.5]  # linear, capped
    assert p.another(2, None, 0.0) and not p.another(3, None, 0.0)
    q = RetryPolicy(attempts=None, deadline_s=1.0, backoff_s=0.3, backoff_max_s=0.3)
    assert q.another(100, deadline=10.0, now=9.6) and not q.another(0, deadline=10.0, now=9.8)
    for bad in (dict(attempts=0), dict(attempts=None), dict(timeout_s=0), dict(backoff_s=-1), dict(deadline_s=0)):
        with pytest.raises(ValueError, match="RetryPolicy"):
            RetryPolicy(**bad)
    d = DEAD_SERVER_RETRY  # the three copies' rule: 3 attempts, a death may take 3 s to show, polled every 0.1 s
    assert d.attempts == 3 and d.deadline_s == 3.0 and d.wait_s(5) == 0.1


def test_a_500_blames_the_request_only_where_the_adapter_says_so():
    typeerror = "TypeError: __init__() got an unexpected keyword argument 'foo'"
    assert is_caller_error(500, typeerror) and is_caller_error(500, typeerror, caller_500=True)
    # e.g. SGLang from 0.5.22 (its adapter says so: tests/rollout/test_sglang_compat.py)
    assert not is_caller_error(500, typeerror, caller_500=False)
    assert not is_caller_error(500, "out of memory") and is_caller_error(404, "") and not is_caller_error(503, "")


# ------------------------------------------------------------------------------------ the health check
def _paused_sglang(method, path, n):
    """SGLang during a long pause: /model_info answers, /health's probe gives 503."""
    return (503, b"") if path == "/health" else (200, b'{"weight_version": "3"}')


def test_503_while_paused_is_alive_and_the_pauser_does_not_probe(serve):
    srv = serve(_paused_sglang)

    async def run():
        async with ServerCalls() as calls:
            return await calls.health(srv.url), await calls.health(srv.url, paused=True)

    probed, paused = _watched(run)
    assert probed.state == "unhealthy" and probed.alive and "503" in probed.detail
    assert paused.state == "paused" and paused.alive
    assert srv.count("/health") == 1  # the paused ask did not probe


def test_a_closed_port_is_down_and_a_hung_server_is_alive_but_unhealthy(serve):
    from areal_fast.netutil import find_free_port

    gone = health_now(f"http://127.0.0.1:{find_free_port('127.0.0.1')}")
    assert gone.state == "down" and not gone.alive
    hung = serve(lambda m, p, n: "hang")
    h = _watched(lambda: asyncio.to_thread(health_now, hung.url, timeout_s=0.3))
    assert h.state == "unhealthy" and h.alive  # connected and busy: a watchdog does not drop it


def test_the_probe_alone_and_liveness_alone(serve):
    srv = serve(lambda m, p, n: (200, b"{}"))
    assert health_now(srv.url, liveness=False).state == "ok"  # the start-up wait: /health 200
    assert health_now(srv.url, probe=False).state == "up"  # a watchdog: /model_info answered
    assert srv.seen == [("GET", "/health"), ("GET", "/model_info")]


def test_a_refused_key_is_alive_but_unhealthy(serve):
    srv = serve(lambda m, p, n: (401, b'{"error": "Unauthorized"}') if p == "/model_info" else (200, b""))
    h = health_now(srv.url, api_key="wrong")
    assert h.state == "unhealthy" and h.alive and h.key_refused


# ----------------------------------------------------------------------------- the dead-server retry
class _Pool:
    def __init__(self, urls, dead=()):
        self.urls, self.dead, self.asked = list(urls), set(dead), 0

    def is_dead(self, url):
        self.asked += 1
        return url in self.dead

    def remove(self, url):
        self.urls.remove(url)


def _fails_while(pool, bad):
    calls = []

    async def fn():
        calls.append(list(pool.urls))
        if bad & set(pool.urls):
            raise ConnectionError("reset")
        return "done"

    return fn, calls


def test_a_failure_with_a_dead_server_is_retried_without_it():
    pool = _Pool(["a", "b"], dead={"b"})
    fn, calls = _fails_while(pool, {"b"})
    fast = RetryPolicy(attempts=3, deadline_s=0.2, backoff_s=0.01, backoff_max_s=0.01)
    assert _watched(lambda: retry_dropping_dead(fn, lambda: pool.urls, pool.is_dead, pool.remove, "x", fast)) == "done"
    assert calls == [["a", "b"], ["a"]]


def test_a_failure_with_every_server_alive_is_raised_after_the_death_wait():
    pool = _Pool(["a", "b"])
    fn, calls = _fails_while(pool, {"a"})
    fast = RetryPolicy(attempts=3, deadline_s=0.2, backoff_s=0.05, backoff_max_s=0.05)
    with pytest.raises(ConnectionError, match="reset"):
        _watched(lambda: retry_dropping_dead(fn, lambda: pool.urls, pool.is_dead, pool.remove, "x", fast))
    assert len(calls) == 1 and pool.urls == ["a", "b"] and pool.asked > 2  # asked again until the deadline


def test_the_last_attempt_is_raised_even_with_a_dead_server():
    pool = _Pool(["a", "b", "c"], dead={"b", "c"})
    fn, calls = _fails_while(pool, {"a"})
    fast = RetryPolicy(attempts=2, deadline_s=0.2, backoff_s=0.01, backoff_max_s=0.01)
    with pytest.raises(ConnectionError):
        _watched(lambda: retry_dropping_dead(fn, lambda: pool.urls, pool.is_dead, pool.remove, "x", fast))
    assert calls == [["a", "b", "c"], ["a"]]


# ---------------------------------------------------------------------------------- the URL check
@pytest.mark.parametrize("url, words", [
    ("http://user:secret@127.0.0.1:1", ["servers[2]", "user:password@"]),
    ("http://127.0.0.1:0", ["servers[2]", "1..65535"]),
    ("ftp://127.0.0.1:1", ["servers[2]", "http(s)://"]),
    ("http://127.0.0.1:1/?q=1", ["servers[2]", "query"]),
    (17, ["servers[2]"]),
])
def test_one_server_url_check(url, words):
    with pytest.raises(ValueError) as e:
        check_server_url(url, "servers[2]")
    assert all(w in str(e.value) for w in words) and "secret" not in str(e.value)
    assert check_server_url("https://h:8/p").hostname == "h"


def _health_in_child(url, q):
    q.put(health_now(url, liveness=False).state)


def test_a_forked_child_checks_health_after_its_parent_did(serve):
    """The shared blocking calls run on a thread, and a forked child has none of its parent's
    threads: a child that checks a server after its parent did must get calls of its own, not wait
    forever on the parent's dead loop (a forked training run hung at its end this way)."""
    import multiprocessing

    srv = serve(lambda m, p, n: (200, b"{}"))
    assert health_now(srv.url, liveness=False).state == "ok"  # the parent's shared calls exist now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_health_in_child, args=(srv.url, q), daemon=True)
    child.start()
    child.join(WATCHDOG_S)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, f"the forked child's health check still waits after {WATCHDOG_S}s"
    assert child.exitcode == 0 and q.get(timeout=5) == "ok"
