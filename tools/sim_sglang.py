"""Simulated SGLang servers: many per process, cheap on CPU, with a batching decode-rate model. They
speak the HTTP subset of docs/sglang.md our rollout client uses, with the real JSON shapes (plus
``/sim_stats``, the cluster's counters). The decode-rate model, the deterministic answers whose
log-probs encode the version that made each token (:func:`logprob_of`, :func:`check_sample`) and the
pre-rendered answers (:class:`_Streams`): docs/scale.md, "The simulated server".

Use: ``SimCluster(n, cfg)`` in-process (``await start()``), or :class:`SimProcess` for a child process
(the client's CPU is then measured alone), which binds port 0 itself and reports its ports.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import math
import os
import resource
import subprocess
import sys
import zlib
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import NormalDist

import numpy as np
from aiohttp import web
from packaging.version import Version

EOS_ID = 1
_FIRST_ID = 2  # ids 0 (pad) and 1 (EOS) are never drawn
_STRIDE = 7919  # a prime: the id at position p is _FIRST_ID + (h + p * _STRIDE) % (vocab - _FIRST_ID)
_V_SPANS = Version("0.5.19")
_V_SESSIONS = Version("0.5.21")
_V_FLUSH_REFUSED = Version("0.5.22")
_OPEN_PATHS = ("/health", "/health_generate")
_NORMAL = NormalDist()

try:  # orjson where installed (the rollout extra): the simulator's JSON is most of its CPU at 256 servers
    from orjson import dumps as _dumps
except ImportError:  # pragma: no cover
    def _dumps(obj) -> bytes:
        return json.dumps(obj).encode()


@dataclass(kw_only=True)
class SimConfig:
    """One simulated server's behaviour (all servers of a cluster share it)."""

    decode_a_s: float = 0.010
    """Model seconds per decode step, independent of the batch (weights read, launch overhead)."""
    decode_b_s: float = 0.0002
    """Model seconds per decode step per running request."""
    decode_c_s: float = 0.0
    """Model seconds per decode step per context token of the running requests (KV reads)."""
    prefill_tokens_per_s: float = 50_000.0
    """Prefill rate (model tokens / model second) for admitted, resubmitted and retracted requests."""
    max_running: int = 256
    """Requests decoding at once (SGLang's --max-running-requests); the rest wait."""
    len_median: float = 4000.0
    """Median answer length in model tokens (log-normal)."""
    len_sigma: float = 1.0
    """Log-normal sigma of the answer length (1.0: 1.9% of answers reach 8x the median)."""
    len_max: int = 32768
    """Cap on the answer length in model tokens (the context budget)."""
    tokens_per_token: int = 1
    """Model tokens (decode steps) behind each returned token: S."""
    time_scale: float = 1.0
    """Time compression K: wall seconds = model seconds / K."""
    vocab_size: int = 32000
    seed: int = 0
    sglang_version: str = "0.5.23"
    api_key: str | None = None
    reference_renderer: bool = False
    """Build answers token by token (:meth:`SimServer.render_reference`): to measure what the
    pre-rendered streams save."""
    disable_overlap_schedule: bool = False
    """SGLang's --disable-overlap-schedule (reported in /server_info; an in_place pause needs it):
    every decode step then takes ``no_overlap_slowdown`` times as long (the CPU work the overlap
    scheduler hides is exposed)."""
    disable_radix_cache: bool = False
    """SGLang's --disable-radix-cache (reported in /server_info; an in_place pause needs it). The
    simulator never shares prefixes, so it changes nothing else (docs/pause_modes.md)."""
    no_overlap_slowdown: float = 1.0
    """Decode step time multiplier with ``disable_overlap_schedule`` (1.0: free)."""

    def __post_init__(self):
        if not self.no_overlap_slowdown >= 1.0:
            raise ValueError(f"SimConfig.no_overlap_slowdown must be >= 1, got {self.no_overlap_slowdown!r}")
        for name in ("decode_a_s", "prefill_tokens_per_s", "len_median", "time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("decode_b_s", "decode_c_s", "len_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_running", "len_max", "tokens_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.vocab_size < 1002:
            raise ValueError(f"SimConfig.vocab_size must be >= 1002 (log-probs encode id % 1000), "
                             f"got {self.vocab_size}")
        if (self.vocab_size - _FIRST_ID) % _STRIDE == 0:  # every rid's ids are a window of one stream
            raise ValueError(f"SimConfig.vocab_size - {_FIRST_ID} must not be a multiple of {_STRIDE}, "
                             f"got {self.vocab_size}")
        Version(self.sglang_version)  # InvalidVersion names the value

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SimConfig:
        d = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"SimConfig: unknown key {unknown[0]!r}")
        return cls(**d)


