"""Idle and unauthenticated connections on the HTTP listeners we serve: the embedded engine
(``embedded/``), the agent endpoint (``areal_fast/agent/server.py``) and the Prometheus endpoint
(``areal_fast/metrics/prometheus.py``). One implementation for all three.

aiohttp keeps a connection that never sends a request for its keep-alive timeout, an hour by
default, and counts it nowhere, so a few hundred idle connections used up a process's descriptors
and locked every client out. Three limits (:class:`ConnLimits`):

- ``head_timeout_s`` (10 s): a connection that has not sent one complete request head by then is
  closed (an idle one, or one whose head never ends). Later heads on a kept-alive connection are
  bounded by the keep-alive timeout: aiohttp closes a connection waiting for a head when it runs out.
- ``keepalive_s`` (10 s): an idle kept-alive connection is closed after this long. SGLang's HTTP
  server (uvicorn) closes one after 5 s and the clients that talk to it give one up sooner (ours
  after 4 s, ``http/pool.py``; the openai SDK's httpx after 5 s): a server that closed at 5 s too
  would race a client that reuses a connection in its last moment. 10 s stays above every such
  client and still frees an idle descriptor within seconds.
- ``max_unauthenticated`` (64): connections that have not yet made a request that proved the
  listener's key. Over the cap, the OLDEST unauthenticated connections are closed, not the new
  one: refusing new connections would let whoever holds the cap (re-opened every head timeout)
  keep every client out, while closing the oldest keeps the door open for a client that sends its
  request as soon as it connects. A connection is closed this way only once it has had
  ``CAP_GRACE_S`` (1 s) to send its request and none of its bytes wait unread (the event loop may
  be late): a burst of clients (the rollout client opens one connection per request in flight;
  asyncio makes a whole batch of accepted connections before it reads any of them) may pass the
  cap for that second, then the excess is closed. Authenticated connections are never counted or
  closed for the cap (their holders have the key).

Two things keep the cap and the head timeout off the listener's own clients:

- a connection is closed only while it is idle as aiohttp's keep-alive sees it (waiting for a
  request head, none queued): one whose head was read but whose handler has not yet checked the
  key (a late event loop) is not closed under its request;
- ``known_clients`` (:func:`start_site`): how many connections the listener's own clients may be
  opening right now, added to the cap. The agent endpoint passes its open episodes (one each).
  Its clients share the controller's event loop (the openai SDK of every episode of a process):
  at a run's start a few hundred episodes connect at once, and on a loaded loop a connection may
  wait more than ``CAP_GRACE_S`` before its client even writes its request. Without the allowance
  the cap closed those as idle, and every such call failed (``httpx.ReadError`` or "Server
  disconnected" in the SDK, which must not retry a turn).

A connection becomes authenticated when one of its requests passes :func:`authorize` (the one
check, ``http/auth.py``) on a path that needs the key; probes (``/health``, ``/metrics``)
prove nothing. On a listener without a key every request passes, so only connections that have
sent no request (or only probes) are counted.

::

    runner = await start_site(app, host, port, ConnLimits())   # instead of AppRunner + TCPSite
    serve_forever(app, host, port, ConnLimits())               # instead of web.run_app
    if not authorize(request, key): ...                        # in the listener's middleware

How: ``web.Server`` (``runner.server``) is aiohttp's protocol factory; every connection's
``RequestHandler`` reports ``connection_made`` / ``connection_lost`` to it and takes its
``request_factory`` (called once per complete request head) when created. :func:`start_site`
wraps those three on the server before the site listens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import struct
from collections.abc import Callable

try:
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not POSIX: no look at unread bytes
    fcntl = termios = None

from aiohttp import web

from areal_fast.http.auth import AUTH_EXEMPT_PREFIXES, authorized

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0
KEEPALIVE_S = 10.0
MAX_UNAUTHENTICATED = 64
CAP_GRACE_S = 1.0  # a new connection's time to send its request before the cap may close it
WARN_EVERY_S = 60.0  # closing for the cap is logged at most this often


@dataclasses.dataclass(frozen=True)
class ConnLimits:
    """See the module docstring."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    keepalive_s: float = KEEPALIVE_S
    max_unauthenticated: int = MAX_UNAUTHENTICATED

    def __post_init__(self):
        for name in ("head_timeout_s", "keepalive_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"ConnLimits.{name} must be a finite number > 0, got {value!r}")
        n = self.max_unauthenticated
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ConnLimits.max_unauthenticated must be an integer >= 1, got {n!r}")


def _idle(handler) -> bool:
    """aiohttp's own test of an idle connection (its keep-alive's, ``RequestHandler._process_keepalive``):
    waiting for a request head with none queued. False while a request's head is read and its
    handler has not answered, and before the connection's first wait (the next loop iteration)."""
    if not hasattr(handler, "_waiter"):  # an aiohttp without it: every connection counts as idle, as before
        return True
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


def _unread_bytes(transport) -> int:
    """Bytes that reached ``transport``'s socket but not yet the event loop (0 when unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None or fcntl is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


class ConnGuard:
    """The connections of one listener: which have not sent a first request head yet (each with
    its timer) and which are unauthenticated (oldest first)."""

    def __init__(self, limits: ConnLimits, known_clients: Callable[[], int] | None = None):
        self.limits = limits
        self._known_clients = known_clients
        # RequestHandler -> (loop time it connected, its transport), oldest first
        self._unauthenticated: dict[object, tuple[float, asyncio.Transport]] = {}
        self._head_timers: dict[object, asyncio.TimerHandle] = {}
        self._trim_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.evicted = 0  # closed for the cap
        self._warned_at = float("-inf")
        self.timed_out = 0  # closed without a first request head

    def install(self, server: web.Server) -> None:
        """Wrap ``server``'s connection callbacks and request factory (before it serves)."""
        made, lost, factory = server.connection_made, server.connection_lost, server.request_factory
        self._loop = asyncio.get_running_loop()

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self._opened(handler, transport)

        def connection_lost(handler, exc=None) -> None:
            self._forget(handler)
            lost(handler, exc)

        def request_factory(message, payload, protocol, writer, task):
            timer = self._head_timers.pop(protocol, None)  # a complete head: the first-head timer stops
            if timer is not None:
                timer.cancel()
            return factory(message, payload, protocol, writer, task)

        server.connection_made, server.connection_lost = connection_made, connection_lost
        server.request_factory = request_factory

    def cap(self) -> int:
        """The unauthenticated connections allowed now: ``max_unauthenticated`` plus the
        connections the listener's own clients may be opening (``known_clients``)."""
        known = self._known_clients() if self._known_clients is not None else 0
        return self.limits.max_unauthenticated + max(0, known)

    @property
    def unauthenticated(self) -> int:
        """Connections open now without a request that proved the key."""
        return len(self._unauthenticated)

    def authenticated(self, handler) -> None:
        """``handler``'s connection made a request that proved the key: no longer counted."""
        self._unauthenticated.pop(handler, None)

    def _opened(self, handler, transport) -> None:
        loop = self._loop
        self._unauthenticated[handler] = (loop.time(), transport)
        self._head_timers[handler] = loop.call_later(self.limits.head_timeout_s, self._head_expired, handler)
        if len(self._unauthenticated) > self.cap():
            self._trim()

    def _trim(self) -> None:
        """Close the oldest unauthenticated connections beyond the cap that had their grace, are
        idle and hold no unread bytes; look again when the next one's grace ends if the cap is
        still passed."""
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None
        cap = self.cap()
        excess = len(self._unauthenticated) - cap
        if excess <= 0:
            return
        now, victims, again_at = self._loop.time(), [], None
        for handler, (since, transport) in self._unauthenticated.items():
            if len(victims) == excess:
                break
            if now - since < CAP_GRACE_S:
                again_at = since + CAP_GRACE_S  # this one and every later one is still in its grace
                break
            if _idle(handler) and _unread_bytes(transport) == 0:
                victims.append(handler)
        for handler in victims:
            self._close(handler)
        self.evicted += len(victims)
        if victims and now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("more than %d connections without the key: closed the oldest (%d so far)",
                        cap, self.evicted)
        if len(victims) < excess:
            self._trim_timer = self._loop.call_at(again_at or now + CAP_GRACE_S, self._trim)

    def _head_expired(self, handler) -> None:
        if self._head_timers.pop(handler, None) is None:
            return
        entry = self._unauthenticated.get(handler)
        # its head waits unread, or was read and waits for its handler: the loop is late
        if entry is not None and (_unread_bytes(entry[1]) or not _idle(handler)):
            self._head_timers[handler] = self._loop.call_later(CAP_GRACE_S, self._head_expired, handler)
            return
        self.timed_out += 1
        self._close(handler)

    def _close(self, handler) -> None:
        self._forget(handler)  # now: its connection_lost comes a loop iteration later
        handler.force_close()

    def _forget(self, handler) -> None:
        self._unauthenticated.pop(handler, None)
        timer = self._head_timers.pop(handler, None)
        if timer is not None:
            timer.cancel()


_GUARD = web.AppKey("areal_fast.conn_guard", ConnGuard)


def guard_of(app: web.Application) -> ConnGuard | None:
    """The guard of ``app``'s listener (None when it was not started by :func:`start_site`)."""
    return app.get(_GUARD)


def authorize(request: web.Request, api_key: str | None, *,
              exempt: tuple[str, ...] = AUTH_EXEMPT_PREFIXES) -> bool:
    """``http.auth.authorized`` for ``request`` (``exempt``: the paths that need no key); one that
    passes on a path that needs the key marks its connection authenticated (when its listener was
    started by :func:`start_site`)."""
    path = request.path
    if not authorized(api_key, path, request.headers.get("Authorization"), exempt):
        return False
    guard = request.app.get(_GUARD)
    if guard is not None and not (exempt and path.startswith(exempt)) and request.protocol is not None:
        guard.authenticated(request.protocol)
    return True


async def start_site(app: web.Application, host: str, port: int, limits: ConnLimits | None = None, *,
                     known_clients: Callable[[], int] | None = None) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (0: a free port; ``runner.addresses`` says which) with the
    guard; the started runner (``await runner.cleanup()`` stops it). ``known_clients``: how many
    connections the listener's own clients may be opening now, on top of the cap (module docstring)."""
    limits = limits or ConnLimits()
    guard = ConnGuard(limits, known_clients)
    app[_GUARD] = guard  # before setup freezes the app
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.keepalive_s)
    await runner.setup()
    guard.install(runner.server)
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def serve_forever(app: web.Application, host: str, port: int, limits: ConnLimits | None = None) -> None:
    """``web.run_app`` with the guard: serve until SIGINT or SIGTERM, then shut the app down."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = await start_site(app, host, port, limits)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())
