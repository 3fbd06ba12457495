"""Asyncio client for SGLang servers and the embedded engine (the HTTP contract: ``docs/sglang.md``).

    client = RolloutClient(["http://127.0.0.1:30000", ...])
    async with client:                       # opens the session, reads /get_server_info of every server
        res = await client.generate(prompt_ids, {"max_new_tokens": 256, "temperature": 1.0}, rid="q1-s0")
        res.output_ids, res.output_logprobs, res.output_versions, res.finish_reason

Interruptible generation: when a segment comes back with ``finish_reason.type == "abort"`` (a pause in
mode abort, or an update with abort_all_requests) the client waits until ``continue_all()`` (if it
paused the servers itself), then resubmits ``prompt + output so far`` with ``max_new_tokens`` reduced
by what it already has, and appends the new segment. Tokens, logprobs and per-token weight versions
are only ever appended from *completed* HTTP answers, so a token cannot be lost or duplicated at a
seam; each token keeps the version of the weights that produced it. An explicit ``abort(rid)`` ends
the request: its finish reason is ``"length"`` (a truncated sample) with ``aborted=True``.

Server pool: a request sticks to one server (rid affinity); new requests go to the server with the
fewest requests in flight. 5xx answers, connection errors and timeouts mark the server down for
``down_cooldown_s`` and retry the same segment elsewhere; 4xx raises ``RequestError`` at once.

Weight sync (order of the spec, begin/end only on servers >= 0.5.21)::

    await client.pause_all(); await client.flush_cache_all(); await client.begin_weight_update_all()
    # trainer: broadcast tensors from rank 0 on a thread that is NOT this event loop's thread, while
    # this loop awaits client.update_weights_from_distributed(names, dtypes, shapes, weight_version="3")
    await client.end_weight_update_all(); await client.continue_all()
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from packaging.version import InvalidVersion, Version

V_PAUSE_MODE = Version("0.5.6")  # pause_generation accepts {"mode": ...}
V_BEGIN_END = Version("0.5.21")  # begin_weight_update / end_weight_update exist
_INT_RE = re.compile(r"^-?\d+$")


class RolloutError(RuntimeError):
    """Base class of the client's errors."""


class RequestError(RolloutError):
    """A 4xx answer: the request itself is wrong; never retried."""

    def __init__(self, url: str, status: int, body: object):
        super().__init__(f"{url} answered {status}: {body}")
        self.url, self.status, self.body = url, status, body


class ServerUnavailable(RolloutError):
    """No server could answer after every retry."""


def version_to_int(v: str | int | None) -> int:
    """Server weight_version string -> int: "7" -> 7, "default" (the initial weights) -> 0, else -1."""
    if isinstance(v, int):
        return v
    if v is not None and _INT_RE.match(v):
        return int(v)
    return 0 if v in (None, "default") else -1


