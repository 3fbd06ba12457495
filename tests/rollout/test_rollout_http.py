"""The rollout client's own HTTP/1.1 path (``areal_fast.http.pool``) and event-loop choice
(``areal_fast.rollout.loop``): keep-alive reuse, a connection closed by the server while idle
(the next request goes out once, on a new connection), chunked and Connection: close answers, the
API key, timeouts, cancellation, and exact answers against the simulated servers. Scripted servers
are plain sockets in threads, so each test decides exactly what the server does and when; nothing
here is timed."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading

import pytest
from _shared import wait_until

from areal_fast.backends.sglang.client import SGLangRolloutClient
from areal_fast.http.pool import ConnectionPool, HttpError, _Connection
from areal_fast.rollout.client import RequestError, ServerUnavailable
from tools import sim_sglang as sim

ANSWER_WAIT_S = 30.0  # a scripted server's longest wait for something the test does (never reached)
NO_IDLE_LIMIT_S = 3600.0  # keep-alive for tests that count connections: a slow machine cannot expire one


# ----------------------------------------------------------------------------- a scripted server


class Scripted:
    """An HTTP server on 127.0.0.1, one thread per connection. ``answer(req)`` returns
    ``(raw response bytes, after)`` with ``after`` one of "keep" (read the next request),
    "close" (close the socket right after the answer) or "hold" (never answer; wait for
    ``release`` and close). Records every request as (connection number, method, path, headers, body)."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[tuple[int, str, str, dict, bytes]] = []
        self.connections = 0
        self.closed = threading.Event()  # set each time the server closed a connection
        self.received = threading.Event()  # set each time a request was read
        self.release = threading.Event()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._lsock.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self._lsock.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(s, self.connections), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, s: socket.socket, number: int) -> None:
        f = s.makefile("rb")
        try:
            while True:
                try:
                    line = f.readline()
                except OSError:  # the client dropped the connection (a timeout, a refused answer)
                    return
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := f.readline()) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = f.read(int(headers.get("content-length", 0)))
                self.requests.append((number, method, path, headers, body))
                self.received.set()
                raw, after = self.answer((method, path, headers, body))
                if after == "hold":
                    self.release.wait(ANSWER_WAIT_S)
                    return
                try:
                    s.sendall(raw)
                except OSError:  # the client dropped it mid-answer (an answer over its size bound)
                    return
                if after == "close":
                    return
        finally:
            f.close()
            s.close()
            self.closed.set()

    def stop(self) -> None:
        self.release.set()
        self._lsock.close()