# ----------------------------------------------------------------------------- determinism


def base_rid(rid: str) -> str:
    """The caller's rid: the part before the first '|' (the client sends segment k as 'R|k|')."""
    return rid.split("|", 1)[0]


def _rid_hash(base: str, seed: int) -> int:
    return zlib.crc32(f"{seed}:{base}".encode())


def answer_length(base: str, cfg: SimConfig) -> int:
    """Returned tokens of the full answer to caller rid ``base`` (EOS included), >= 1."""
    h = _rid_hash(base, cfg.seed)
    u = (h % 1_000_003 + 0.5) / 1_000_003
    model_len = min(cfg.len_max, cfg.len_median * math.exp(cfg.len_sigma * _NORMAL.inv_cdf(u)))
    return max(1, math.ceil(model_len / cfg.tokens_per_token))


def token_id(h: int, position: int, vocab: int) -> int:
    """The token at sequence position ``position`` of the rid hashed to ``h`` (never 0 or EOS)."""
    return _FIRST_ID + (h + position * _STRIDE) % (vocab - _FIRST_ID)


LP_SCALE = float(1 << 24)
"""Log-probs are -k / 2**24 with an integer k < 2**24: exact in JSON, in float64 and in float32."""
MAX_VERSION = ((1 << 24) - 1) // 1000 - 1  # 16,775: the newest version the log-prob encoding holds


def logprob_of(version: int, tok: int) -> float:
    """Encodes the version that made a token and the token (-k / 2**24, k = version * 1000 + tok % 1000 + 1):
    k < 2**24, so the value survives a float32 column exactly (any version up to :data:`MAX_VERSION`)."""
    return -(version * 1000 + tok % 1000 + 1) / LP_SCALE


def decode_logprob(lp: float) -> tuple[int, int]:
    """(version, token id % 1000) from :func:`logprob_of` (after a float32 round trip too)."""
    k = round(-lp * LP_SCALE) - 1
    return k // 1000, k % 1000


def expected_output(rid: str, prompt_len: int, max_new_tokens: int, cfg: SimConfig) -> tuple[list[int], str]:
    """The output ids and finish reason ("stop" / "length") a full generation of ``rid`` must have."""
    n_full = answer_length(rid, cfg)
    n = min(n_full, max_new_tokens)
    h = _rid_hash(rid, cfg.seed)
    ids = [token_id(h, prompt_len + i, cfg.vocab_size) for i in range(n)]
    if n == n_full:
        ids[-1] = EOS_ID
        return ids, "stop"
    return ids, "length"