@dataclass
class GenerateResult:
    """A finished (possibly stitched) generation."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length"
    matched: int | str | None = None  # the stop token / string for "stop"
    aborted: bool = False  # ended by an explicit abort (reported as "length")
    num_segments: int = 1  # HTTP answers stitched together
    servers: list[str] = field(default_factory=list)
    latency_s: float = 0.0


@dataclass
class ServerState:
    url: str
    version: Version = field(default_factory=lambda: Version("0"))
    tp_size: int = 1
    info: dict = field(default_factory=dict)
    in_flight: int = 0
    down_until: float = 0.0


class RolloutClient:
    """Pool of SGLang-compatible servers; see the module docstring."""

    def __init__(self, urls: list[str], *, api_key: str | None = None, request_timeout_s: float = 3600.0,
                 connect_timeout_s: float = 10.0, control_timeout_s: float = 600.0, max_attempts: int = 6,
                 retry_backoff_s: float = 0.2, down_cooldown_s: float = 5.0, max_segments: int = 10_000):
        if not urls:
            raise ValueError("RolloutClient needs at least one server url")
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self._by_url = {s.url: s for s in self.servers}
        self.api_key = api_key
        self.request_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self.control_timeout = aiohttp.ClientTimeout(total=control_timeout_s, sock_connect=connect_timeout_s)
        self.max_attempts, self.retry_backoff_s = max_attempts, retry_backoff_s
        self.down_cooldown_s, self.max_segments = down_cooldown_s, max_segments
        self._session: aiohttp.ClientSession | None = None
        self._affinity: dict[str, str] = {}
        self._segment_rid: dict[str, tuple[str, str]] = {}  # rid -> (server url, rid of the live segment)
        self._user_aborted: set[str] = set()
        self._active: set[str] = set()
        self._running = asyncio.Event()
        self._running.set()
        self.paused = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
        await self.detect_versions()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def detect_versions(self) -> None:
        """Read ``version`` and ``tp_size`` of every server from GET /get_server_info."""
        infos = await asyncio.gather(*(self._call(s, "GET", "/get_server_info") for s in self.servers),
                                     return_exceptions=True)
        if all(isinstance(i, BaseException) for i in infos):
            raise ServerUnavailable(f"no server answered GET /get_server_info: {infos[0]!r}")
        for s, info in zip(self.servers, infos):
            if isinstance(info, BaseException):  # down for now; generate() retries it after the cooldown
                s.down_until = time.monotonic() + self.down_cooldown_s
                info = {}
            _apply_info(s, info)

    # ------------------------------------------------------------------ HTTP
    async def _call(self, server: ServerState, method: str, path: str, body: dict | None = None,
                    timeout: aiohttp.ClientTimeout | None = None, ok_400: bool = False):
        """One HTTP call; returns the decoded answer (JSON, text or None). 4xx -> RequestError."""
        if self._session is None:
            raise RolloutError("client not started: use 'async with RolloutClient(...)' or await start()")
        kwargs = {"timeout": timeout or self.control_timeout}
        if method == "POST":
            kwargs["json"] = body if body is not None else {}
        async with self._session.request(method, server.url + path, **kwargs) as r:
            text = await r.text()
            ctype = r.headers.get("Content-Type", "")
            data = _decode(text, ctype)
            if 400 <= r.status < 500 and not (ok_400 and r.status == 400):
                raise RequestError(server.url + path, r.status, data)
            if r.status >= 500:
                raise aiohttp.ClientResponseError(r.request_info, r.history, status=r.status, message=str(data))
            return (r.status, data) if ok_400 else data

    # ------------------------------------------------------------------ pool membership
    def remove_server(self, url: str) -> bool:
        """Drop ``url`` from the pool; requests in flight there fail over to the others. False if unknown."""
        url = url.rstrip("/")
        if url not in self._by_url:
            return False
        if len(self.servers) == 1:
            raise RolloutError(f"cannot remove {url}: it is the last server of the pool")
        self.servers = [s for s in self.servers if s.url != url]
        del self._by_url[url]
        for rid in [r for r, u in self._affinity.items() if u == url]:
            del self._affinity[rid]
        return True

    async def add_server(self, url: str) -> None:
        """Add ``url`` to the pool (its version is read from /get_server_info first)."""
        server = ServerState(url.rstrip("/"))
        if server.url in self._by_url:
            return
        _apply_info(server, await self._call(server, "GET", "/get_server_info"))
        self.servers.append(server)
        self._by_url[server.url] = server

    def _pick(self, rid: str, exclude: set[str]) -> ServerState:
        now = time.monotonic()
        url = self._affinity.get(rid)
        if url and url in self._by_url and url not in exclude and self._by_url[url].down_until <= now:
            return self._by_url[url]
        cands = [s for s in self.servers if s.url not in exclude and s.down_until <= now]
        if not cands:  # everything down or excluded: try the least recently failed anyway
            cands = [s for s in self.servers if s.url not in exclude] or self.servers
        best = min(cands, key=lambda s: (s.in_flight, s.down_until))
        self._affinity[rid] = best.url
        return best

    async def _generate_segment(self, rid: str, seg_rid: str, payload: dict) -> tuple[dict, str]:
        """POST /generate with failover; returns (answer, server url)."""
        tried: set[str] = set()
        last_err: Exception | None = None
        for attempt in range(self.max_attempts):
            server = self._pick(rid, tried)
            self._segment_rid[rid] = (server.url, seg_rid)
            server.in_flight += 1
            try:
                data = await self._call(server, "POST", "/generate", {**payload, "rid": seg_rid},
                                        timeout=self.request_timeout)
                return data, server.url
            except RequestError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                last_err = e
                server.down_until = time.monotonic() + self.down_cooldown_s
                self._affinity.pop(rid, None)
                tried.add(server.url)
                if len(tried) == len(self.servers):
                    tried.clear()
                    await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
            finally:
                server.in_flight -= 1
        raise ServerUnavailable(f"generate rid={rid!r} failed on every server ({self.max_attempts} attempts): "
                                f"{type(last_err).__name__}: {last_err}")

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int], sampling: dict | None = None, rid: str | None = None,
                       ) -> GenerateResult:
        """Generate to completion across pauses and weight updates; see the module docstring."""
        if not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        sampling = dict(sampling or {})
        max_new = int(sampling.get("max_new_tokens", 128))
        rid = rid or uuid.uuid4().hex
        if rid in self._active:
            raise ValueError(f"rid {rid!r} is already being generated by this client")
        self._active.add(rid)
        t0 = time.monotonic()
        out_ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        servers: list[str] = []
        finish, matched, aborted, seg = "length", None, False, 0
        try:
            while True:
                remaining = max_new - len(out_ids)
                if remaining <= 0 and seg > 0:
                    break
                if rid in self._user_aborted:
                    aborted = True
                    break
                await self._running.wait()
                payload = {"input_ids": list(input_ids) + out_ids,
                           "sampling_params": {**sampling, "max_new_tokens": remaining},
                           "return_logprob": True, "logprob_start_len": -1, "stream": False}
                data, url = await self._generate_segment(rid, rid if seg == 0 else f"{rid}.{seg}", payload)
                seg += 1
                servers.append(url)
                meta = data["meta_info"]
                ids = list(data["output_ids"])
                seg_lps = [x[0] for x in meta.get("output_token_logprobs") or []]
                if len(seg_lps) != len(ids):
                    raise RolloutError(f"{url}: {len(ids)} output ids but {len(seg_lps)} logprobs (rid {rid})")
                out_ids += ids
                lps += seg_lps
                versions += _token_versions(meta, len(ids))
                fr = meta.get("finish_reason") or {"type": "length"}
                if fr.get("type") == "abort":
                    if rid in self._user_aborted or seg >= self.max_segments:
                        aborted = True
                        break
                    continue  # interrupted (pause / update): wait for continue, resubmit prompt + partial
                finish = "stop" if fr.get("type") == "stop" else "length"
                matched = fr.get("matched")
                break
        finally:
            self._active.discard(rid)
            self._user_aborted.discard(rid)
            self._segment_rid.pop(rid, None)
            self._affinity.pop(rid, None)
        return GenerateResult(rid=rid, input_ids=list(input_ids), output_ids=out_ids, output_logprobs=lps,
                              output_versions=versions, finish_reason=finish, matched=matched, aborted=aborted,
                              num_segments=seg, servers=servers, latency_s=time.monotonic() - t0)

    async def abort(self, rid: str) -> None:
        """End generation ``rid`` (its result comes back with finish_reason "length", aborted=True)."""
        if rid not in self._active:
            return
        self._user_aborted.add(rid)
        live = self._segment_rid.get(rid)
        if live is not None:
            url, seg_rid = live
            if url in self._by_url:
                await self._call(self._by_url[url], "POST", "/abort_request", {"rid": seg_rid, "abort_all": False})

    # ------------------------------------------------------------------ control of all servers
    async def _all(self, method: str, path: str, body: dict | None = None, only=None) -> list:
        targets = [s for s in self.servers if only is None or only(s)]
        return await asyncio.gather(*(self._call(s, method, path, body) for s in targets))

    async def pause_all(self, mode: str = "abort") -> None:
        """Pause every server; interrupted requests wait in ``generate`` until ``continue_all()``."""
        self.paused = True
        self._running.clear()
        await asyncio.gather(*(self._call(s, "POST", "/pause_generation",
                                          {"mode": mode} if s.version >= V_PAUSE_MODE else {})
                               for s in self.servers))

    async def continue_all(self) -> None:
        await self._all("POST", "/continue_generation", {})
        self.paused = False
        self._running.set()

    async def abort_all(self) -> None:
        """Abort every request on every server (interrupted client requests are resubmitted)."""
        await self._all("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def flush_cache_all(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> None:
        """POST /flush_cache on every server, retrying each until it answers 200."""
        async def one(s: ServerState):
            deadline = time.monotonic() + timeout_s
            while True:
                status, body = await self._call(s, "POST", "/flush_cache", ok_400=True)
                if status == 200:
                    return
                if time.monotonic() > deadline:
                    raise RolloutError(f"{s.url}/flush_cache kept answering {status} for {timeout_s}s: {body}")
                await asyncio.sleep(poll_s)

        await asyncio.gather(*(one(s) for s in self.servers))

    async def begin_weight_update_all(self) -> None:
        _check_success(await self._all("POST", "/begin_weight_update", {"selector": "all"},
                                       only=lambda s: s.version >= V_BEGIN_END))

    async def end_weight_update_all(self) -> None:
        _check_success(await self._all("POST", "/end_weight_update", {}, only=lambda s: s.version >= V_BEGIN_END))

    def group_world_size(self) -> int:
        """1 (the trainer, rank 0) + the tensor-parallel sizes of all servers."""
        return 1 + sum(s.tp_size for s in self.servers)

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        group_name: str = "weight_update_group", backend: str = "nccl") -> int:
        """Ask every server to join the group (rank_offset = 1 + tp of the servers before); returns world size.

        The call blocks in the rendezvous until the trainer joins as rank 0, so the trainer must init
        its side concurrently (from another thread or process).
        """
        world, offset, calls = self.group_world_size(), 1, []
        for s in self.servers:
            calls.append(self._call(s, "POST", "/init_weights_update_group", {
                "master_address": master_address, "master_port": master_port, "rank_offset": offset,
                "world_size": world, "group_name": group_name, "backend": backend}))
            offset += s.tp_size
        _check_success(await asyncio.gather(*calls))
        return world

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        _check_success(await self._all("POST", "/destroy_weights_update_group", {"group_name": group_name}))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], *, weight_version: str | None = None,
                                              load_format: str | None = None,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              abort_all_requests: bool = False) -> None:
        """One update call on every server; the trainer broadcasts in ``names`` order meanwhile."""
        body = {"names": names, "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests, "weight_version": weight_version,
                "load_format": load_format}
        _check_success(await self._all("POST", "/update_weights_from_distributed", body))

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> None:
        _check_success(await self._all("POST", "/update_weights_from_disk", {
            "model_path": model_path, "load_format": None, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version}))

    async def sync_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """The whole cycle: pause, flush, begin, load from disk, end, continue."""
        await self.pause_all()
        try:
            await self.flush_cache_all()
            await self.begin_weight_update_all()
            try:
                await self.update_weights_from_disk(model_path, weight_version=weight_version)
            finally:
                await self.end_weight_update_all()
        finally:
            await self.continue_all()

    async def weight_versions(self) -> list[str]:
        """Each server's weight_version (from /get_model_info)."""
        return [str(d.get("weight_version")) for d in await self._all("GET", "/get_model_info")]


