"""The rollout client's server pool: each server's facts, the calls to it, routing, dead servers.

``RolloutClient`` (``areal_fast.rollout.client``) is this pool plus the generate path (that module)
and the control of every server (``areal_fast.rollout.client_control``). This part owns:

- ``ServerState``: one server's facts as its backend adapter read them (release, tp size, the
  weight version seen last: :func:`apply_server_info`), its requests in flight and its down-until time;
- the lifecycle of the client's ``ServerCalls`` (``areal_fast.rollout.calls``): one connection
  pool per server, opened by ``start`` and closed by ``close``;
- ``_call`` / ``_request``: every HTTP call the client makes, with its ``RetryPolicy``;
- routing (``_pick``): a rid sticks to its server; otherwise the least loaded of all (up to
  ``PICK_SCAN_MAX`` servers) or the less loaded of two drawn at random;
- dead-server bookkeeping: a server that gave no answer is skipped until ``down_until``
  (``down_cooldown_s``), ``add_server`` / ``remove_server`` change the pool, and ``health`` is the
  one health check a watchdog asks before it declares a server dead. The last server is removed
  only with ``allow_empty`` (rank 0: a server can come back, ``elastic.empty_pool``); new segments
  then wait in ``_wait_for_servers`` until ``add_server``.

The attributes it reads are set by ``RolloutClient.__init__``; ``health`` reads ``is_paused``
(``ServerControl``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from areal_fast.http.pool import ConnectionPool
from areal_fast.rollout.answer import tune_gc
from areal_fast.rollout.calls import (
    HEALTH_PROBE_TIMEOUT_S,
    RequestError,
    RetryPolicy,
    RolloutError,
    ServerCalls,
    ServerHealth,
    check_server_url,
)

PICK_SCAN_MAX = 16  # up to this many servers a new request goes to the least loaded of all


class ServerUnavailable(RolloutError):
    """No server could answer after every retry."""


@dataclass
class ServerState:
    """One server of the pool: its facts (empty ``info`` until /server_info answered), its load and
    until when it is skipped after a failure."""

    url: str
    version: Version = field(default_factory=lambda: Version("0"))
    tp_size: int = 1
    info: dict = field(default_factory=dict)  # empty until /server_info answered: re-read before use
    weight_version: str | None = None  # the latest current version seen (answers, /model_info)
    in_flight: int = 0
    down_until: float = 0.0
    pool: ConnectionPool | None = field(default=None, repr=False)  # its calls' pool (http "native")


class ServerPool:
    """The servers of a ``RolloutClient``, the calls to them and the choice of one; see the module
    docstring."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._calls is None:
            self._calls = ServerCalls(api_key=self.api_key, connect_timeout_s=self.connect_timeout_s,
                                      transport=self.http)
            for s in self.servers:
                self._open_pool(s)
        infos = await asyncio.gather(*(self._read_info(s) for s in self.servers), return_exceptions=True)
        refused = [i for i in infos if isinstance(i, RequestError)]
        if refused:  # e.g. 401: a wrong or missing api key is the caller's bug, not a down server
            raise refused[0]
        if all(isinstance(i, BaseException) for i in infos):
            raise ServerUnavailable(f"no server answered {self.INFO_PATH}: {infos[0]!r}")
        for s, info in zip(self.servers, infos):
            if isinstance(info, BaseException):  # down for now; its facts are read again before use
                s.down_until = time.monotonic() + self.down_cooldown_s
        if self.gc_tuning:  # the process's start-up objects are frozen, young collections made rarer
            tune_gc()

    def _open_pool(self, server: ServerState) -> None:
        """Calls to ``server`` go through our own HTTP client (``areal_fast.http.pool``) for
        http:// servers; https:// ones (and ``http="aiohttp"``) through aiohttp (``rollout.calls``)."""
        server.pool = self._calls.pool(server.url)

    async def close(self) -> None:
        for s in self.servers:
            s.pool = None
        if self._calls is not None:
            calls, self._calls = self._calls, None
            await calls.close()

    async def __aenter__(self):
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _read_info(self, s: ServerState) -> dict:
        """Read ``s``'s facts (release, tp size, current weight version) into it: the backend
        adapter's call (:func:`apply_server_info` records them); returns ``s.info``."""
        raise NotImplementedError(f"{type(self).__name__} reads no server facts: a backend adapter does")

    def _caller_500(self, server: ServerState) -> bool:
        """Whether a 500 naming a TypeError from ``server`` blames the request (``calls.is_caller_error``):
        taken so for a server whose facts are not known; the adapter says for a known release."""
        return not server.info

    async def _ensure_info(self, servers: list[ServerState]) -> None:
        """Read the facts of servers that were down when last asked (they are used right after)."""
        missing = [s for s in servers if not s.info]
        if missing:
            await asyncio.gather(*(self._read_info(s) for s in missing), return_exceptions=True)

    # ------------------------------------------------------------------ HTTP
    def _server_calls(self) -> ServerCalls:
        if self._calls is None:
            raise RolloutError("client not started: use 'async with RolloutClient(...)' or await start()")
        return self._calls

    async def _request(self, server: ServerState, method: str, path: str, body: dict | None = None,
                       timeout_s: float | None = None, parse=None, control: bool = False,
                       max_body: int | None = None) -> tuple[int, object]:
        """One HTTP call, sent once (``ServerCalls.request``): (status, decoded body). ``control``
        calls go on a new connection where aiohttp carries them."""
        return await self._server_calls().request(
            server.url, method, path, body, timeout_s=timeout_s or self.control_timeout_s, max_body=max_body,
            parse=parse, fresh=control)

    async def _call(self, server: ServerState, method: str, path: str, body: dict | None = None,
                    timeout_s: float | None = None, parse=None, control: bool = False,
                    max_body: int | None = None, policy: RetryPolicy | None = None):
        """One HTTP call that must succeed: the decoded answer, else RequestError / ServerError."""
        policy = policy or self._once(timeout_s or self.control_timeout_s)
        return await self._server_calls().call(
            server.url, method, path, body, policy=policy, caller_500=self._caller_500(server),
            parse=parse, max_body=max_body, fresh=control)

    def _once(self, timeout_s: float) -> RetryPolicy:
        """The policy of a call sent once within ``timeout_s`` (made once per timeout: /generate uses it)."""
        policy = self._policies.get(timeout_s)
        if policy is None:
            policy = self._policies[timeout_s] = RetryPolicy(timeout_s=timeout_s)
        return policy

    # ------------------------------------------------------------------ pool membership
    def remove_server(self, url: str) -> bool:
        """Drop ``url`` from the pool; requests in flight there fail over to the others. False if unknown."""
        url = url.rstrip("/")
        if url not in self._by_url:
            return False
        if len(self.servers) == 1 and not self.allow_empty:
            raise RolloutError(f"cannot remove {url}: it is the last server of the pool")
        gone = self._by_url.pop(url)
        if self._calls is not None:  # its connections close now: requests in flight there fail over at once
            self._calls.forget(url)
        gone.pool = None
        self.servers = [s for s in self.servers if s.url != url]
        for rid in [r for r, u in self._affinity.items() if u == url]:
            del self._affinity[rid]
        if not self.servers:  # allow_empty: new segments wait in _wait_for_servers until add_server
            self._filled.clear()
        return True

    async def _wait_for_servers(self) -> None:
        """Until the pool holds a server again (an empty pool: ``allow_empty``). No deadline here:
        rank 0's watchdog ends the run past ``rollout.empty_pool_timeout`` (``elastic.empty_pool``)."""
        while not self.servers:
            self._filled.clear()
            await self._filled.wait()

    async def add_server(self, url: str) -> None:
        """Add ``url`` to the pool (its facts are read first, ``_read_info``)."""
        check_server_url(url)
        server = ServerState(url.rstrip("/"))
        if server.url in self._by_url:
            return
        await self._read_info(server)
        if self._calls is not None:
            self._open_pool(server)
        self.servers.append(server)
        self._by_url[server.url] = server
        self._filled.set()

    async def health(self, url: str) -> ServerHealth:
        """Is the server at ``url`` alive? Safe for a watchdog during pauses and weight updates: the
        one health check (``ServerCalls.health``). Any answer from /model_info means the process is
        up; while we have the servers paused /health is not asked (SGLang's probe answers 503
        after ~20 s of a pause, which says nothing about the process); otherwise /health runs the
        probe (up to ``HEALTH_PROBE_TIMEOUT_S``): 200 is "ok", anything else "unhealthy"."""
        return await self._server_calls().health(url, paused=self.is_paused, timeout_s=self._short_timeout_s,
                                                 probe_timeout_s=HEALTH_PROBE_TIMEOUT_S)

    def _pick(self, rid: str, exclude: set[str]) -> ServerState:
        now = time.monotonic()
        url = self._affinity.get(rid)
        if url and url in self._by_url and url not in exclude and self._by_url[url].down_until <= now:
            return self._by_url[url]
        if len(self.servers) > PICK_SCAN_MAX and not exclude:
            # the less loaded of two servers drawn at random (balances nearly as well as the least
            # loaded of all); scanning 256 servers per request cost ~50 us, ~0.15 us per token
            two = [s for s in self._rng.sample(self.servers, 2) if s.down_until <= now]
            if two:
                best = min(two, key=lambda s: s.in_flight)
                self._affinity[rid] = best.url
                return best
        cands = [s for s in self.servers if s.url not in exclude and s.down_until <= now]
        if not cands:  # everything down or excluded: try the least recently failed anyway
            cands = [s for s in self.servers if s.url not in exclude] or self.servers
        best = min(cands, key=lambda s: (s.in_flight, s.down_until))
        self._affinity[rid] = best.url
        return best


def str_or_none(v) -> str | None:
    """A weight version as the client keeps it: ``None`` stays ``None``, anything else its ``str``
    (servers send versions as strings or numbers). For backend adapters reading a server's answer."""
    return None if v is None else str(v)


def apply_server_info(server: ServerState, info) -> None:
    """Record a server's facts on ``server``: ``info`` (a dict; anything else is taken as empty),
    ``version`` from its "version" field (unparseable or absent: 0, the most conservative: the
    oldest behaviour of every gate) and ``tp_size`` (default 1). For backend adapters' ``_read_info``."""
    server.info = info if isinstance(info, dict) else {}
    try:
        server.version = Version(str(server.info.get("version", "0")))
    except InvalidVersion:
        server.version = Version("0")
    server.tp_size = int(server.info.get("tp_size", 1))