def http_answer(status: int, body: bytes, headers: tuple[str, ...] = (), length: bool = True) -> bytes:
    head = [f"HTTP/1.1 {status} X", "Content-Type: application/json", *headers]
    if length:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(body: bytes, pieces: int = 3) -> bytes:
    step = max(1, len(body) // pieces)
    out = b""
    for i in range(0, len(body), step):
        part = body[i:i + step]
        out += b"%x;ext=1\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


def generate_json(body: bytes, version: str = "0") -> bytes:
    req = json.loads(body)
    n = req["sampling_params"]["max_new_tokens"]
    ids = [7 + i for i in range(n)]
    return json.dumps({"output_ids": ids, "meta_info": {
        "id": req["rid"], "finish_reason": {"type": "length"}, "weight_version": version,
        "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)]}}).encode()


@pytest.fixture
def scripted():
    made: list[Scripted] = []

    def make(answer):
        made.append(Scripted(answer))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def _post(pool: ConnectionPool, body: bytes = b"{}", timeout_s: float = ANSWER_WAIT_S):
    return pool.post("/generate", body, timeout_s)


# ----------------------------------------------------------------------------- the pool


def test_keep_alive_reuses_one_connection_and_sends_the_head(scripted):
    srv = scripted(lambda req: (http_answer(200, b'{"n": %d}' % len(req[3])), "keep"))

    async def run():
        pool = ConnectionPool(srv.url, api_key="k3y", keepalive_s=NO_IDLE_LIMIT_S)
        try:
            return [bytes((await _post(pool, b'{"a":' + b"1" * i + b"}")).body) for i in range(1, 4)], pool.connects
        finally:
            pool.close()

    bodies, connects = asyncio.run(run())
    assert bodies == [b'{"n": 7}', b'{"n": 8}', b'{"n": 9}']
    assert connects == 1 and srv.connections == 1 and len(srv.requests) == 3
    _, method, path, headers, body = srv.requests[0]
    assert (method, path, body) == ("POST", "/generate", b'{"a":1}')
    assert headers["authorization"] == "Bearer k3y" and headers["content-type"] == "application/json"
    assert headers["host"] == srv.url.removeprefix("http://")


def test_a_connection_closed_while_idle_is_never_written_to(scripted):
    """The server closes the connection after its first answer (as an idle timeout does, with no
    Connection: close). The test holds the event loop until the server's socket is closed, so the
    loop has not yet read the close: the peek must catch it. The second request reaches the
    server once, on a second connection."""
    srv = scripted(lambda req: (http_answer(200, b"{}"), "close" if len(srv.requests) == 1 else "keep"))

    async def run():
        pool = ConnectionPool(srv.url)
        try:
            await _post(pool)
            assert srv.closed.wait(ANSWER_WAIT_S)  # blocks the loop on purpose: no EOF callback can run
            second = await _post(pool)
            return second.status, pool.connects
        finally:
            pool.close()

    status, connects = asyncio.run(run())
    assert status == 200 and connects == 2
    assert [r[0] for r in srv.requests] == [1, 2]  # two requests, one per connection: nothing twice


def test_idle_check_rules():
    """``reusable``: an open socket with nothing to read, idle less than keep-alive; not after the
    peer's FIN, after unsolicited bytes, or past the keep-alive time."""
    pool = ConnectionPool("http://127.0.0.1:1")
    for spoil in ("fin", "bytes", "age"):
        a, b = socket.socketpair()
        a.setblocking(False)
        conn = _Connection(pool, a)
        conn.idle_since = 100.0
        assert conn.reusable(100.5, 4.0)
        if spoil == "fin":
            b.close()
        elif spoil == "bytes":
            b.send(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        assert not conn.reusable(104.5 if spoil == "age" else 100.5, 4.0), spoil
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["chunked", "close-header", "no-length"])
def test_chunked_and_connection_close_answers(scripted, kind):
    payload = b'{"ok": "' + b"x" * 3000 + b'"}'
    raw = {"chunked": http_answer(200, chunked(payload), ("Transfer-Encoding: chunked",), length=False),
           "close-header": http_answer(200, payload, ("Connection: close",)),
           "no-length": http_answer(200, payload, length=False)}[kind]
    after = "keep" if kind == "chunked" else "close"
    srv = scripted(lambda req: (raw, after))

    async def run():
        pool = ConnectionPool(srv.url, keepalive_s=NO_IDLE_LIMIT_S)
        try:
            out = [bytes((await _post(pool)).body) for _ in range(2)]
            return out, pool.connects
        finally:
            pool.close()

    bodies, connects = asyncio.run(run())
    assert bodies == [payload, payload]
    assert connects == (1 if kind == "chunked" else 2)  # a closing answer's connection is not reused
    assert len(srv.requests) == 2


@pytest.mark.parametrize("raw", [
    http_answer(200, b'{"a": [1, 2, 3]}', ("Server: t", "Date: now")),
    http_answer(200, chunked(b'{"a": [1, 2, 3]}', pieces=5), ("Transfer-Encoding: chunked",), length=False),
    b"HTTP/1.1 100 Continue\r\n\r\n" + http_answer(200, b'{"a": [1, 2, 3]}'),
])
def test_answers_parsed_one_byte_at_a_time(raw):
    """Any split of the bytes gives the same answer (the protocol keeps its place between reads)."""

    class Transport:
        def write(self, data):
            pass

        def close(self):
            pass

    async def run():
        conn = _Connection(ConnectionPool("http://127.0.0.1:1"), None)
        conn.connection_made(Transport())
        fut = asyncio.get_running_loop().create_future()
        conn.start(fut, "test", b"")
        for i in range(len(raw)):
            assert not fut.done()
            conn.data_received(raw[i:i + 1])
        return fut.result()

    resp = asyncio.run(run())
    assert resp.status == 200 and bytes(resp.body) == b'{"a": [1, 2, 3]}' and resp.content_type == "application/json"


@pytest.mark.parametrize("raw,match", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x1\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed the connection before the answer ended"),
])
def test_broken_answers_name_the_server(scripted, raw, match):
    srv = scripted(lambda req: (raw, "close"))

    async def run():
        pool = ConnectionPool(srv.url)
        try:
            await _post(pool)
        finally:
            pool.close()

    with pytest.raises(HttpError, match=match) as e:
        asyncio.run(run())
    assert srv.url + "/generate" in str(e.value)


def test_nothing_listening_is_a_connection_error_naming_the_server():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def run():
        pool = ConnectionPool(url)
        try:
            await _post(pool)
        finally:
            pool.close()

    with pytest.raises(HttpError, match="cannot connect") as e:
        asyncio.run(run())
    assert url in str(e.value) and isinstance(e.value, ConnectionError)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_timeout_and_cancel_drop_the_connection(scripted, how):
    """A request that times out or is cancelled is not retried, and its connection is not reused."""
    srv = scripted(lambda req: (http_answer(200, b"{}"), "hold" if len(srv.requests) == 1 else "keep"))

    async def run():
        pool = ConnectionPool(srv.url)
        try:
            if how == "timeout":
                with pytest.raises(TimeoutError, match="no complete answer"):
                    await _post(pool, timeout_s=0.2)
            else:
                task = asyncio.create_task(_post(pool))
                await asyncio.to_thread(srv.received.wait, ANSWER_WAIT_S)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            second = await _post(pool)
            return second.status, pool.connects
        finally:
            pool.close()

    status, connects = asyncio.run(run())
    assert status == 200 and connects == 2 and [r[0] for r in srv.requests] == [1, 2]



def test_closing_the_pool_fails_a_request_in_flight_at_once(scripted):
    """A server that never answers (hung: its connection stays open) must not hold a request until
    its deadline once the pool is closed: the request fails with HttpError now, naming the call."""
    srv = scripted(lambda req: (b"", "hold"))

    async def run():
        pool = ConnectionPool(srv.url)
        task = asyncio.create_task(_post(pool))  # its deadline: ANSWER_WAIT_S (30 s)
        await asyncio.to_thread(srv.received.wait, ANSWER_WAIT_S)
        pool.close()
        async with asyncio.timeout(5):
            with pytest.raises(HttpError, match="connection was closed") as e:
                await task
        return e.value

    err = asyncio.run(run())
    assert srv.url + "/generate" in str(err)

def test_https_and_bad_urls_are_refused_by_the_pool():
    with pytest.raises(ValueError, match="https://h:1: ConnectionPool speaks plain http"):
        ConnectionPool("https://h:1")


# ----------------------------------------------------------------------------- through RolloutClient


def _sglang(key: str | None = None, close_after_first: bool = False, srv_box: list | None = None):
    """A scripted SGLang 0.5.23: /server_info and /model_info open, /generate answers exactly
    (requires ``Authorization: Bearer key`` when ``key``)."""

    def answer(req):
        method, path, headers, body = req
        if path in ("/server_info", "/get_server_info"):
            return http_answer(200, b'{"version": "0.5.23", "tp_size": 1, "weight_version": "3"}'), "keep"
        if path == "/model_info":
            return http_answer(200, b'{"weight_version": "3"}'), "keep"
        if key and headers.get("authorization") != f"Bearer {key}":
            return http_answer(401, b'{"error": "Unauthorized"}'), "keep"
        if path == "/abort_request":
            return http_answer(200, b"{}"), "keep"
        gens = sum(r[2] == "/generate" for r in srv_box[0].requests)
        return http_answer(200, generate_json(body, "3")), "close" if close_after_first and gens == 1 else "keep"

    return answer


def test_client_native_path_exact_reused_and_once_after_an_idle_close(scripted):
    box: list = []
    srv = scripted(_sglang(close_after_first=True, srv_box=box))
    box.append(srv)

    async def run():
        async with SGLangRolloutClient([srv.url], gc_tuning=False) as c:
            assert c.http == "native" and c.servers[0].pool is not None
            c.servers[0].pool.keepalive_s = NO_IDLE_LIMIT_S
            a = await c.generate([1, 2], {"max_new_tokens": 4}, rid="a")
            assert srv.closed.wait(ANSWER_WAIT_S)  # the server closed the connection a used
            b = await c.generate([1, 2], {"max_new_tokens": 5}, rid="b")
            d = await c.generate([1, 2], {"max_new_tokens": 3}, rid="d")
            return a, b, d, c.servers[0].pool.connects, c.servers[0].down_until

    a, b, d, connects, down_until = asyncio.run(run())
    assert list(a.output_ids) == [7, 8, 9, 10] and list(a.output_logprobs) == [-0.25, -0.5, -0.75, -1.0]
    assert list(a.output_versions) == [3] * 4 and list(b.output_ids) == [7, 8, 9, 10, 11]
    assert list(d.output_ids) == [7, 8, 9]
    gens = [r for r in srv.requests if r[2] == "/generate"]
    assert [json.loads(r[4])["rid"] for r in gens] == ["a|0|", "b|0|", "d|0|"]  # each sent once
    assert connects == 2 and down_until == 0.0  # b opened a new connection, d reused it; never marked down


def test_client_native_path_401_with_a_wrong_key(scripted):
    box: list = []
    srv = scripted(_sglang(key="right", srv_box=box))
    box.append(srv)

    async def run(key):
        async with SGLangRolloutClient([srv.url], api_key=key, gc_tuning=False) as c:
            try:
                return await c.generate([1], {"max_new_tokens": 2}, rid="k")
            finally:
                assert c.servers[0].down_until == 0.0  # the caller's error: the server stays in the pool

    with pytest.raises(RequestError) as e:
        asyncio.run(run("wrong"))
    assert e.value.status == 401 and e.value.url == srv.url + "/generate"
    assert len([r for r in srv.requests if r[2] == "/generate"]) == 1  # never retried
    assert list(asyncio.run(run("right")).output_ids) == [7, 8]


def test_client_native_path_timeout_fails_over_then_gives_up(scripted):
    box: list = []
    srv = scripted(lambda req: _sglang(srv_box=box)(req) if req[1] != "/generate" else (b"", "hold"))
    box.append(srv)

    async def run():
        async with SGLangRolloutClient([srv.url], request_timeout_s=0.2, max_attempts=2, retry_backoff_s=0.0,
                                 gc_tuning=False) as c:
            await c.generate([1], {"max_new_tokens": 2}, rid="t")

    with pytest.raises(ServerUnavailable, match="TimeoutError"):
        asyncio.run(run())
    gens = [json.loads(r[4])["rid"] for r in srv.requests if r[2] == "/generate"]
    assert gens == ["t|0|", "t|0.1|"]  # one per attempt (max_attempts), each with its own rid
    aborts = [json.loads(r[4]) for r in srv.requests if r[2] == "/abort_request"]
    assert aborts == [{"rid": "t|0|", "abort_all": False}, {"rid": "t|0.1|", "abort_all": False}]


def test_a_timed_out_request_is_aborted_then_sent_again_to_the_only_server(scripted):
    """SGLang answers 400 "already running" to a rid it still runs. After a timeout the client
    aborts the request there and sends it again under a new rid: with one server the run goes on."""
    box: list = []
    running: set[str] = set()

    def answer(req):
        method, path, headers, body = req
        if path == "/generate":
            rid = json.loads(body)["rid"]
            if rid in running:
                return http_answer(400, b'{"error": "rid already running"}'), "keep"
            if not any(r[2] == "/generate" for r in srv.requests[:-1]):  # the first one never ends by itself
                running.add(rid)
                return b"", "hold"
        if path == "/abort_request":
            running.discard(json.loads(body)["rid"])
        return _sglang(srv_box=box)(req)

    srv = scripted(answer)
    box.append(srv)

    async def run():
        async with SGLangRolloutClient([srv.url], request_timeout_s=0.5, retry_backoff_s=0.0, down_cooldown_s=0.0,
                                 gc_tuning=False) as c:
            return await c.generate([1], {"max_new_tokens": 3}, rid="m")

    res = asyncio.run(run())
    assert list(res.output_ids) == [7, 8, 9] and res.num_segments == 1
    gens = [json.loads(r[4])["rid"] for r in srv.requests if r[2] == "/generate"]
    assert gens == ["m|0|", "m|0.1|"] and not running


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.replace(b'"id": "x|0|"', b'"id": "other|0|"'), "the answer is for rid 'other|0|'"),
    (lambda a: a.replace(b"-0.25", b"NaN"), "not a valid /generate result"),
    (lambda a: a.replace(b'"meta_info": {', b'"meta_info": {"id": 1, "x": {'), "not a valid /generate result"),
    (lambda a: a.replace(b'[-0.25, 7, null]', b'[-0.25, 8, null]'), "differs from output_ids"),
    (lambda a: a[:-5], "not a valid /generate result"),
])
def test_malformed_answers_are_one_client_error_naming_server_and_rid(scripted, mutate, match):
    """Malformed answers through the client: MalformedAnswer (a RolloutError), never a raw decoder exception."""
    from areal_fast.rollout.client import MalformedAnswer

    box: list = []

    def answer(req):
        if req[1] != "/generate":
            return _sglang(srv_box=box)(req)
        return http_answer(200, mutate(generate_json(req[3], "3"))), "keep"

    srv = scripted(answer)
    box.append(srv)

    async def run():
        async with SGLangRolloutClient([srv.url], gc_tuning=False) as c:
            await c.generate([1], {"max_new_tokens": 2}, rid="x")

    with pytest.raises(MalformedAnswer, match=match.replace("(", r"\(").replace("[", r"\[")) as e:
        asyncio.run(run())
    assert e.value.url == srv.url and e.value.rid == "x|0|" and srv.url in str(e.value) and "x|0|" in str(e.value)


