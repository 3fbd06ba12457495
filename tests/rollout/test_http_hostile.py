"""The rollout client's HTTP/1.1 parser (``areal_fast.http.pool``) against hostile answers.

A hang is tested with a watchdog: a subprocess with a deadline for a real request (the old parser
spun inside ``data_received``, so no asyncio timeout could fire), and a CPU-time alarm for the
parser fed in process (the fuzzer). Every hostile answer must end as an answer or as the client's
own ``HttpError``, never a hang, another exception type, or an asyncio "Fatal error" log."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from areal_fast.http import pool as http
from areal_fast.http.pool import ConnectionPool, HttpError, _Connection

WHERE = "http://s:1/generate"
WATCHDOG_S = 60  # a subprocess that has not finished by then hung (it takes ~1 s)


class _Sink:
    """The transport a connection writes to and closes; nothing is sent anywhere."""

    def write(self, data):
        pass

    def close(self):
        pass

    def abort(self):
        pass


def feed(pieces, *, eof: bool = True, max_body: int | None = None, buf_type=bytearray):
    """Feed ``pieces`` to one connection's parser; the Response, or the exception it failed with,
    or None when it is still waiting (only with ``eof=False``)."""
    loop = asyncio.new_event_loop()
    try:
        conn = _Connection(ConnectionPool("http://127.0.0.1:1"), None)
        conn.connection_made(_Sink())
        fut = loop.create_future()
        conn.start(fut, WHERE, b"", *(() if max_body is None else (max_body,)))
        conn._buf = buf_type()
        for p in pieces:
            if fut.done():
                break
            conn.data_received(p)
        if not fut.done() and eof:
            conn.eof_received()
            conn.connection_lost(None)
        if not fut.done():
            assert not eof, "the connection ended but the request neither got an answer nor failed"
            return None
        return fut.exception() or fut.result()
    finally:
        loop.close()


def head(status: str = "200 OK", *headers: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", "Content-Type: application/json", *headers]) + "\r\n\r\n").encode()


# ----------------------------------------------------------------------------- hostile answers: no hang


_REQUEST_WITH_DEADLINE = textwrap.dedent('''
    import asyncio, socket, sys, threading
    from areal_fast.http.pool import ConnectionPool
    raw = sys.stdin.buffer.read()
    lsock = socket.create_server(("127.0.0.1", 0))
    def serve():
        s, _ = lsock.accept()
        s.recv(65536)
        s.sendall(raw)
        threading.Event().wait(60)
    threading.Thread(target=serve, daemon=True).start()
    async def main():
        pool = ConnectionPool("http://127.0.0.1:%d" % lsock.getsockname()[1])
        try:
            r = await pool.post("/generate", b"{}", 2.0)
            return "answer %d %r" % (r.status, bytes(r.body))
        except Exception as e:
            return "%s: %s" % (type(e).__name__, e)
    print(asyncio.run(main()))
''')


def request_with_deadline(raw: bytes) -> str:
    """What a real request (2 s timeout) to a server answering ``raw`` ends with, in a subprocess
    that is killed if it has not finished within WATCHDOG_S (a hang fails the test, not the suite)."""
    try:
        out = subprocess.run([sys.executable, "-c", _REQUEST_WITH_DEADLINE], input=raw, capture_output=True,
                             timeout=WATCHDOG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the request never ended (not even its 2 s timeout fired) for the answer {raw[:80]!r}")
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return out.stdout.decode().strip()


@pytest.mark.parametrize("raw,match", [
    (head("200 OK", "Transfer-Encoding: chunked") + b"-6\r\n", "bad chunk size b'-6'"),  # the position went back
    (head("200 OK", "Transfer-Encoding: chunked") + b"-2\r\n\r\n", "bad chunk size b'-2'"),  # was an empty body
    (b"HTTP/1.1 000 OK\r\nContent-Length: 2\r\n\r\n{}", "not an HTTP/1.x status line"),  # status 0 looped
])
def test_hostile_answers_end_the_request_instead_of_hanging(raw, match):
    got = request_with_deadline(raw)
    assert got.startswith("HttpError") and match in got and "/generate" in got, got


@pytest.mark.parametrize("status", ["000", "099", "600", "999", "20", "2000", "+20", "２００"])
def test_status_must_be_three_digits_in_100_to_599(status):
    got = feed([f"HTTP/1.1 {status} X\r\nContent-Length: 2\r\n\r\n{{}}".encode()], eof=False)
    assert isinstance(got, HttpError) and "not an HTTP/1.x status line" in str(got), got


@pytest.mark.parametrize("size", [b"-6", b"-2", b"+5", b"0x2", b"1_0", b" 2", b"2 2", b"", b"g",
                                  b"1" * 17, "\u0662".encode()])
def test_chunk_sizes_are_hex_digits_only(size):
    got = feed([head("200 OK", "Transfer-Encoding: chunked") + size + b"\r\nab\r\n0\r\n\r\n"], eof=False)
    assert isinstance(got, HttpError) and "bad chunk size" in str(got) and WHERE in str(got), got


def test_a_well_formed_chunked_answer_with_extensions_and_trailers_still_parses():
    got = feed([head("200 OK", "Transfer-Encoding: chunked") + b"2 ;a=b\r\nab\r\nA\r\n0123456789\r\n"
                b"000\r\nX-T: 1\r\nY-T: 2\r\n\r\n"], eof=False)
    assert got.status == 200 and bytes(got.body) == b"ab0123456789"


# ----------------------------------------------------------------------------- leniencies


@pytest.mark.parametrize("te", ["notchunked", "chunked, gzip", "gzip", "chunkedx",
                                "chunked\r\nTransfer-Encoding: chunked"])
def test_transfer_encoding_must_be_exactly_chunked(te):
    got = feed([head("200 OK", f"Transfer-Encoding: {te}") + b"2\r\nab\r\n0\r\n\r\n"], eof=False)
    assert isinstance(got, HttpError) and "unsupported Transfer-Encoding" in str(got), got


def test_content_length_with_transfer_encoding_is_refused():
    got = feed([head("200 OK", "Transfer-Encoding: chunked", "Content-Length: 2") + b"2\r\nab\r\n0\r\n\r\n"],
               eof=False)
    assert isinstance(got, HttpError) and "both Content-Length and Transfer-Encoding" in str(got)


def test_a_head_over_the_limit_is_refused_even_in_one_read():
    raw = head("200 OK", "X: " + "a" * http.MAX_HEAD_BYTES, "Content-Length: 2") + b"{}"
    got = feed([raw], eof=False)
    assert isinstance(got, HttpError) and "HTTP head of" in str(got), got


def test_a_5000_digit_status_is_the_clients_error_not_an_event_loop_traceback(caplog):
    caplog.set_level(logging.DEBUG, logger="asyncio")
    got = request_with_deadline(b"HTTP/1.1 " + b"2" * 5000 + b" OK\r\nContent-Length: 2\r\n\r\n{}")
    assert got.startswith("HttpError") and "not an HTTP/1.x status line" in got, got
    got = feed([b"HTTP/1.1 " + b"2" * 5000 + b" OK\r\nContent-Length: 2\r\n\r\n{}"], eof=False)
    assert isinstance(got, HttpError)


def test_no_fatal_error_log_for_any_parser_exception(caplog, monkeypatch):
    """Whatever goes wrong inside data_received fails the request with HttpError, not the loop."""
    def broken(self, head):
        raise ValueError("boom")

    monkeypatch.setattr(_Connection, "_read_head", broken)
    got = feed([head()], eof=False)
    assert isinstance(got, HttpError) and "boom" in str(got)


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\n{}",
    b"HTTP/1.1 200 OK\rContent-Length: 2\r\n\r\n{}",
])
def test_bare_lf_answers_are_an_error_at_once_not_a_wait_for_the_timeout(raw):
    got = feed([raw], eof=False)  # the server keeps the connection open: no EOF to end the wait
    assert isinstance(got, HttpError) and "bare" in str(got), got


# ----------------------------------------------------------------------------- size limits


def test_content_length_over_the_limit_is_refused_at_the_head():
    got = feed([head("200 OK", "Content-Length: 1001")], eof=False, max_body=1000)
    assert isinstance(got, HttpError) and "over the limit of 1000" in str(got), got
    got = feed([head("200 OK", "Content-Length: 1000") + b"x" * 1000], eof=False, max_body=1000)
    assert got.status == 200 and len(got.body) == 1000


def test_chunked_and_close_delimited_answers_over_the_limit_are_refused():
    chunks = [head("200 OK", "Transfer-Encoding: chunked")] + [b"64\r\n" + b"x" * 100 + b"\r\n"] * 11
    got = feed(chunks, eof=False, max_body=1000)
    assert isinstance(got, HttpError) and "over 1000 bytes" in str(got), got
    got = feed([head("200 OK", "Connection: close")] + [b"y" * 100] * 11, eof=False, max_body=1000)
    assert isinstance(got, HttpError) and "over 1000 bytes" in str(got), got
    got = feed([head("200 OK", "Connection: close")] + [b"y" * 100] * 10, max_body=1000)  # at the limit: fine
    assert got.status == 200 and len(got.body) == 1000


def test_the_pool_default_limit_applies_to_every_answer():
    got = feed([head("200 OK", f"Content-Length: {http.DEFAULT_MAX_BODY_BYTES + 1}")], eof=False)
    assert isinstance(got, HttpError) and "over the limit" in str(got)


class _CountingBuffer(bytearray):
    """A bytearray that counts the bytes its searches look at."""
    scanned = 0

    def find(self, sub, start=0, *rest):
        _CountingBuffer.scanned += max(0, len(self) - max(0, start))
        return bytearray.find(self, sub, start, *rest)


@pytest.mark.parametrize("what", ["size line", "trailer", "head"])
def test_unterminated_lines_are_searched_once_not_on_every_read(what):
    """A size line, trailer or head sent one byte a read is searched in linear, not quadratic, work."""
    n = 3000
    if what == "size line":
        start, drip = head("200 OK", "Transfer-Encoding: chunked") + b"1;", b"e" * n
    elif what == "trailer":
        start, drip = head("200 OK", "Transfer-Encoding: chunked") + b"0\r\nX: ", b"t" * n
    else:
        start, drip = b"HTTP/1.1 200 OK\r\nX: ", b"h" * n
    _CountingBuffer.scanned = 0
    got = feed([start] + [drip[i:i + 1] for i in range(n)], eof=False, buf_type=_CountingBuffer)
    assert got is None  # still waiting, within every limit
    assert _CountingBuffer.scanned < 20 * (len(start) + n), _CountingBuffer.scanned


def test_over_long_chunk_size_lines_and_trailers_are_refused():
    got = feed([head("200 OK", "Transfer-Encoding: chunked") + b"1;" + b"e" * http.MAX_CHUNK_LINE_BYTES], eof=False)
    assert isinstance(got, HttpError) and "chunk-size line over" in str(got), got
    got = feed([head("200 OK", "Transfer-Encoding: chunked") + b"0\r\nX: " + b"t" * http.MAX_TRAILER_BYTES],
               eof=False)
    assert isinstance(got, HttpError) and "trailers over" in str(got), got


@pytest.mark.parametrize("n", [1, http.MAX_INTERIM_ANSWERS + 1])
def test_interim_answers_are_bounded(n):
    got = feed([b"HTTP/1.1 100 Continue\r\n\r\n" * n + head("200 OK", "Content-Length: 2") + b"{}"], eof=False)
    if n == 1:
        assert got.status == 200
    else:
        assert isinstance(got, HttpError) and "interim" in str(got)


# ----------------------------------------------------------------------------- user info in a server address


@pytest.mark.parametrize("url", ["http://user:secret@127.0.0.1:1", "http://user@127.0.0.1:1",
                                 "http://127.0.0.1:99999", "http://127.0.0.1:1/?q=1", "http://a b:1"])
def test_server_urls_with_user_info_or_nonsense_are_refused(url):
    with pytest.raises(ValueError) as e:
        ConnectionPool(url)
    assert "secret" not in str(e.value)


def test_the_host_header_never_carries_user_info():
    pool = ConnectionPool("http://127.0.0.1:8/p")
    assert pool._head("POST", "/generate").startswith(b"POST /p/generate HTTP/1.1\r\nHost: 127.0.0.1:8\r\n")


# ----------------------------------------------------------------------------- the fuzzer


class _Hung(BaseException):
    """Raised by the CPU-time alarm: a BaseException, so the parser's own handlers cannot take it."""


