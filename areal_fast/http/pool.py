"""A small HTTP/1.1 client for the rollout hot path: ``POST /generate`` on kept-alive connections.

At 16k requests in flight the controller receives thousands of answers a second, and aiohttp's
per-request machinery (URL objects, header multidicts, its response parser and stream reader,
timers and context managers) cost more CPU than decoding the answers (aiohttp and yarl: 24% of the
controller's CPU in a cProfile at 64 servers, orjson and the answer parser 8%). A request here is
one pre-encoded head (request line, Host, Content-Type, Authorization when there is a key), the
Content-Length and the JSON body, written in one ``transport.write``; the answer is parsed by an
``asyncio.Protocol`` (status line, the four headers that matter, then a Content-Length body, a
chunked body, or a body up to the connection's end) and handed on as bytes. The rollout client
sends its other calls to an ``http://`` server (pause, continue, abort, info: a few per step) through
the same pool; ``https://`` servers and ``http='aiohttp'`` use aiohttp.

One :class:`ConnectionPool` per server keeps idle connections for reuse, newest first.

**No request is ever sent twice by this module.** A request goes out once; any failure after its
first byte is written (reset, end of stream before the full answer, timeout) is raised to the
caller, which decides what to do (the rollout client fails over to another server, as for a server
that died). The pool never retries. What makes writing into a connection that its server closed
while idle unlikely is the rule for taking an idle connection, checked just before writing:
- the connection has not ended (the protocol's end-of-stream callback drops it at once);
- it has been idle less than ``keepalive_s`` (4 s; SGLang's HTTP server, uvicorn, closes a
  connection idle for 5 s, and our clock starts later than the server's);
- a non-blocking ``MSG_PEEK`` on its socket finds nothing to read: a server's FIN (or any
  unsolicited bytes, or a reset) that reached this host but not yet the event loop's callbacks
  shows here (the loop may run many callbacks before it reads a closed socket).
Only a close that is still on the wire while the request is written can get past these checks;
that request fails (it is not retried here) like one sent to a server that died.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable

from areal_fast.netutil import check_server_url  # the one check of a server address

KEEPALIVE_S = 4.0  # below SGLang's (uvicorn's) 5 s keep-alive timeout
MAX_HEAD_BYTES = 64 * 1024  # a status line and headers longer than this are not an HTTP answer
MAX_CHUNK_LINE_BYTES = 4096  # a chunk-size line with its extensions (ours are "%x\r\n")
MAX_TRAILER_BYTES = 64 * 1024  # the trailer fields after the last chunk
MAX_INTERIM_ANSWERS = 16  # 1xx answers before the real one (one 100 Continue in practice)
# A body larger than this is refused (the pool's default; /generate passes a bound from its
# max_new_tokens: areal_fast.rollout.client). Control answers (/server_info...) are a few KB.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
_PEEK_FLAGS = socket.MSG_PEEK | socket.MSG_DONTWAIT
# RFC 9112: chunk-size = 1*HEXDIG (no sign, no "0x", no "_": Python's int(x, 16) takes all three);
# 16 digits hold any size a 64-bit length can; the answer's size limit refuses far less.
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_STATUS_LINE = re.compile(rb"HTTP/1\.[0-9] ([0-9]{3})(?: [^\r\n]*)?")
_MAX_LENGTH_DIGITS = 19  # a Content-Length of up to 10**19 - 1 bytes (int() of more is refused anyway)


class HttpError(ConnectionError):
    """The connection failed or the answer was not HTTP/1.x; the message names the server and path."""


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout: nothing was sent (``rollout.calls`` tells it from
    a request that timed out after it went out)."""


class Response:
    """A complete answer: ``status``, ``content_type`` and ``body`` (bytes or a memoryview of them)."""

    __slots__ = ("status", "content_type", "body")

    def __init__(self, status: int, content_type: str, body):
        self.status, self.content_type, self.body = status, content_type, body


