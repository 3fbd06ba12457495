"""Calls to the inference servers: the one place that speaks HTTP to them.

    calls = ServerCalls(api_key=key)                      # async; one per event loop
    info = await calls.call(url, "GET", "/server_info")   # RequestError / ServerError name server and path
    await calls.call(url, "POST", "/flush_cache", policy=RetryPolicy(deadline_s=60, backoff_s=0.05,
                                                                    backoff_max_s=0.05, retry_statuses={400}))
    h = await calls.health(url)                           # ServerHealth: ok | paused | unhealthy | up | down
    await calls.close()

    with BlockingCalls(api_key=key) as calls:             # the same calls for threads and start-up code
        calls.call(url, "POST", "/update_weights_from_disk", body)      # blocks
        fut = calls.submit(url, "POST", "/update_weights_from_distributed", body)  # concurrent Future

What every call shares:
- the run's API key (``Authorization: Bearer KEY``) and the one server URL check
  (:func:`check_server_url`: no user info, a port in 1..65535, no query);
- a deadline per call (``timeout_s``, connect included) and, across attempts, one
  :class:`RetryPolicy`;
- the transport: ``http://`` servers through our HTTP/1.1 connection pool
  (``areal_fast.http.pool``: strict status and chunk parsing, size limits, never a request sent
  twice by the transport); ``https://`` servers, and ``transport="aiohttp"``, through aiohttp;
- the answer rules: 2xx is the decoded body; a 4xx (and a 500 naming a TypeError where the server's
  adapter says its release answers an unknown sampling key so: ``caller_500``) is :class:`RequestError`, the
  caller's fault, never retried unless the policy names its status; any other 5xx is
  :class:`ServerError`; no answer is ``ConnectionError`` (refused, reset, not HTTP, too large) or
  ``TimeoutError``.

The one health check (:meth:`ServerCalls.health`) is what a watchdog, the launchers' start-up wait
and the weight sync's "is this server dead?" ask. ``/model_info`` (vLLM: ``/version``, ``liveness_route``)
answers without the scheduler, so any HTTP answer there, even a 401, says the process is up;
``/health`` runs SGLang's probe (one token; up to 20 s; every version answers 503 when the scheduler
produced nothing in 20 s, which it never does while generation is paused: ``docs/sglang.md``), so a
503 there says "no output", not "dead". The party that paused the servers does not probe them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field

from areal_fast.http.pool import DEFAULT_MAX_BODY_BYTES, KEEPALIVE_S, ConnectionPool, ConnectTimeout, HttpError
from areal_fast.netutil import check_server_url
from areal_fast.rollout.answer import dumps, loads
from areal_fast.rollout.liveness_route import learn_liveness_route, liveness_path

__all__ = ["API_KEY_ENV", "BlockingCalls", "CONTROL_RETRY", "DEAD_SERVER_RETRY", "HEALTH_PROBE_TIMEOUT_S",
           "HttpError", "LIVENESS_TIMEOUT_S", "RequestError", "RetryPolicy", "RolloutError", "ServerCalls",
           "ServerError", "ServerHealth", "check_server_url", "dead_servers", "health_now", "is_broken",
           "is_caller_error", "no_answer_errors", "retry_dropping_dead", "status_error"]

log = logging.getLogger(__name__)
API_KEY_ENV = "AREAL_FAST_API_KEY"
# An SGLang /health probe waits up to 20 s for the scheduler; give it that plus a margin.
HEALTH_PROBE_TIMEOUT_S = 25.0
LIVENESS_TIMEOUT_S = 2.0  # a watchdog's /model_info: it answers without the scheduler, in milliseconds
_CALLER_500 = ("TypeError", "unexpected keyword argument")


# ------------------------------------------------------------------------------------------ errors
class RolloutError(RuntimeError):
    """Base class of the errors of calls to the inference servers and of the rollout client."""


class _StatusError(RolloutError):
    def __init__(self, url: str, status: int, body: object, note: str = ""):
        super().__init__(f"{url} answered {status}: {body}{note}")
        self.url, self.status, self.body = url, status, body


class RequestError(_StatusError):
    """The request itself is wrong (a 4xx, or SGLang's 500 for an unknown sampling key): never
    retried. ``url`` is the server and path, ``status`` and ``body`` the answer."""


class ServerError(_StatusError):
    """A live server answered 5xx for a reason that is not the caller's (retried elsewhere)."""


def is_caller_error(status: int, body: object, caller_500: bool = True) -> bool:
    """True when an answer blames the request, not the server. ``caller_500``: a 500 naming a
    TypeError is the caller's (a server that answers an unknown request key that way; the client's
    backend adapter says which releases do, and a server whose release is not known is taken so)."""
    if 400 <= status < 500:
        return True
    if status == 500 and caller_500:
        text = body if isinstance(body, str) else json.dumps(body)
        return any(m in text for m in _CALLER_500)
    return False


def status_error(where: str, status: int, body: object, caller_500: bool = True,
                 note: str = "") -> RequestError | ServerError:
    """The error an answer of ``status`` >= 400 from ``where`` (server and path) is."""
    cls = RequestError if is_caller_error(status, body, caller_500) else ServerError
    return cls(where, status, body, note)


def is_broken(e: BaseException) -> bool:
    """No answer because no connection could be made, or it broke before the answer (refused,
    reset, closed, not HTTP): the server did not run the request to an answer. A timeout after
    the request went out is not broken: the server may still be running it."""
    if isinstance(e, ConnectTimeout):
        return True
    aiohttp = _aiohttp_if_loaded()
    conn_errors = (ConnectionError,) if aiohttp is None else (ConnectionError, aiohttp.ClientConnectionError)
    if aiohttp is not None and isinstance(e, aiohttp.ConnectionTimeoutError):
        return True
    return isinstance(e, conn_errors) and not isinstance(e, TimeoutError)


def no_answer_errors() -> tuple[type[BaseException], ...]:
    """What a call that got no answer raises: ``ConnectionError`` (ours: ``HttpError``),
    ``TimeoutError`` and, where aiohttp carried calls, ``aiohttp.ClientError``."""
    aiohttp = _aiohttp_if_loaded()
    return (ConnectionError, TimeoutError) if aiohttp is None else (ConnectionError, TimeoutError, aiohttp.ClientError)


def _no_answer_state(e: BaseException) -> str:
    """``down`` for no connection (or one that broke), ``unhealthy`` for a connected server that
    did not answer in time (busy: a refused or reset connection is what a dead server gives)."""
    if is_broken(e):
        return "down"
    return "unhealthy" if isinstance(e, TimeoutError) else "down"


# ------------------------------------------------------------------------------------ the policy
@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often a call is sent and how long it may take. The default sends once.

    Which outcomes are retried: an answer whose status is in ``retry_statuses``, and, with
    ``retry_broken``, a call that got no answer because its connection failed (:func:`is_broken`);
    never a timeout (the server may still run the request) and never any other status.
    The same rules drive the rollout client's failover of /generate (``attempts``, ``backoff_s``:
    another server each attempt) and the dead-server retry of :func:`retry_dropping_dead`."""

    timeout_s: float = 600.0
    """Deadline of one attempt, connect included."""
    attempts: int | None = 1
    """Attempts at most; None: as many as ``deadline_s`` allows."""
    backoff_s: float = 0.0
    """Wait after attempt k (0-based): ``backoff_s * (k + 1)``, at most ``backoff_max_s``."""
    backoff_max_s: float = float("inf")
    """Cap of the wait between attempts (equal to ``backoff_s``: a constant poll)."""
    deadline_s: float | None = None
    """Every attempt ends by then (each attempt's timeout is cut to it); None: no overall deadline.
    For :func:`retry_dropping_dead`: how long a failure waits for a server's death to show."""
    retry_statuses: frozenset[int] = field(default_factory=frozenset)
    """Answers retried until the attempts or the deadline run out (400 from a /flush_cache that
    cannot happen yet: requests still hold KV)."""
    retry_broken: bool = False
    """Retry a call whose connection failed before its answer (idempotent control calls)."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"RetryPolicy.timeout_s: must be > 0, got {self.timeout_s!r}")
        if self.attempts is not None and (type(self.attempts) is not int or self.attempts < 1):
            raise ValueError(f"RetryPolicy.attempts: must be an int >= 1 or None, got {self.attempts!r}")
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("RetryPolicy: attempts=None needs a deadline_s")
        if not self.backoff_s >= 0 or not self.backoff_max_s >= 0:
            raise ValueError(f"RetryPolicy.backoff_s / backoff_max_s: must be >= 0, got {self.backoff_s!r}, "
                             f"{self.backoff_max_s!r}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"RetryPolicy.deadline_s: must be > 0 or None, got {self.deadline_s!r}")
        object.__setattr__(self, "retry_statuses", frozenset(self.retry_statuses))

    def wait_s(self, attempt: int) -> float:
        """The wait after attempt ``attempt`` (0-based)."""
        return min(self.backoff_s * (attempt + 1), self.backoff_max_s)

    def retries_error(self, e: BaseException) -> bool:
        return self.retry_broken and is_broken(e)

    def retries_status(self, status: int) -> bool:
        return status in self.retry_statuses

    def another(self, attempt: int, deadline: float | None, now: float) -> bool:
        """May attempt ``attempt + 1`` start (after its wait)?"""
        if self.attempts is not None and attempt + 1 >= self.attempts:
            return False
        return deadline is None or now + self.wait_s(attempt) < deadline


# An idempotent control call (pause, continue, abort, info) whose connection broke is sent once more.
CONTROL_RETRY = RetryPolicy(attempts=2, retry_broken=True)
# A call on every server that failed is retried without the servers whose process is gone: a
# connection reset can arrive up to 3 s before the server's exit is visible; at most 3 attempts.
DEAD_SERVER_RETRY = RetryPolicy(attempts=3, deadline_s=3.0, backoff_s=0.1, backoff_max_s=0.1)


# ------------------------------------------------------------------------------------------ health
@dataclass(frozen=True)
class ServerHealth:
    """What the one health check found. ``alive`` is what a watchdog should act on.

    ``state``: ``ok`` (/health answered 200), ``paused`` (alive, paused by the asker: not probed),
    ``up`` (alive; /health not asked), ``unhealthy`` (alive, but no 200 from /health, no answer
    in time, or the key refused: ``key_refused``), ``down`` (no connection, or it broke)."""

    url: str
    state: str
    detail: str = ""
    key_refused: bool = False

    @property
    def alive(self) -> bool:
        """The process answers HTTP (or is connected and busy). A paused server is alive."""
        return self.state != "down"


# ------------------------------------------------------------------------------------ async calls
class ServerCalls:
    """Calls to any number of servers from one event loop (see the module docstring).

    ``transport``: "native" (our pool for http:// servers; https:// goes to aiohttp) or "aiohttp".
    ``connect_timeout_s`` bounds a connect; ``max_body_bytes`` the largest answer taken."""

    def __init__(self, *, api_key: str | None = None, connect_timeout_s: float = 10.0, transport: str = "native",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if transport not in ("native", "aiohttp"):
            raise ValueError(f"transport must be 'native' or 'aiohttp', got {transport!r}")
        self.api_key = api_key or None
        self.connect_timeout_s, self.transport, self.max_body_bytes = connect_timeout_s, transport, max_body_bytes
        self._pools: dict[str, ConnectionPool] = {}
        self._session = None  # aiohttp, kept-alive connections (opened on first use)
        self._fresh_session = None  # aiohttp, a new connection per call (control calls)
        self.closed = False

    def pool(self, url: str) -> ConnectionPool | None:
        """Our connection pool of ``url`` (made on first use), None where aiohttp carries its calls."""
        pool = self._pools.get(url)
        if pool is None and self.transport == "native" and url.startswith("http://"):
            if self.closed:
                raise RolloutError(f"{url}: the calls of this ServerCalls were closed")
            pool = self._pools[url] = ConnectionPool(
                url, api_key=self.api_key, connect_timeout_s=self.connect_timeout_s, max_body_bytes=self.max_body_bytes)
        return pool

    def forget(self, url: str) -> None:
        """``url`` left the pool (dead, hung or removed): every connection to it closes now, and a
        request in flight there fails with ``HttpError`` at once, so that the caller fails over
        instead of waiting out its deadline on a server that may never answer (a hung one keeps its
        connections open). On aiohttp (https, ``transport="aiohttp"``) requests finish or time out."""
        pool = self._pools.pop(url.rstrip("/"), None)
        if pool is not None:
            pool.close()

    def _aiohttp_session(self, fresh: bool):
        import aiohttp

        if self.closed:
            raise RolloutError("the calls of this ServerCalls were closed")
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            # SGLang's server (uvicorn) closes a connection idle for 5 s; aiohttp keeps one 15 s by
            # default: a request could be written into one the server is closing. KEEPALIVE_S: 4 s.
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
            # control calls never reuse a kept-alive connection here: aiohttp cannot tell one that
            # its server has closed ("Cannot write to closing transport", seen at 256 servers)
            self._fresh_session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self._fresh_session if fresh else self._session

    async def request(self, url: str, method: str, path: str, body: dict | None = None, *, timeout_s: float,
                      max_body: int | None = None, parse: Callable | None = None, fresh: bool = False
                      ) -> tuple[int, object]:
        """One HTTP call, sent once: ``(status, decoded body)`` whatever the status. No answer raises
        ``ConnectionError`` (``HttpError``, aiohttp's ``ClientConnectionError``), another
        ``aiohttp.ClientError`` or ``TimeoutError``. ``parse(raw bytes)`` decodes a 2xx JSON answer
        instead of the generic decoder. ``fresh``: on aiohttp, a new connection (our pool checks
        a kept-alive one before writing)."""
        limit = max_body or self.max_body_bytes
        pool = self._pools.get(url) or self.pool(url)
        if pool is not None:
            # the encoded body is not bound here: the pool drops it once written (orjson's bytes
            # keep a 16 KB allocation each; x 16k requests in flight that was 256 MB)
            resp = await pool.request(method, path, dumps(body if body is not None else {}) if method == "POST"
                                      else None, timeout_s, limit)
            raw, ctype, status = resp.body, resp.content_type, resp.status
        else:
            raw, ctype, status = await self._aiohttp_request(url, method, path, body, timeout_s, limit, fresh)
        if parse is not None and status < 300 and "json" in ctype:
            return status, parse(raw)
        return status, _decode(bytes(raw), ctype)

    async def _aiohttp_request(self, url, method, path, body, timeout_s, limit, fresh):
        import aiohttp

        check_server_url(url)
        session = self._aiohttp_session(fresh)
        connect_s = min(self.connect_timeout_s, timeout_s)
        kwargs = {"timeout": aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_s)}
        if method == "POST":
            kwargs["data"] = dumps(body if body is not None else {})
            kwargs["headers"] = _JSON_HEADERS
        async with session.request(method, _yarl_url(url, path), **kwargs) as r:
            raw = await _read_at_most(r, limit, url + path)
            return raw, r.headers.get("Content-Type", ""), r.status

    async def call(self, url: str, method: str, path: str, body: dict | None = None, *,
                   policy: RetryPolicy = RetryPolicy(), caller_500: bool = True, parse: Callable | None = None,
                   max_body: int | None = None, fresh: bool = False):
        """A call that must succeed: the decoded 2xx answer, sent again as ``policy`` allows; else
        :class:`RequestError` / :class:`ServerError` (naming server and path), ``ConnectionError``
        or ``TimeoutError``. ``caller_500``: see :func:`is_caller_error`."""
        if policy.attempts == 1 and policy.deadline_s is None:  # sent once (/generate): no retry bookkeeping
            status, data = await self.request(url, method, path, body, timeout_s=policy.timeout_s, max_body=max_body,
                                              parse=parse, fresh=fresh)
            if status < 400:
                return data
            raise status_error(url + path, status, data, caller_500)
        loop = asyncio.get_running_loop()
        deadline = None if policy.deadline_s is None else loop.time() + policy.deadline_s
        attempt = 0
        while True:
            timeout_s = policy.timeout_s
            if deadline is not None:
                timeout_s = min(timeout_s, deadline - loop.time())
                if timeout_s <= 0:
                    raise TimeoutError(f"{url}{path}: no answer within the deadline of {policy.deadline_s}s")
            try:
                status, data = await self.request(url, method, path, body, timeout_s=timeout_s, max_body=max_body,
                                                  parse=parse, fresh=fresh)
            except Exception as e:
                if not (policy.retries_error(e) and policy.another(attempt, deadline, loop.time())):
                    raise
            else:
                if status < 400:
                    return data
                if not (policy.retries_status(status) and policy.another(attempt, deadline, loop.time())):
                    note = f" (after {attempt + 1} attempts)" if policy.retries_status(status) else ""
                    raise status_error(url + path, status, data, caller_500, note)
            await asyncio.sleep(policy.wait_s(attempt))
            attempt += 1

    async def health(self, url: str, *, paused: bool = False, liveness: bool = True, probe: bool = True,
                     timeout_s: float = LIVENESS_TIMEOUT_S, probe_timeout_s: float = HEALTH_PROBE_TIMEOUT_S
                     ) -> ServerHealth:
        """The one health check (see the module docstring); safe during pauses and weight updates.

        ``liveness``: GET /model_info first (no connection: "down"; connected, no answer in
        ``timeout_s``: "unhealthy"; 401: "unhealthy", ``key_refused``; any other answer: alive).
        ``paused``: the asker paused the server: "paused", /health is not asked. ``probe``: GET
        /health (``probe_timeout_s``): 200 "ok", another status or no answer in time
        "unhealthy" (503 while paused says "no output", not "dead"), no connection "down".
        Without ``probe``: "up" for a live server. The launchers' start-up wait asks the probe
        alone, a watchdog liveness alone, the rollout client both."""
        url, path = url.rstrip("/"), liveness_path(url)
        if liveness:
            try:
                status, _ = await self._probe(url, path, timeout_s)
            except no_answer_errors() as e:
                return ServerHealth(url, _no_answer_state(e), f"{path}: {type(e).__name__}: {e}")
            if status == 401:
                return ServerHealth(url, "unhealthy", f"401 on {path}: wrong or missing api key", key_refused=True)
            learn_liveness_route(url, path, status)  # a 404 on /model_info: vLLM's /version from now on
        if paused:
            return ServerHealth(url, "paused", "paused by the asker: /health not probed")
        if not probe:
            return ServerHealth(url, "up", f"{path} answered")
        try:
            status, _ = await self._probe(url, "/health", probe_timeout_s)
        except no_answer_errors() as e:
            state = _no_answer_state(e)
            why = f"/health did not answer in {probe_timeout_s}s" if state == "unhealthy" else f"/health: {e}"
            return ServerHealth(url, state, why)
        return ServerHealth(url, "ok" if status == 200 else "unhealthy", f"/health {status}")

    async def _probe(self, url: str, path: str, timeout_s: float) -> tuple[int, object]:
        """GET ``path`` for the health check; a server without a pool here (one being watched, not
        called) gets a pool for this one GET, so that a watchdog leaves no pool behind."""
        if url in self._pools or self.transport != "native" or not url.startswith("http://"):
            return await self.request(url, "GET", path, timeout_s=timeout_s, fresh=True)
        pool = ConnectionPool(url, api_key=self.api_key, connect_timeout_s=self.connect_timeout_s,
                              max_body_bytes=self.max_body_bytes)
        try:
            resp = await pool.request("GET", path, None, timeout_s)
        finally:
            pool.close()
        return resp.status, _decode(bytes(resp.body), resp.content_type)

    async def close(self) -> None:
        self.closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        for s in (self._session, self._fresh_session):
            if s is not None:
                await s.close()
        self._session = self._fresh_session = None

    async def __aenter__(self) -> ServerCalls:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# ------------------------------------------------------------------------------ the blocking wrapper
class BlockingCalls:
    """:class:`ServerCalls` for synchronous code (threads, start-up code, the trainer's weight sync):
    the calls run on an event loop of their own in a daemon thread; every method may be called
    from any thread, a running event loop's included (it then blocks that loop, as any blocking
    call does)."""

    def __init__(self, **options):
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._calls: ServerCalls | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-calls", daemon=True)
        self._thread.start()
        self._closed = False

    def _on_loop(self, fn: Callable[[ServerCalls], Awaitable]) -> Future:
        if self._closed:
            raise RolloutError("BlockingCalls used after close()")

        async def run():
            if self._calls is None:
                self._calls = ServerCalls(**self._options)
            return await fn(self._calls)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def run(self, fn: Callable[[ServerCalls], Awaitable]) -> Future:
        """``await fn(calls)`` started now on the calls' loop; its ``concurrent.futures.Future``."""
        return self._on_loop(fn)

    def submit(self, url: str, method: str, path: str, body: dict | None = None, **kw) -> Future:
        """:meth:`ServerCalls.call` started now; its ``concurrent.futures.Future``."""
        return self._on_loop(lambda c: c.call(url, method, path, body, **kw))

    def call(self, url: str, method: str, path: str, body: dict | None = None, **kw):
        """:meth:`ServerCalls.call`, waited for."""
        return self.submit(url, method, path, body, **kw).result()

    def request(self, url: str, method: str, path: str, body: dict | None = None, **kw) -> tuple[int, object]:
        """:meth:`ServerCalls.request`, waited for: ``(status, decoded body)`` whatever the status."""
        return self._on_loop(lambda c: c.request(url, method, path, body, **kw)).result()

    def health(self, url: str, **kw) -> ServerHealth:
        """:meth:`ServerCalls.health`, waited for."""
        return self._on_loop(lambda c: c.health(url, **kw)).result()

    def close(self) -> None:
        """Cancel the calls still running, close the connections and stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            me = asyncio.current_task()
            for t in asyncio.all_tasks():
                if t is not me:
                    t.cancel()
            if self._calls is not None:
                await self._calls.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> BlockingCalls:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: BlockingCalls | None = None
_shared_lock = threading.Lock()


def _forget_shared_calls_after_fork() -> None:
    """A forked child has none of its parent's threads: the shared calls' loop thread is gone, and
    a call queued on its loop would wait forever (a run forked after its parent checked a server's
    health hung at its end this way). The child makes its own on first use."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_shared_calls_after_fork)


def health_now(url: str, *, api_key: str | None = None, **kw) -> ServerHealth:
    """The one health check from synchronous code (:meth:`ServerCalls.health`'s options), on a
    fresh connection; the launchers' start-up wait and watchdogs ask this."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BlockingCalls()

    async def once(_calls):
        async with ServerCalls(api_key=api_key) as calls:
            return await calls.health(url, **kw)

    return _shared._on_loop(once).result()


# ------------------------------------------------------------------------ the dead-server retry
async def dead_servers(urls: Collection[str], is_dead: Callable[[str], bool],
                       policy: RetryPolicy = DEAD_SERVER_RETRY) -> list[str]:
    """The servers of ``urls`` whose process is gone: asked at once, then every ``policy``
    backoff until one shows or ``policy.deadline_s`` passed (a connection reset arrives before
    the exit is visible). ``is_dead`` runs in a thread: it may probe a slow server."""
    deadline = time.monotonic() + (policy.deadline_s or 0.0)
    while True:  # all asked at once: a hung server's probe (its hang timeout) delays no other
        verdicts = await asyncio.gather(*(asyncio.to_thread(is_dead, u) for u in urls))
        dead = [u for u, d in zip(urls, verdicts) if d]
        if dead or time.monotonic() > deadline:
            return dead
        await asyncio.sleep(policy.wait_s(0))


async def retry_dropping_dead(fn: Callable[[], Awaitable], urls: Callable[[], list[str]],
                              is_dead: Callable[[str], bool], remove: Callable[[str], object], what: str,
                              policy: RetryPolicy = DEAD_SERVER_RETRY):
    """``await fn()`` (a call on every server of ``urls()``); when it fails, the servers that
    :func:`dead_servers` finds are removed (``remove(url)``) and it is called again, up to
    ``policy.attempts`` times; so is it when a server left the pool while it ran (a watchdog dropped
    it). A failure with every server alive, or on the last attempt, is raised as it is."""
    attempt = 0
    while True:
        before = list(urls())
        try:
            return await fn()
        except Exception:
            left = [u for u in before if u not in urls()]
            dead = await dead_servers(urls(), is_dead, policy) if not left else []
            if not (dead or left) or (policy.attempts is not None and attempt + 1 >= policy.attempts):
                raise
            for u in dead:
                log.warning("%s: server %s died; continuing with the others", what, u)
                remove(u)
        attempt += 1


# ------------------------------------------------------------------------------------------ helpers
_JSON_HEADERS = {"Content-Type": "application/json"}


def _decode(raw: bytes, ctype: str):
    if "json" in ctype:
        try:
            return loads(raw) if raw else None
        except ValueError:
            pass
    return raw.decode("utf-8", "replace")


def _aiohttp_if_loaded():
    import sys

    return sys.modules.get("aiohttp")  # an aiohttp error exists only where aiohttp was imported


_URLS: dict[tuple[str, str], object] = {}


def _yarl_url(base: str, path: str):
    """The parsed URL of ``base + path``, built once: aiohttp parses a string URL on every request."""
    u = _URLS.get((base, path))
    if u is None:
        import yarl

        if len(_URLS) > 65_536:
            _URLS.clear()
        u = _URLS[(base, path)] = yarl.URL(base + path)
    return u


async def _read_at_most(r, limit: int, where: str) -> bytes:
    """An aiohttp answer's body, refused (aiohttp.ClientPayloadError) past ``limit`` bytes."""
    import aiohttp

    if r.content_length is not None and r.content_length > limit:
        raise aiohttp.ClientPayloadError(f"{where}: answer body of {r.content_length} bytes over the limit of {limit}")
    parts, n = [], 0
    async for chunk in r.content.iter_any():
        n += len(chunk)
        if n > limit:
            raise aiohttp.ClientPayloadError(f"{where}: answer body over the limit of {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