_TOKENS = [b"-6", b"-2", b"-0", b"000", b"0x2", b"1_0", b"+5", b" 5", b"ffffffffffffffffff", b"0" * 40,
           b"099", b"600", b"2" * 50, b"\n", b"\r", b"\r\n", b"\r\n\r\n", b";", b":", b" ", b"chunked", b"0\r\n\r\n"]
_BYTES = b"-+0123456789abcdefxX_ \r\n;:"


def _valid_answers(rng: random.Random) -> list[tuple[bytes, bytes]]:
    body = bytes(rng.choice(b'{}[]":,0123456789abc') for _ in range(rng.randrange(0, 60)))
    chunked = b""
    i = 0
    while i < len(body):
        n = rng.randrange(1, 20)
        ext = rng.choice([b"", b";x=1", b" ;y"])
        chunked += b"%x%s\r\n%s\r\n" % (len(body[i:i + n]), ext, body[i:i + n])
        i += n
    chunked += b"0\r\n" + rng.choice([b"", b"T: 1\r\n"]) + b"\r\n"
    interim = rng.choice([b"", b"HTTP/1.1 100 Continue\r\n\r\n"])
    return [
        (interim + head("200 OK", f"Content-Length: {len(body)}") + body, body),
        (interim + head(f"{rng.choice(['200', '201', '404', '503'])} X", "Transfer-Encoding: chunked") + chunked, body),
        (interim + head("200 OK", "Connection: close") + body, body),
        (b"HTTP/1.0 200 OK\r\n\r\n" + body, body),
    ]


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        at = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(at, len(b) - 1)] = rng.choice(_BYTES)
        elif op == 1:
            b[at:at] = rng.choice(_TOKENS)
        elif op == 2:
            del b[at:at + rng.randrange(1, 6)]
        elif op == 3:  # replace a status code or a chunk size: where the two hangs were
            starts = [i + 1 for i in range(len(b) - 1) if b[i:i + 1] == b"\n" or b[i:i + 9] == b"HTTP/1.1 "]
            if starts:
                i = rng.choice(starts)
                i = i + 8 if b[i - 1:i + 8] == b"HTTP/1.1 " else i
                j = i
                while j < len(b) and b[j:j + 1] not in (b"\r", b" ", b";"):
                    j += 1
                b[i:j] = rng.choice(_TOKENS)
        else:
            b = b[:at]
    return bytes(b)