def test_an_answer_over_its_size_bound_is_a_failed_connection(scripted):
    """The answer size bound through the client: it grows with max_new_tokens; past it the server is skipped."""
    box: list = []

    def answer(req):
        if req[1] != "/generate":
            return _sglang(srv_box=box)(req)
        ans = generate_json(req[3], "3")
        return http_answer(200, ans[:-1] + b', "pad": "' + b"p" * (2 << 20) + b'"}'), "keep"

    srv = scripted(answer)
    box.append(srv)

    async def run(max_new):
        async with SGLangRolloutClient([srv.url], max_attempts=1, gc_tuning=False) as c:
            return await c.generate([1], {"max_new_tokens": max_new}, rid="big")

    with pytest.raises(ServerUnavailable, match="over the limit"):
        asyncio.run(run(2))
    assert list(asyncio.run(run(8192)).output_ids)[:2] == [7, 8]  # 1 MiB + 512 B a token: 5 MiB


@pytest.mark.parametrize("url", ["http://user:pw@127.0.0.1:1", "http://127.0.0.1:70000"])
def test_the_client_refuses_server_urls_with_user_info_or_a_bad_port(url):
    with pytest.raises(ValueError, match="user info|port"):
        SGLangRolloutClient([url])


def test_no_request_bytes_are_held_while_the_answer_is_awaited(scripted, monkeypatch):
    """orjson's bytes keep a 16 KB allocation each: at 16k requests in flight, bodies held across the
    wait for the answer were 256 MB. Neither the pool nor the client may keep them past the write."""
    import areal_fast.rollout.calls as calls_mod  # every call's body is encoded there

    box: list = []
    srv = scripted(lambda req: _sglang(srv_box=box)(req) if req[1] != "/generate" else (b"", "hold"))
    box.append(srv)
    made: list[bytes] = []
    dumps = calls_mod.dumps

    def recording_dumps(obj):
        made.append(dumps(obj))
        return made[-1]

    monkeypatch.setattr(calls_mod, "dumps", recording_dumps)

    async def run():
        pool = ConnectionPool(srv.url)
        body = bytes(bytearray(b'{"a": 1}' * 100))  # made at run time: no constant holds it
        task = asyncio.create_task(_post(pool, body))
        await asyncio.to_thread(srv.received.wait, ANSWER_WAIT_S)
        pool_refs = sys.getrefcount(body)  # this frame's name and the call's argument
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pool.close()
        srv.received.clear()
        async with SGLangRolloutClient([srv.url], gc_tuning=False) as c:
            made.clear()
            gen = asyncio.create_task(c.generate([1, 2, 3], {"max_new_tokens": 8}, rid="held"))
            await asyncio.to_thread(srv.received.wait, ANSWER_WAIT_S)
            await wait_until(lambda: any(b'"rid":"held|0|"' in b for b in made), "the held request's body")
            mine = next(b for b in made if b'"rid":"held|0|"' in b)
            client_refs = sys.getrefcount(mine)  # the list, the name, the argument
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
        return pool_refs, client_refs

    pool_refs, client_refs = asyncio.run(run())
    assert pool_refs == 2 and client_refs == 3, (pool_refs, client_refs)