def check_sample(rid: str, prompt_len: int, max_new_tokens: int, output_ids, output_logprobs, output_versions,
                 finish_reason: str, cfg: SimConfig, max_version: int | None = None) -> list[str]:
    """Everything wrong with one finished sample (empty when exact): ids, finish reason, and each
    token's reported version against the version encoded in its log-prob (the weights that made it).
    Columns may be lists or arrays; the comparison is vectorised (a few ns a token), so the checks do
    not bound the rate of a run with every sample checked."""
    errs = []
    ids, lps, vers = (np.asarray(x) for x in (output_ids, output_logprobs, output_versions))
    ids = ids.astype(np.int64, copy=False)
    n_full = answer_length(rid, cfg)
    n = min(n_full, max_new_tokens)
    want = _FIRST_ID + (_rid_hash(rid, cfg.seed) + np.arange(prompt_len, prompt_len + n, dtype=np.int64) * _STRIDE) \
        % (cfg.vocab_size - _FIRST_ID)
    want_finish = "length"
    if n == n_full:
        want[-1] = EOS_ID
        want_finish = "stop"
    m = min(len(ids), n)
    if len(ids) != n or not np.array_equal(ids, want):
        diff = np.flatnonzero(ids[:m] != want[:m])
        first = int(diff[0]) if len(diff) else m
        errs.append(f"{rid}: output ids differ from position {first} (got {len(ids)} ids, want {n})")
    if finish_reason != want_finish:
        errs.append(f"{rid}: finish_reason {finish_reason!r}, want {want_finish!r}")
    if not (len(lps) == len(vers) == len(ids)):
        errs.append(f"{rid}: {len(ids)} ids, {len(lps)} logprobs, {len(vers)} versions")
        return errs
    k = np.rint(-lps.astype(np.float64) * LP_SCALE).astype(np.int64) - 1
    vers = vers.astype(np.int64, copy=False)
    bad = np.flatnonzero((k // 1000 != vers) | (k % 1000 != ids % 1000))
    if len(bad):
        i = int(bad[0])
        errs.append(f"{rid}: token {i} reported version {int(vers[i])}, made by version {int(k[i] // 1000)} "
                    f"(logprob {float(lps[i])!r})")
    if len(vers) > 1 and bool((np.diff(vers) < 0).any()):
        errs.append(f"{rid}: versions go back in time")
    if max_version is not None and len(vers) and int(vers[-1]) > max_version:
        errs.append(f"{rid}: version {int(vers[-1])} newer than the newest published {max_version}")
    return errs


# ----------------------------------------------------------------------------- one server


class _Streams:
    """Pre-rendered answer bytes. Every rid's ids are a window of one cycle: with M = vocab - 2 and
    q = h / 7919 mod M, the id at position p of the rid hashed to h is the cycle's entry (p + q) mod M.
    The cycle's ids, and once per version its ``[logprob,id,null]`` triples, are rendered once (each
    followed by a comma, with byte offsets per entry); an answer is slices of them joined. Versions
    are kept most recent first, ``keep`` of them (a retracted answer's spans may name old ones)."""

    def __init__(self, vocab: int, keep: int = 64):
        self.m = vocab - _FIRST_ID
        self.inv = pow(_STRIDE, -1, self.m)
        self.ids = [token_id(0, j, vocab) for j in range(self.m)]
        self.id_blob, self.id_off = self._blob([b"%d," % t for t in self.ids])
        self.keep = keep
        self.lps: dict[int, tuple[bytes, list[int]]] = {}
        self.renders = 0  # versions rendered (a metric: each costs ~M dumps)

    @staticmethod
    def _blob(parts: list[bytes]) -> tuple[bytes, list[int]]:
        off, t = [0], 0
        for b in parts:
            t += len(b)
            off.append(t)
        return b"".join(parts), off

    def phase(self, h: int) -> int:
        return h * self.inv % self.m

    def _lp(self, version: int) -> tuple[bytes, list[int]]:
        got = self.lps.pop(version, None)
        if got is None:
            got = self._blob([_dumps([logprob_of(version, t), t, None]) + b"," for t in self.ids])
            self.renders += 1
            while len(self.lps) >= self.keep:
                del self.lps[next(iter(self.lps))]
        self.lps[version] = got  # most recently used last
        return got

    def _slices(self, blob: bytes, off: list[int], start: int, n: int) -> list[bytes]:
        out, j = [], start % self.m
        while n > 0:
            k = min(n, self.m - j)
            out.append(blob[off[j]:off[j + k]])
            n -= k
            j = 0
        return out

    def id_slices(self, start: int, n: int) -> list[bytes]:
        return self._slices(self.id_blob, self.id_off, start, n)

    def lp_slices(self, version: int, start: int, n: int) -> list[bytes]:
        return self._slices(*self._lp(version), start, n)

    def eos_triple(self, version: int) -> bytes:
        return _dumps([logprob_of(version, EOS_ID), EOS_ID, None]) + b","


class _Req:
    __slots__ = ("rid", "base", "h", "prompt_len", "before", "target", "final_stop", "done", "start", "spans",
                 "fut")

    def __init__(self, rid, base, h, prompt_len, before, target, final_stop, version, fut):
        self.rid, self.base, self.h = rid, base, h
        self.prompt_len, self.before, self.target, self.final_stop = prompt_len, before, target, final_stop
        self.done = 0  # tokens of this segment made (frozen while not running)
        self.start: float | None = None  # server progress when the segment's token 0 would have started
        self.spans = [[version, 0]]  # [version, first token index] of this segment
        self.fut = fut

    def key(self) -> float:
        return self.start + self.target


class SimServer:
    """One simulated server; see the module docstring. All times are ``loop.time()`` seconds."""

    def __init__(self, cluster: SimCluster, index: int):
        self.cluster, self.cfg, self.index = cluster, cluster.cfg, index
        self.version_behaviour = Version(self.cfg.sglang_version)
        self.weight_version = 0
        self.paused = False
        self.running: dict[str, _Req] = {}
        self.waiting: deque[_Req] = deque()
        self.heap: list[tuple[float, int, _Req]] = []
        self.progress = 0.0  # returned-token ticks decoded since start
        self.sum_static = 0  # sum of prompt_len + before of running requests (returned tokens)
        self.sum_start = 0.0  # sum of start of running requests
        self.prefill_debt = 0.0  # model seconds of prefill still to do before decoding goes on
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.seq = 0
        self.in_session = False
        self.app = self._make_app()
        self.url = ""

    # ------------------------------------------------------------- the decode model
    def _tick_coeffs(self) -> tuple[float, float]:
        """(alpha, beta): tick k (one returned token for every running request) takes alpha + beta*k
        model seconds from now (the batch's context grows by S tokens per request per tick)."""
        c, s, b = self.cfg, self.cfg.tokens_per_token, len(self.running)
        ctx = s * (self.sum_static + b * self.progress - self.sum_start)
        slow = c.no_overlap_slowdown if c.disable_overlap_schedule else 1.0
        alpha = slow * s * (c.decode_a_s + c.decode_b_s * b + c.decode_c_s * ctx)
        beta = slow * s * c.decode_c_s * s * b
        return alpha, beta

    def _advance(self, now: float) -> None:
        dt = (now - self.last) * self.cfg.time_scale
        self.last = now
        if self.paused or not self.running or dt <= 0:
            return
        use = min(dt, self.prefill_debt)
        self.prefill_debt -= use
        dt -= use
        if dt <= 0:
            return
        self.cluster.decode_busy_s += dt
        alpha, beta = self._tick_coeffs()
        n = dt / alpha if beta == 0 else (-alpha + math.sqrt(alpha * alpha + 2 * beta * dt)) / beta
        self.progress += n

    def _time_for(self, n: float) -> float:
        alpha, beta = self._tick_coeffs()
        return n * alpha + beta * n * n / 2

    def _rearm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.paused or not self.running:
            return
        while self.heap and not self._live(self.heap[0]):
            heapq.heappop(self.heap)
        if not self.heap:
            return
        n = max(0.0, self.heap[0][0] - self.progress)
        wait = (self.prefill_debt + self._time_for(n)) / self.cfg.time_scale
        loop = asyncio.get_running_loop()
        self.timer = loop.call_at(max(self.last, loop.time()) + wait, self._on_timer)

    def _live(self, entry) -> bool:
        key, _, req = entry
        return req.start is not None and self.running.get(req.rid) is req and req.key() == key

    def _on_timer(self) -> None:
        self.timer = None
        self._advance(asyncio.get_running_loop().time())
        eps = 1e-6
        while self.heap:
            key, _, req = self.heap[0]
            if not self._live(self.heap[0]):
                heapq.heappop(self.heap)
                continue
            if key > self.progress + eps:
                break
            heapq.heappop(self.heap)
            self._remove_running(req)
            req.done = req.target
            self._answer(req, "stop" if req.final_stop else "length")
        self._admit()
        self._rearm()

    def _admit(self) -> None:
        while self.waiting and not self.paused and len(self.running) < self.cfg.max_running:
            req = self.waiting.popleft()
            req.start = self.progress - req.done
            self.running[req.rid] = req
            self.sum_static += req.prompt_len + req.before
            self.sum_start += req.start
            tokens = (req.prompt_len + req.before + req.done) * self.cfg.tokens_per_token
            self.prefill_debt += tokens / self.cfg.prefill_tokens_per_s
            if req.before or req.done:  # resubmitted after an abort, or retracted: its KV is computed again
                self.cluster.recomputed_prefill_tokens += tokens
                self.cluster.recomputed_prefill_s += tokens / self.cfg.prefill_tokens_per_s
            self.seq += 1
            heapq.heappush(self.heap, (req.key(), self.seq, req))

    def _remove_running(self, req: _Req) -> None:
        del self.running[req.rid]
        self.sum_static -= req.prompt_len + req.before
        self.sum_start -= req.start
        req.done = min(req.target, int(self.progress - req.start + 1e-6))
        req.start = None

    def _end(self, req: _Req, reason: str) -> None:
        """Answer a request just taken off the batch: finished if all its tokens are made (the
        last one may be EOS), else with ``reason``."""
        self._answer(req, ("stop" if req.final_stop else "length") if req.done >= req.target else reason)

    def _answer(self, req: _Req, reason: str) -> None:
        if not req.fut.done():
            req.fut.set_result(reason)

    def _all_requests(self):
        yield from self.running.values()
        yield from self.waiting

    def _touch(self) -> None:
        """Bring the clock to now before any change of the batch."""
        self._advance(asyncio.get_running_loop().time())

    def ticks(self) -> float:
        """Decode ticks (returned tokens per running request) done since start, brought up to now."""
        self._touch()
        return self.progress

    def _set_version(self, version: int) -> None:
        self._touch()
        for req in self._all_requests():
            done = req.done if req.start is None else min(req.target, int(self.progress - req.start + 1e-6))
            if req.spans[-1][1] == done:
                req.spans[-1][0] = version
            else:
                req.spans.append([version, done])
        self.weight_version = version

    # ------------------------------------------------------------- HTTP
    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.h_generate)
        r.add_post("/pause_generation", self.h_pause)
        r.add_post("/continue_generation", self.h_continue)
        r.add_post("/flush_cache", self.h_flush)
        r.add_get("/flush_cache", self.h_flush)
        r.add_post("/abort_request", self.h_abort)
        for p in ("/server_info", "/get_server_info"):
            r.add_get(p, self.h_server_info)
        for p in ("/model_info", "/get_model_info"):
            r.add_get(p, self.h_model_info)
        for p in _OPEN_PATHS:
            r.add_get(p, self.h_health)
        for p in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                  "/update_weights_from_disk", "/update_weights_from_tensor"):
            r.add_post(p, self.h_update)
        if self.version_behaviour >= _V_SESSIONS:
            r.add_post("/begin_weight_update", self.h_begin)
            r.add_post("/end_weight_update", self.h_end)
        r.add_get("/sim_stats", self.h_stats)
        return app

    @web.middleware
    async def _auth(self, request, handler):
        key = self.cfg.api_key
        if key and request.path not in _OPEN_PATHS and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def h_generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        rid = body.get("rid")
        ids = body.get("input_ids")
        if not isinstance(rid, str) or not isinstance(ids, list) or not ids:
            return web.json_response({"error": "sim: /generate needs a string rid and non-empty input_ids"},
                                     status=400)
        sp = body.get("sampling_params") or {}
        if sp.get("n", 1) not in (1, None):
            return web.json_response({"error": "sim: n > 1 is not simulated"}, status=400)
        if rid in self.running or any(w.rid == rid for w in self.waiting):
            return web.json_response({"error": f"Duplicate request ID {rid}"}, status=400)
        cl = self.cluster
        base = base_rid(rid)
        prompt_len = cl.prompt_len.setdefault(base, len(ids))
        before = len(ids) - prompt_len
        n_full = answer_length(base, self.cfg)
        max_new = int(sp.get("max_new_tokens", 128))
        target = max(0, min(n_full - before, max_new))
        final_stop = before + target == n_full
        cl.generate_calls += 1
        fut = asyncio.get_running_loop().create_future()
        req = _Req(rid, base, _rid_hash(base, self.cfg.seed), prompt_len, before, target, final_stop,
                   self.weight_version, fut)
        if target == 0:
            fut.set_result("stop" if final_stop else "length")
        else:
            self._touch()
            self.waiting.append(req)
            self._admit()
            self._rearm()
        try:
            reason = await fut
        finally:  # the client went away: forget the request
            if not fut.done():
                self._drop(req)
        return self._render(req, reason)

    def _drop(self, req: _Req) -> None:
        self._touch()
        if self.running.get(req.rid) is req:
            self._remove_running(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._admit()
        self._rearm()

    def _render(self, req: _Req, reason: str) -> web.Response:
        n = req.done
        if reason == "stop":
            fr = {"type": "stop", "matched": EOS_ID}
            self.cluster.completed(req.base)
        elif reason == "length":
            fr = {"type": "length", "length": req.before + n}
            self.cluster.completed(req.base)
        else:
            fr = {"type": "abort", "message": "Abort"}
            self.cluster.aborted_answers += 1
        self.cluster.sent_tokens += n
        self.cluster.answers += 1
        render = self.render_reference if self.cluster.reference_renderer else self.render_fast
        return web.Response(body=render(req, reason, fr), content_type="application/json")

    def _spans(self, req: _Req) -> list[tuple[int, int, int]]:
        """(version, start, end) of the answer's tokens, empty spans left out."""
        n, sp = req.done, req.spans
        spans = [(v, s, min(sp[i + 1][1] if i + 1 < len(sp) else n, n)) for i, (v, s) in enumerate(sp)]
        return [(v, s, e) for v, s, e in spans if e > s]

    def _meta(self, req: _Req, fr: dict, spans) -> dict:
        meta = {"id": req.rid, "finish_reason": fr, "prompt_tokens": req.prompt_len + req.before,
                "completion_tokens": req.done, "cached_tokens": 0, "weight_version": str(self.weight_version)}
        if self.version_behaviour >= _V_SPANS:
            meta["weight_versions"] = [{"version": str(v), "start": s, "end": e} for v, s, e in spans]
        return meta

    def render_reference(self, req: _Req, reason: str, fr: dict) -> bytes:
        """The answer's JSON built token by token (the definition :meth:`render_fast` must match)."""
        n, p0 = req.done, req.prompt_len + req.before
        out = [token_id(req.h, p, self.cfg.vocab_size) for p in range(p0, p0 + n)]
        if reason == "stop" and n:
            out[-1] = EOS_ID
        spans = self._spans(req)
        lps = [[logprob_of(v, t), t, None] for v, s, e in spans for t in out[s:e]]
        meta = {"output_token_logprobs": lps} | self._meta(req, fr, spans)
        return _dumps({"output_ids": out, "meta_info": meta})

    def render_fast(self, req: _Req, reason: str, fr: dict) -> bytes:
        """The same JSON as :meth:`render_reference` from slices of pre-rendered streams."""
        n, p0 = req.done, req.prompt_len + req.before
        st = self.cluster.streams
        spans = self._spans(req)
        q = st.phase(req.h)
        body = n - 1 if reason == "stop" and n else n  # a final EOS is rendered on its own
        lp_parts = []
        for v, s, e in spans:
            e = min(e, body)
            if e > s:
                lp_parts += st.lp_slices(v, p0 + s + q, e - s)
        ids_parts = st.id_slices(p0 + q, body)
        if body < n:
            ids_parts.append(b"1,")
            lp_parts.append(st.eos_triple(spans[-1][0]))
        for parts in (ids_parts, lp_parts):  # each entry ends with a comma: not the last one
            if parts:
                parts[-1] = parts[-1][:-1]
        meta = _dumps(self._meta(req, fr, spans))
        return b"".join([b'{"output_ids":[', *ids_parts, b'],"meta_info":{"output_token_logprobs":[', *lp_parts,
                         b"]," + meta[1:] + b"}"])

    async def h_pause(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": f"unknown pause mode {mode!r}"}, status=400)
        self._touch()
        self.paused = True
        self.cluster.pauses += 1
        self.cluster.running_at_pauses += len(self.running)
        if mode == "abort":
            for req in list(self.running.values()):
                self._remove_running(req)
                self._end(req, "abort")
            while self.waiting:
                self._answer(self.waiting.popleft(), "abort")
        elif mode == "retract":
            back = []
            for req in list(self.running.values()):
                self._remove_running(req)
                if req.done >= req.target:  # its last token is out: it finished, nothing to retract
                    self._end(req, "abort")
                else:
                    back.append(req)
            self.waiting.extendleft(reversed(back))
        self._rearm()
        return web.json_response({"success": True})

    async def h_continue(self, request: web.Request) -> web.Response:
        self._touch()
        self.paused = False
        self._admit()
        self._rearm()
        return web.json_response({"success": True})

    async def h_flush(self, request: web.Request) -> web.Response:
        if self.running or (self.waiting and not self.paused):
            return web.json_response({"success": False, "message": "requests still hold KV"}, status=400)
        return web.json_response({"success": True})

    async def h_abort(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        prefix = "" if body.get("abort_all") else str(body.get("rid", ""))
        self._touch()
        for req in [r for r in self._all_requests() if r.rid.startswith(prefix)]:
            if self.running.get(req.rid) is req:
                self._remove_running(req)
            else:
                self.waiting.remove(req)
            self._end(req, "abort")
        self._admit()
        self._rearm()
        return web.json_response({"success": True})

    async def h_server_info(self, request: web.Request) -> web.Response:
        launch_value = self.version_behaviour >= _V_SPANS
        return web.json_response({"version": self.cfg.sglang_version, "tp_size": 1, "dp_size": 1,
                                  "model_path": "sim", "skip_tokenizer_init": True,
                                  "weight_version": "0" if launch_value else str(self.weight_version),
                                  "disable_overlap_schedule": self.cfg.disable_overlap_schedule,
                                  "disable_radix_cache": self.cfg.disable_radix_cache})

    async def h_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "sim", "weight_version": str(self.weight_version),
                                  "is_generation": True})

    async def h_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def h_begin(self, request: web.Request) -> web.Response:
        if self.in_session:
            return web.json_response({"success": False, "message": "a weight update is already open"}, status=400)
        self.in_session = True
        return web.json_response({"success": True, "message": "begin"})

    async def h_end(self, request: web.Request) -> web.Response:
        if not self.in_session:
            return web.json_response({"success": False, "message": "no weight update is open"}, status=400)
        self.in_session = False
        return web.json_response({"success": True, "message": "end"})

    async def h_update(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("weight_version") is not None:
            try:
                self._set_version(int(body["weight_version"]))
            except ValueError:
                return web.json_response({"success": False, "message": "sim: weight_version must be an integer"},
                                         status=400)
        if body.get("flush_cache", True) and self.running and self.version_behaviour >= _V_FLUSH_REFUSED:
            return web.json_response({"success": False, "message": "Weights were updated, but the cache was not "
                                      "flushed"}, status=400)
        return web.json_response({"success": True, "message": "sim: updated"})

    async def h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.cluster.stats())


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    d = json.loads(raw) if raw else {}
    return d if isinstance(d, dict) else {}


# ----------------------------------------------------------------------------- a cluster


class SimCluster:
    """``n`` servers on 127.0.0.1, one aiohttp app each, in the running event loop."""

    def __init__(self, n: int, cfg: SimConfig | None = None, host: str = "127.0.0.1"):
        if n < 1:
            raise ValueError(f"SimCluster: n must be >= 1, got {n}")
        self.cfg = cfg or SimConfig()
        self.host = host
        self.prompt_len: dict[str, int] = {}  # caller rid -> prompt length (the first segment's input)
        self.completed_rids: set[str] = set()
        self.duplicates = 0
        self.generate_calls = self.sent_tokens = self.answers = self.aborted_answers = self.pauses = 0
        self.recomputed_prefill_tokens = 0  # model tokens prefilled again (resubmitted or retracted requests)
        self.recomputed_prefill_s = 0.0  # their model seconds of prefill, summed over servers
        self.running_at_pauses = 0  # requests running when a pause came, summed over pauses and servers
        self.decode_busy_s = 0.0  # model seconds the servers spent decoding, summed over servers
        self.streams = _Streams(self.cfg.vocab_size)
        self.reference_renderer = self.cfg.reference_renderer  # True: answers built token by token
        self.servers = [SimServer(self, i) for i in range(n)]
        self._runners: list[web.AppRunner] = []
        self.lag_max_s = 0.0  # how late the simulator's own loop woke a 10 ms sleeper (it answers the pauses)
        self._lag_task: asyncio.Task | None = None

    async def _tick(self, period: float = 0.01) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period)
            self.lag_max_s = max(self.lag_max_s, loop.time() - t - period)

    def completed(self, base: str) -> None:
        if base in self.completed_rids:
            self.duplicates += 1
        self.completed_rids.add(base)
        self.prompt_len.pop(base, None)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    async def start(self) -> list[str]:
        for s in self.servers:
            # idle keep-alive connections close after 5 s, as SGLang's uvicorn does (timeout_keep_alive=5):
            # a client that pools every connection it ever opened would otherwise exhaust our descriptors
            runner = web.AppRunner(s.app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                                   keepalive_timeout=5.0)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0, backlog=1024)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # bound by us: no window for another taker
            s.url = f"http://{self.host}:{port}"
            s.last = asyncio.get_running_loop().time()
            self._runners.append(runner)
        self._lag_task = asyncio.create_task(self._tick())
        return self.urls

    async def stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
            self._lag_task = None
        for s in self.servers:  # answer whatever still waits, so that no handler holds the shutdown
            if s.timer is not None:
                s.timer.cancel()
            s.paused = True
            for req in list(s.running.values()) + list(s.waiting):
                req.start = None
                s._answer(req, "abort")
            s.running.clear()
            s.waiting.clear()
        for r in self._runners:
            await r.cleanup()
        self._runners.clear()

    def stats(self) -> dict:
        return {"servers": len(self.servers), "generate_calls": self.generate_calls, "answers": self.answers,
                "aborted_answers": self.aborted_answers, "completed": len(self.completed_rids),
                "duplicates": self.duplicates, "sent_tokens": self.sent_tokens, "pauses": self.pauses,
                "recomputed_prefill_tokens": self.recomputed_prefill_tokens,
                "recomputed_prefill_s": self.recomputed_prefill_s, "running_at_pauses": self.running_at_pauses,
                "decode_busy_s": self.decode_busy_s,
                "running": sum(len(s.running) for s in self.servers),
                "waiting": sum(len(s.waiting) for s in self.servers),
                "versions": sorted({s.weight_version for s in self.servers}),
                "loop_lag_max_s": self.lag_max_s}

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