def _split(rng: random.Random, raw: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(len(raw) + 1), min(len(raw) + 1, rng.randrange(0, 6))))
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]


def run_fuzzer(seed: int, cases: int, per_case_cpu_s: float = 2.0) -> int:
    """Mutated chunked / Content-Length / close-delimited answers, split at random points and fed
    to the parser; each must end (within ``per_case_cpu_s`` of CPU time, a far larger budget than
    it needs) as an answer or an HttpError. Unmutated answers must give their body. Returns the
    number of cases run."""
    rng = random.Random(seed)

    def alarm(signum, frame):
        raise _Hung()

    old = signal.signal(signal.SIGVTALRM, alarm)
    try:
        for case in range(cases):
            raw, body = rng.choice(_valid_answers(rng))
            mutated = _mutate(rng, raw) if rng.random() < 0.9 else raw
            pieces = _split(rng, mutated)
            signal.setitimer(signal.ITIMER_VIRTUAL, per_case_cpu_s)
            try:
                got = feed(pieces)
            except _Hung:
                pytest.fail(f"seed {seed} case {case}: the parser did not finish on {mutated!r}")
            finally:
                signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            assert isinstance(got, (http.Response, HttpError)), f"seed {seed} case {case}: {mutated!r} -> {got!r}"
            if mutated == raw:
                assert isinstance(got, http.Response) and bytes(got.body) == body, (raw, got)
            if isinstance(got, http.Response):
                assert 100 <= got.status <= 599
    finally:
        signal.signal(signal.SIGVTALRM, old)
    return cases


def test_fuzzer_quick():
    assert run_fuzzer(seed=32, cases=3000) == 3000


@pytest.mark.slow
def test_fuzzer_long():
    # 120,000 cases in the suite (~15 s); AREAL_FAST_FUZZ_SEEDS=N runs N x 30,000 for a longer soak
    for seed in range(int(os.environ.get("AREAL_FAST_FUZZ_SEEDS", "4"))):
        run_fuzzer(seed=1000 + seed, cases=30_000)