@pytest.mark.parametrize("http", ["native", "aiohttp"])
def test_simulated_servers_exact_on_both_transports(http):
    """The same requests with our HTTP client and with aiohttp: every answer exact against the
    simulator's deterministic tokens and versions, across a pause and an update."""

    async def run():
        cfg = sim.SimConfig(decode_a_s=0.002, decode_b_s=0.0, len_median=150, len_sigma=0.6, len_max=600,
                            prefill_tokens_per_s=1e6, max_running=64, vocab_size=5000, seed=9,
                            sglang_version="0.5.23", api_key="k")
        async with sim.SimCluster(3, cfg) as cl:
            async with SGLangRolloutClient(cl.urls, api_key="k", http=http, gc_tuning=False) as c:
                rids = [f"e{i}" for i in range(48)]
                tasks = [asyncio.create_task(c.generate([4] * 5, {"max_new_tokens": 600}, rid=r)) for r in rids]
                await wait_until(lambda: all(s.ticks() >= 5 for s in cl.servers), "every server decoding")
                await c.pause_all()
                await c.continue_all()
                first = await asyncio.gather(*tasks)
                if http == "native":
                    for s in c.servers:
                        s.pool.keepalive_s = NO_IDLE_LIMIT_S
                before = [s.pool.connects for s in c.servers] if http == "native" else None
                again = [await c.generate([4] * 5, {"max_new_tokens": 600}, rid=f"s{i}") for i in range(6)]
                connects = [s.pool.connects - b for s, b in zip(c.servers, before)] if http == "native" else None
        return cfg, cl, first + again, connects

    cfg, cl, results, connects = asyncio.run(run())
    errs = [e for r in results for e in sim.check_sample(r.rid, 5, 600, r.output_ids, r.output_logprobs,
                                                         r.output_versions, r.finish_reason, cfg, 0)]
    assert errs == [] and cl.duplicates == 0 and len(results) == 54
    if http == "native":  # the 6 sequential requests reused kept-alive connections
        assert connects == [0, 0, 0]


def test_bad_http_setting_names_itself(monkeypatch):
    monkeypatch.setenv("AREAL_FAST_ROLLOUT_HTTP", "curl")
    with pytest.raises(ValueError, match="AREAL_FAST_ROLLOUT_HTTP.*'curl'"):
        SGLangRolloutClient(["http://127.0.0.1:1"])