def _apply_info(server: ServerState, info) -> None:
    """Record /get_server_info: ``version`` (unparseable -> 0, the most conservative) and ``tp_size``."""
    server.info = info if isinstance(info, dict) else {}
    try:
        server.version = Version(str(server.info.get("version", "0")))
    except InvalidVersion:
        server.version = Version("0")
    server.tp_size = int(server.info.get("tp_size", 1))


def _decode(text: str, ctype: str):
    if "json" in ctype:
        import json

        try:
            return json.loads(text) if text else None
        except ValueError:
            return text
    return text


def _check_success(answers: list) -> None:
    bad = [a for a in answers if isinstance(a, dict) and a.get("success") is False]
    if bad:
        raise RolloutError(f"weight update call failed: {bad[0].get('message')}")


def _token_versions(meta: dict, n: int) -> list[int]:
    """Per-token versions of one answer: from weight_versions spans (>= 0.5.20) or weight_version."""
    spans = meta.get("weight_versions")
    if spans:
        out = [version_to_int(meta.get("weight_version"))] * n
        for sp in spans:
            v = version_to_int(sp.get("version"))
            for i in range(max(0, int(sp["start"])), min(n, int(sp["end"]))):
                out[i] = v
        return out
    return [version_to_int(meta.get("weight_version"))] * n