# ----------------------------------------------------------------------------- child process


class SimProcess:
    """A :class:`SimCluster` in a child process; it exits when its stdin closes (``close()``)."""

    def __init__(self, n: int, cfg: SimConfig, timeout_s: float = 120.0):
        self.cfg = cfg
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--servers", str(n),
                                      "--config", cfg.to_json()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()  # blocks until the child has bound every port (or died)
        if not line:
            code = self.proc.wait(timeout=timeout_s)
            raise RuntimeError(f"sim_sglang child exited with {code} before reporting its ports")
        self.urls: list[str] = json.loads(line)["urls"]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the child so far (from /proc)."""
        try:
            parts = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def close(self, timeout_s: float = 30.0) -> int:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # our own child, by its pid
            self.proc.kill()
            return self.proc.wait(timeout=timeout_s)

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _serve(n: int, cfg: SimConfig) -> None:
    cluster = SimCluster(n, cfg)
    await cluster.start()
    print(json.dumps({"urls": cluster.urls}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await cluster.stop()


FD_WANTED = 1 << 17  # one socket per request in flight (16,384 at the largest scale) plus idle kept-alive ones


def raise_fd_limit(wanted: int = FD_WANTED) -> int:
    """Raise this process's open-file limit to ``wanted`` where allowed (the hard limit too, as root),
    else to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for new in ((wanted, max(hard, wanted)), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, new)
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--config", default="{}", help="SimConfig as JSON")
    args = ap.parse_args(argv)
    cfg = SimConfig.from_json(args.config)
    raise_fd_limit()
    gc.freeze()  # the sim's own objects are long-lived; keep the collector off them
    # each answer builds one small list per token and drops it at once: young collections that run
    # every 700 allocations only promote them; rarer ones (as the client's tune_gc) cost less
    gc.set_threshold(50_000, 20, 20)
    asyncio.run(_serve(args.servers, cfg))


if __name__ == "__main__":
    main()