class _Connection(asyncio.Protocol):
    """One TCP connection: writes a request, parses one answer at a time (no pipelining)."""

    def __init__(self, pool: ConnectionPool, sock: socket.socket):
        self.pool, self.sock = pool, sock
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.requests = 0  # answers received on this connection
        self._waiter: asyncio.Future | None = None
        self._where = ""
        self._max_body = DEFAULT_MAX_BODY_BYTES
        self._buf = bytearray()
        self._reset_parser()

    def _reset_parser(self) -> None:
        self._status = 0  # 0: head not parsed yet
        self._ctype = ""
        self._length = -1  # Content-Length; -1: chunked or until the end of the connection
        self._chunked = False
        self._keep_alive = True
        self._body_at = 0  # offset of the body in _buf
        self._chunk_pos = 0  # chunked: offset of the next chunk-size line (only ever moves forward)
        self._chunk_data = -1  # chunked: size of the chunk whose size line ends at _chunk_pos - 2, else -1
        self._chunks: bytearray | None = None
        self._trailers_at = -1  # chunked: where the last chunk's line ends once it was read
        self._scan_from = 0  # where the search for the end of the head (or of a line) goes on
        self._interim = 0  # 1xx answers seen
        self._lf_from = 0  # the head's line ends are checked up to here

    # ---------------------------------------------------------------- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes while idle (e.g. a server's 408 before it closes): unusable
            self._fail(None)
            return
        self._buf += data
        try:
            self._parse()
        except HttpError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - a parser bug must fail this request, never the event loop
            self._fail(HttpError(f"{self._where}: unreadable answer ({type(e).__name__}: {e})"))

    def eof_received(self):
        if self._waiter is not None and self._status and not self._chunked and self._length < 0:
            self._finish(bytes(memoryview(self._buf)[self._body_at:]), keep_alive=False)  # body ran to the end
        self._fail(HttpError(f"{self._where}: the server closed the connection before the answer ended"))
        return False  # the transport closes itself

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        if self._waiter is not None and not self._waiter.done():
            why = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
            self._waiter.set_exception(HttpError(f"{self._where}: {why} before the answer ended"))
        self._waiter = None

    # ---------------------------------------------------------------- parsing
    def _parse(self) -> None:
        buf = self._buf
        while not self._status:
            end = buf.find(b"\r\n\r\n", self._scan_from)
            if end < 0:
                self._check_line_ends(buf)
                if len(buf) > MAX_HEAD_BYTES:
                    raise HttpError(f"{self._where}: no end of the HTTP head in {len(buf)} bytes")
                self._scan_from = max(0, len(buf) - 3)
                return
            if end > MAX_HEAD_BYTES:  # however it arrived (one read or many)
                raise HttpError(f"{self._where}: an HTTP head of {end} bytes (limit {MAX_HEAD_BYTES})")
            self._read_head(bytes(buf[:end]))
            self._scan_from = 0
            if 100 <= self._status < 200:  # an interim answer (100 Continue): the real one follows
                self._interim += 1
                if self._interim > MAX_INTERIM_ANSWERS:
                    raise HttpError(f"{self._where}: more than {MAX_INTERIM_ANSWERS} interim (1xx) answers")
                del buf[:end + 4]
                interim = self._interim
                self._reset_parser()
                self._interim = interim
                continue
            self._body_at = end + 4
            self._chunk_pos = end + 4
        if self._chunked:
            self._parse_chunks()
            return
        have = len(buf) - self._body_at
        if self._length < 0:  # up to the end of the connection (eof_received), within the limit
            if have > self._max_body:
                raise HttpError(f"{self._where}: answer body over {self._max_body} bytes (the limit)")
        elif have >= self._length:
            if have > self._length:
                raise HttpError(f"{self._where}: {have - self._length} bytes after the answer")
            self._finish(memoryview(buf)[self._body_at:], self._keep_alive)

    def _check_line_ends(self, buf: bytearray) -> None:
        """A head still coming in: a bare LF (a line not ended by CRLF) means its end would never be
        found (a wait for the timeout); each byte is looked at once (``_lf_from``)."""
        i = buf.find(b"\n", self._lf_from)
        while i >= 0:
            if i == 0 or buf[i - 1] != 13:  # b"\r"
                raise HttpError(f"{self._where}: the answer's head ends a line with a bare LF, not CRLF")
            i = buf.find(b"\n", i + 1)
        self._lf_from = len(buf)

    def _read_head(self, head: bytes) -> None:
        # every line ends with CRLF: a bare CR or LF inside the head is not HTTP (and not ours to guess)
        crlf = head.count(b"\r\n")
        if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
            raise HttpError(f"{self._where}: a bare CR or LF in the answer's head")
        lines = head.split(b"\r\n")
        m = _STATUS_LINE.fullmatch(lines[0])
        status = int(m[1]) if m else 0
        if not 100 <= status <= 599:  # "000" would leave the head unparsed forever (status 0)
            raise HttpError(f"{self._where}: not an HTTP/1.x status line: {lines[0][:100]!r}")
        self._status = status
        keep_alive = not lines[0].startswith(b"HTTP/1.0")  # HTTP/1.0 closes unless it says keep-alive
        length = -1
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise HttpError(f"{self._where}: malformed header line {line[:100]!r}")
            name = name.strip().lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS or (length >= 0 and int(value) != length):
                    raise HttpError(f"{self._where}: bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == b"content-type":
                self._ctype = value.strip().decode("latin-1")
            elif name == b"transfer-encoding":
                # only "chunked" itself: a token match, once ("notchunked", "gzip, chunked" and a
                # second chunked are codings this client does not decode)
                if value.strip().lower() != b"chunked" or self._chunked:
                    raise HttpError(f"{self._where}: unsupported Transfer-Encoding {value.strip()[:40]!r}")
                self._chunked = True
            elif name == b"connection":
                v = value.strip().lower()
                keep_alive = v != b"close" and (keep_alive or v == b"keep-alive")
        if self._chunked and length >= 0:  # RFC 9112 6.3: a sign of request smuggling; never guessed
            raise HttpError(f"{self._where}: both Content-Length and Transfer-Encoding in the answer")
        if self._status in (204, 304):
            length = 0
        if length > self._max_body:
            raise HttpError(f"{self._where}: answer body of {length} bytes over the limit of {self._max_body}")
        if self._chunked:
            length = -1
        elif length < 0:
            keep_alive = False  # the body is everything up to the end of the connection
        self._length, self._keep_alive = length, keep_alive

    def _parse_chunks(self) -> None:
        """Chunk-size line, data, CRLF, ... then "0", trailers and an empty line. Every step moves
        ``_chunk_pos`` forward by at least the size line (a size is hex digits only: never negative),
        and each byte of a size line or trailer is searched once (``_scan_from``)."""
        buf = self._buf
        if self._chunks is None:
            self._chunks = bytearray()
        if self._trailers_at >= 0:
            self._end_chunks()
            return
        while True:
            if self._chunk_data >= 0:  # the size line of this chunk was read: wait for its data
                start, size = self._chunk_pos, self._chunk_data
                if len(buf) < start + size + 2:
                    return
                if buf[start + size:start + size + 2] != b"\r\n":
                    raise HttpError(f"{self._where}: chunk of {size} bytes not followed by CRLF")
                self._chunks += buf[start:start + size]
                self._chunk_pos, self._chunk_data = start + size + 2, -1
                self._scan_from = self._chunk_pos
            pos = self._chunk_pos
            eol = buf.find(b"\r\n", max(pos, self._scan_from))
            if eol < 0 or eol - pos > MAX_CHUNK_LINE_BYTES:
                if len(buf) - pos > MAX_CHUNK_LINE_BYTES:
                    raise HttpError(f"{self._where}: a chunk-size line over {MAX_CHUNK_LINE_BYTES} bytes")
                self._scan_from = max(pos, len(buf) - 1)
                return
            size = self._chunk_size(bytes(buf[pos:eol]))
            if size == 0:  # last chunk, then optional trailers, then an empty line
                self._trailers_at = eol
                self._end_chunks()
                return
            if len(self._chunks) + size > self._max_body:
                raise HttpError(f"{self._where}: chunked answer over {self._max_body} bytes (the limit)")
            self._chunk_pos, self._chunk_data = eol + 2, size

    def _chunk_size(self, line: bytes) -> int:
        size_text = line.split(b";", 1)[0].rstrip(b" \t")  # chunk extensions are ignored
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise HttpError(f"{self._where}: bad chunk size {size_text[:40]!r} (hex digits only)")
        return int(size_text, 16)

    def _end_chunks(self) -> None:
        """After the last chunk's line: the trailers (bounded) and the empty line end the answer."""
        buf, eol = self._buf, self._trailers_at
        end = buf.find(b"\r\n\r\n", max(eol, self._scan_from))
        if end < 0:
            if len(buf) - eol > MAX_TRAILER_BYTES:
                raise HttpError(f"{self._where}: trailers over {MAX_TRAILER_BYTES} bytes")
            self._scan_from = max(eol, len(buf) - 3)
            return
        if len(buf) > end + 4:
            raise HttpError(f"{self._where}: {len(buf) - end - 4} bytes after the answer")
        self._finish(bytes(self._chunks), self._keep_alive)

    def _finish(self, body, keep_alive: bool) -> None:
        waiter, self._waiter = self._waiter, None
        self.requests += 1
        # the answer's bytes go with the answer (``body`` may be a view of them): an idle connection
        # must not keep its last answer alive (at 16k connections and ~250 KB answers, ~4 GB)
        self._buf = bytearray()
        if not keep_alive:
            self._close()
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, self._ctype, body))

    def _fail(self, exc: Exception | None) -> None:
        waiter, self._waiter = self._waiter, None
        self._close()
        if waiter is not None and not waiter.done() and exc is not None:
            waiter.set_exception(exc)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self, why: str | None = None) -> None:
        """Drop the connection now (a cancelled or timed-out request must not leave it reusable).
        ``why``: the request waiting on it fails now with ``HttpError(why)``; without, it is left to
        its own end (its caller is the one aborting: it was cancelled or timed out)."""
        waiter, self._waiter = self._waiter, None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        if why is not None and waiter is not None and not waiter.done():
            waiter.set_exception(HttpError(f"{self._where}: {why}"))

    # ---------------------------------------------------------------- one request
    def start(self, waiter: asyncio.Future, where: str, data: bytes,
              max_body: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if self.closed:  # a fresh connection the server closed before the request: nothing was sent
            raise HttpError(f"{where}: the server closed the connection before the request was written")
        self._waiter, self._where, self._max_body = waiter, where, max_body
        self._buf = bytearray()
        self._reset_parser()
        self.transport.write(data)

    def reusable(self, now: float, keepalive_s: float) -> bool:
        """The rule of the module docstring, checked just before a request is written."""
        if self.closed or not self._keep_alive or now - self.idle_since >= keepalive_s:
            return False
        try:
            self.sock.recv(1, _PEEK_FLAGS)  # b"" (the server's FIN) or unsolicited bytes: not reusable
            return False
        except BlockingIOError:
            return True  # nothing to read: the server has not closed it
        except OSError:
            return False  # reset, or the socket is gone


class ConnectionPool:
    """Kept-alive connections to one server (``http://host:port[/prefix]``) for POST requests.

    ``api_key`` adds ``Authorization: Bearer KEY`` to every request. See the module docstring for
    when an idle connection is reused; nothing is ever retried here. ``max_body_bytes``: the
    largest answer body taken (a request may pass its own bound)."""

    def __init__(self, url: str, *, api_key: str | None = None, connect_timeout_s: float = 10.0,
                 keepalive_s: float = KEEPALIVE_S, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        parts = check_server_url(url)
        if parts.scheme != "http":
            raise ValueError(f"{url}: ConnectionPool speaks plain http://host:port only")
        self.max_body_bytes = max_body_bytes
        self.url = url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._literal = _ip_literal(self.host, self.port)  # no resolver round trip for an IP address
        self._netloc = parts.netloc
        self._auth = f"Authorization: Bearer {api_key}\r\n".encode("latin-1") if api_key else b""
        self.connect_timeout_s, self.keepalive_s = connect_timeout_s, keepalive_s
        self._idle: deque[_Connection] = deque()
        self._open: set[_Connection] = set()
        self._heads: dict[str, bytes] = {}
        self.connects = 0  # connections opened (tests and benchmarks read it)
        self.closed = False

    def _head(self, method: str, path: str) -> bytes:
        """The request's head up to its Content-Length value (POST) or its end (GET), built once."""
        head = self._heads.get((method, path))
        if head is None:
            head = (f"{method} {self._prefix}{path} HTTP/1.1\r\nHost: {self._netloc}\r\n"
                    "Accept: application/json\r\n").encode("latin-1") + self._auth
            head += b"Content-Type: application/json\r\nContent-Length: " if method == "POST" else b"\r\n"
            self._heads[(method, path)] = head
        return head

    def post(self, path: str, body: bytes, timeout_s: float, max_body: int | None = None) -> Awaitable[Response]:
        """POST ``body`` (JSON bytes) to ``path``; the complete answer, whatever its status.
        Raises :class:`HttpError` (a ``ConnectionError``: also for an answer that is not HTTP/1.x
        or whose body passes ``max_body`` bytes, the pool's ``max_body_bytes`` by default) or
        ``TimeoutError`` (``timeout_s`` for the whole call, connect included); never sends the
        request twice. (Not a coroutine itself: no frame of its own holds ``body`` while the answer
        is awaited.)"""
        return self.request("POST", path, body, timeout_s, max_body)

    async def request(self, method: str, path: str, body: bytes | None, timeout_s: float,
                      max_body: int | None = None) -> Response:
        """``method`` ("GET", or "POST" with JSON ``body``) on ``path``; see :meth:`post`."""
        if method not in ("GET", "POST"):
            raise ValueError(f"{self.url}{path}: method {method!r}: ConnectionPool sends GET and POST only")
        if method == "POST":
            data = b"".join((self._head(method, path), b"%d\r\n\r\n" % len(body), body))
        else:
            data = self._head(method, path)
        del body  # no request bytes are held while the answer is awaited (orjson's keep 16 KB each)
        loop = asyncio.get_running_loop()
        where = self.url + path
        t0 = loop.time()
        conn = self._take_idle()
        if conn is None:
            conn = await self._connect(loop, where, min(self.connect_timeout_s, timeout_s))
        waiter = loop.create_future()
        timer = loop.call_at(t0 + timeout_s, _expire, waiter, where, timeout_s)
        try:
            conn.start(waiter, where, data, max_body or self.max_body_bytes)
            del data
            resp = await waiter
        except BaseException:  # timeout, cancellation, broken connection: it is never reused
            conn.abort()
            self._forget(conn)
            raise
        finally:
            timer.cancel()
        if not conn.closed and not self.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
            self._trim(conn.idle_since)
        return resp

    def _take_idle(self) -> _Connection | None:
        idle, now = self._idle, time.monotonic()
        while idle:
            conn = idle.pop()  # newest first: the least likely to have been closed
            if conn.reusable(now, self.keepalive_s):
                return conn
            conn.abort()
            self._forget(conn)
        return None

    def _trim(self, now: float) -> None:
        """Close the oldest idle connections once they pass ``keepalive_s`` (before the server does)."""
        idle = self._idle
        while idle and (idle[0].closed or now - idle[0].idle_since >= self.keepalive_s):
            conn = idle.popleft()
            conn.abort()
            self._forget(conn)

    async def _connect(self, loop, where: str, timeout_s: float) -> _Connection:
        try:
            async with asyncio.timeout(timeout_s):
                infos = self._literal or await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                last: OSError | None = None
                for family, type_, proto, _, addr in infos:
                    sock = socket.socket(family, type_, proto)
                    try:
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        await loop.sock_connect(sock, addr)
                        conn = _Connection(self, sock)
                        await loop.create_connection(lambda c=conn: c, sock=sock)
                    except OSError as e:
                        sock.close()
                        last = e
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    self.connects += 1
                    self._open.add(conn)
                    return conn
                if last is None:
                    raise HttpError(f"{where}: {self.host} resolved to no address")
                raise HttpError(f"{where}: cannot connect: {type(last).__name__}: {last}") from last
        except TimeoutError:
            raise ConnectTimeout(f"{where}: no connection within {timeout_s}s") from None

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)

    def close(self) -> None:
        """Close every connection, idle or busy: a busy request fails with HttpError now (its server
        may never answer: a hung one keeps the connection open), not at its own deadline."""
        self.closed = True
        for conn in list(self._open):
            conn.abort("the connection was closed (its server left the pool, or the client closed) before the "
                       "answer ended")
        self._open.clear()
        self._idle.clear()


def _ip_literal(host: str, port: int) -> list | None:
    """getaddrinfo's answer for an IP address, without asking the resolver; None for a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        addr = (host, port) if family == socket.AF_INET else (host, port, 0, 0)
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr)]
    return None


def _expire(waiter: asyncio.Future, where: str, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"{where}: no complete answer within {timeout_s}s"))
