"""The rollout client's generic core: the interface every inference backend's adapter implements.

    from areal_fast.backends.registry import client_class     # the layer above picks the adapter by name
    client = client_class("sglang")(["http://127.0.0.1:30000", ...])   # api_key: AREAL_FAST_API_KEY by default
    async with client:                       # opens the session, reads the facts of every server
        res = await client.generate(prompt_ids, {"max_new_tokens": 256, "temperature": 1.0}, rid="q1-s0")
        res.output_ids, res.output_logprobs, res.output_versions, res.finish_reason   # array.array columns

``RolloutClient`` names no backend. What one server says differently (its facts call, the segment
call and its answer, abort, pause, continue, flush, the current weight version, which 500 blames the
request, which sampling keys it knows) is a backend adapter, a subclass in
``areal_fast/backends/<name>/client.py`` that implements the hooks below (each raises
``NotImplementedError`` here): ``_read_info``, ``_post_segment``, ``_abort_quietly``,
``_abort_segment``, ``_current_weight_version``, ``pause_all``, ``continue_all``, ``abort_all``,
``flush_cache_all``, ``weight_versions``; and supplies its capabilities as class data
(``SAMPLING_KEYS``, ``INFO_PATH``) and per server (``_caller_500``). The adapters read a server's
answer with the public helpers of this layer (``client_pool.apply_server_info``,
``client_pool.str_or_none``, ``answer.token_versions``). ``areal_fast.backends.registry`` maps a
backend's name to its adapter; rollout never imports it.

``generate`` returns the one sample record (:class:`areal_fast.sample.Sample`): the workflow extends
it, the controller buffers it and the trainer reads it, as the same object.

The client generates, pauses, continues, flushes and aborts. Weight updates are not its job: every
weight-update transport lives in ``areal_fast.weights``. ``RolloutClient`` is three parts, each in
its own module: the server pool (``client_pool``: each server's facts, the calls, routing, dead
servers), the control of every server (``client_control``: pause modes, pause / continue / abort
all / flush) and, here, the generate path (one request across segments, failover and aborts,
stitched into one ``Sample``). Every name is importable from this module.

Interruptible generation: when a segment comes back with ``finish_reason.type == "abort"`` (a pause in
mode abort, or an update with abort_all_requests) the client waits until ``continue_all()`` (if it
paused the servers itself), then resubmits ``prompt + output so far`` with ``max_new_tokens`` reduced
by what it already has, and appends the new segment. Tokens, logprobs and per-token weight versions
are only ever appended from *completed* HTTP answers, so a token cannot be lost or duplicated at a
seam; each token keeps the version of the weights that produced it. An explicit ``abort(rid)`` ends
the request: its finish reason is ``"length"`` (a truncated sample) with ``aborted=True``.

Pauses: ``pause_all()`` uses the client's ``pause_mode``, ``"auto"`` by default: per server,
``retract`` from SGLang 0.5.19 (requests stay on the server and nothing comes back; the answer's
weight_versions spans label every token) and ``abort`` before (``backends/sglang/client.py``).
Answers are decoded into compact columns (``areal_fast.rollout.answer``, ``docs/scale.md``).
(The pause modes and the other server behaviours named here are SGLang's, ``backends/sglang/client.py``;
vLLM's adapter spells them its way, ``backends/vllm/client.py``.)

Transport: calls to an ``http://`` server go through the client's own HTTP/1.1 connection pool
(``areal_fast.http.pool``: kept-alive connections, each checked just before a request is
written, never a request sent twice by the transport); ``https://`` servers, and ``http="aiohttp"``
(or ``AREAL_FAST_ROLLOUT_HTTP=aiohttp``), use aiohttp.

Request ids on the server: SGLang's /abort_request aborts every request whose rid STARTS WITH the
given one, so the client never sends the caller's rid as is: segment ``k`` of ``rid`` is sent as
``f"{rid}|{k}|"``. A caller rid holds no ``|``, so the first ``|`` ends it and the segment number is
closed by the second: no server rid is ever a prefix of another.

Failures are classified by what the answer says, never by the status class alone:
- no answer (connection refused or reset, timeout) or a 5xx that is not the caller's fault: the
  server is skipped for ``down_cooldown_s`` and the segment retried elsewhere. Nothing is ever
  declared dead here; ``health()`` tells a paused server from a gone one for a watchdog.
- 4xx, and the 500 that SGLang before 0.5.22 gives for an unknown sampling key (a TypeError):
  ``RequestError`` at once, the server stays in the pool.
- 400 for a transient state on control calls (a cache that cannot be flushed yet): retried by the
  control call until its deadline.
- a 2xx whose body breaks the answer rules (``areal_fast.rollout.answer``: not JSON, wrong types,
  ids outside the vocabulary, log-probs > 0, an entry's id not the output id, duplicate keys,
  another request's rid): ``MalformedAnswer`` naming the server and the rid, at once. An answer
  larger than ``answer_bytes_per_token`` bytes a token (prompt and new tokens, plus 1 MiB), or not
  HTTP/1.x, is a failed connection: retried elsewhere.

A request that timed out is aborted on its server (``/abort_request`` with its rid) before it is
sent again, and the new attempt carries a new rid (``rid|k.a|`` for attempt ``a``): a server that
still runs the abandoned one never answers "rid already running".
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from array import array
from collections.abc import Sequence

from areal_fast.columns import ROUTING_ARRAY, routing_from_rows
from areal_fast.rollout.answer import (
    LOGPROB_ARRAY,
    TOKEN_ARRAY,
    Segment,
    token_versions,
    version_to_int,  # noqa: F401 - part of this module's API (tests, callers)
)
from areal_fast.rollout.calls import (  # noqa: F401 - the errors, health and key name are part of this module's API
    API_KEY_ENV,
    CONTROL_RETRY,
    HEALTH_PROBE_TIMEOUT_S,
    RequestError,
    RetryPolicy,
    RolloutError,
    ServerCalls,
    ServerError,
    ServerHealth,
    check_server_url,
    is_caller_error,
    no_answer_errors,
)
from areal_fast.rollout.client_control import ServerControl
from areal_fast.rollout.client_pool import (  # noqa: F401 - the pool's names are part of this module's API
    PICK_SCAN_MAX,
    ServerPool,
    ServerState,
    ServerUnavailable,
)
from areal_fast.rollout.config import PAUSE_MODE_CHOICES
from areal_fast.rollout.routed_experts import check_expert_ids, from_sglang
from areal_fast.rollout.staleness import ADMISSION_ORDER
from areal_fast.sample import Sample

try:  # the rollout extra's JSON encoder: it writes a numpy view of an array column without a Python list
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised only where orjson is missing
    _orjson = None

RID_SEP = "|"
HTTP_ENV = "AREAL_FAST_ROLLOUT_HTTP"  # "native" (default) or "aiohttp": who carries the calls
HTTP_CHOICES = ("native", "aiohttp")
# The largest /generate answer taken: this many bytes a token (prompt + max_new_tokens) plus
# ANSWER_SLACK_BYTES. SGLang's answers take ~40 bytes a generated token ([logprob, id, null] and
# the id in output_ids), ~60-100 with the text; 512 leaves room for escaped token texts.
ANSWER_BYTES_PER_TOKEN = 512
ROUTING_B64_BYTES = 6  # answer bytes an expert id of the routing may take (base64 of int32: 5.33)
UNROUTED = array(ROUTING_ARRAY, [-1])
ANSWER_SLACK_BYTES = 1 << 20
ABORT_TIMEOUT_S = 5.0  # an abort of a timed-out request before it is sent again


class MalformedAnswer(RolloutError):
    """A server answered 2xx with a body that is not a valid /generate result (never retried: a
    server that answers garbage is a bug or an attack to look at). Names the server and the rid."""

    def __init__(self, url: str, rid: str, why: str):
        super().__init__(why)
        self.url, self.rid = url, rid


def server_rid(rid: str, segment: int) -> str:
    """The rid sent to the server for ``segment`` of ``rid``; never a prefix of another one."""
    return f"{rid}{RID_SEP}{segment}{RID_SEP}"


class RolloutClient(ServerPool, ServerControl):
    """The generic client over a pool of servers; see the module docstring. The pool, its calls and
    routing are ``ServerPool`` (``client_pool``), the control of every server ``ServerControl``
    (``client_control``); this class adds the generate path: one request across pauses, weight
    updates and failover, stitched into one ``Sample``. A backend adapter subclasses it."""

    # Capabilities a backend adapter supplies as data (the generic values here check nothing):
    SAMPLING_KEYS: frozenset[str] | None = None  # the sampling keys its servers know (None: not checked)
    SAMPLING_KEYS_OF = "the server"  # who knows them, for the error naming an unknown key
    UNKNOWN_KEY_NOTE = ""  # what its servers do with an unknown key, for that error
    INFO_PATH = "its facts call"  # the call that reads a server's facts, for the error when none answered
    # the segment request carries the request's scheduling priority (``payload["priority"]``: its group's
    # admission order, rollout.staleness.ADMISSION_ORDER) for the adapter to send where its server uses it
    SENDS_PRIORITY = False

    def __init__(self, urls: list[str], *, api_key: str | None = None, request_timeout_s: float = 3600.0,
                 connect_timeout_s: float = 10.0, control_timeout_s: float = 600.0, max_attempts: int = 6,
                 retry_backoff_s: float = 0.2, down_cooldown_s: float = 5.0, max_segments: int = 10_000,
                 pause_mode: str = "auto", gc_tuning: bool = True, http: str | None = None,
                 vocab_size: int | None = None, answer_bytes_per_token: int = ANSWER_BYTES_PER_TOKEN,
                 lora_name: str | None = None, routed_experts_width: int | None = None,
                 num_experts: int | None = None):
        if not urls:
            raise ValueError("RolloutClient needs at least one server url")
        for u in urls:  # user info (it would go in the Host header), a bad port, a query: refused here
            check_server_url(u)
        if vocab_size is not None and (type(vocab_size) is not int or vocab_size <= 0):
            raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        if type(answer_bytes_per_token) is not int or answer_bytes_per_token < 64:
            raise ValueError(f"answer_bytes_per_token must be an int >= 64, got {answer_bytes_per_token!r}")
        self.vocab_size = vocab_size or 0  # 0: not known (ids are only checked to be >= 0)
        self.lora_name = lora_name  # a LoRA run's adapter: every request names it (docs/lora.md)
        self.answer_bytes_per_token = answer_bytes_per_token
        if routed_experts_width is not None and (type(routed_experts_width) is not int or routed_experts_width <= 0):
            raise ValueError(f"routed_experts_width must be a positive int (layers x top_k) or None, "
                             f"got {routed_experts_width!r}")
        if routed_experts_width is not None and (type(num_experts) is not int or not 0 < num_experts <= 2**15):
            raise ValueError(f"num_experts: the model's expert count (1 .. 32768) must come with "
                             f"routed_experts_width (an answer's expert id outside it is refused), got {num_experts!r}")
        # MoE routing replay (docs/moe.md): every request asks for its routing, layers x top_k ids a position,
        # each an expert of the model's num_experts
        self.routed_experts_width = routed_experts_width
        self.num_experts = num_experts if routed_experts_width is not None else None
        http = http or os.environ.get(HTTP_ENV) or "native"
        if http not in HTTP_CHOICES:
            raise ValueError(f"http (or ${HTTP_ENV}) must be one of {HTTP_CHOICES}, got {http!r}")
        self.http = http
        if pause_mode not in PAUSE_MODE_CHOICES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODE_CHOICES}, got {pause_mode!r}")
        self.default_pause_mode = pause_mode
        self.gc_tuning = gc_tuning
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self._by_url = {s.url: s for s in self.servers}
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._short_timeout_s = max(30.0, connect_timeout_s)  # facts and health: /server_info, /model_info
        self.max_attempts, self.retry_backoff_s = max_attempts, retry_backoff_s
        self.down_cooldown_s, self.max_segments = down_cooldown_s, max_segments
        self._calls: ServerCalls | None = None  # every HTTP call (areal_fast.rollout.calls)
        self._policies: dict[float, RetryPolicy] = {}
        self._affinity: dict[str, str] = {}
        self._rng = random.Random()
        self._segment_rid: dict[str, tuple[str, str]] = {}  # rid -> (server url, rid of the live segment)
        self._user_aborted: set[str] = set()
        self._active: set[str] = set()
        self._running = asyncio.Event()
        self._running.set()
        # rank 0 lets the pool become empty when a server can come back (``elastic.empty_pool``):
        # requests then wait in _generate_segment until add_server refills it
        self.allow_empty = False
        self._filled = asyncio.Event()
        self._filled.set()
        self.pause_mode: str | None = None  # the mode of our pause_all while paused, else None
        self.server_pause_modes: dict[str, str] = {}  # url -> the mode each server was paused with


    async def _generate_segment(self, rid: str, seg_rid: str, payload: dict,
                                ) -> tuple[Segment, ServerState, str | None]:
        """POST /generate with failover; returns (compact answer, server, its known weight_version at
        send time). The decoded JSON is gone when this returns (``areal_fast.rollout.answer``).
        Attempt ``a`` > 0 is sent as ``rid|k.a|`` (never a prefix of another server rid either), and
        a timed-out attempt is aborted on its server first (see the module docstring)."""
        tried: set[str] = set()
        last_err: Exception | None = None
        n_tokens = len(payload["input_ids"]) if isinstance(payload["input_ids"], list | tuple) else 0
        per_token = self.answer_bytes_per_token + ROUTING_B64_BYTES * (self.routed_experts_width or 0)
        max_body = ANSWER_SLACK_BYTES + per_token * (
            n_tokens + int(payload["sampling_params"].get("max_new_tokens") or 0))
        attempt = sent = 0
        while attempt < self.max_attempts:
            if not self.servers:  # an empty pool (allow_empty): wait until a server joins
                await self._wait_for_servers()
            server = self._pick(rid, tried)
            attempt_rid = seg_rid if sent == 0 else f"{seg_rid[:-1]}.{sent}{RID_SEP}"
            sent += 1
            self._segment_rid[rid] = (server.url, attempt_rid)
            known_version = server.weight_version
            server.in_flight += 1
            try:
                data = await self._post_segment(server, payload, attempt_rid, max_body)
                if not server.info:  # it was down when the client started: learn its facts now
                    await asyncio.gather(self._read_info(server), return_exceptions=True)
                return data, server, known_version
            except RequestError:
                raise
            except (ServerError, *no_answer_errors()) as e:  # the one policy: no answer or a server's 5xx
                last_err = e
                server.down_until = time.monotonic() + self.down_cooldown_s
                self._affinity.pop(rid, None)
                tried.add(server.url)
                if isinstance(e, TimeoutError):  # it may still run there: free it first
                    await self._abort_quietly(server, attempt_rid)
                if not set(self._by_url) - tried:  # every server of the pool failed this round
                    tried.clear()
                    await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
                if server.url in self._by_url:  # one dropped from the pool since (dead) costs no attempt
                    attempt += 1
            finally:
                server.in_flight -= 1
        raise ServerUnavailable(f"generate rid={rid!r} failed on every server ({self.max_attempts} attempts): "
                                f"{type(last_err).__name__}: {last_err}")

    async def _post_segment(self, server: ServerState, payload: dict, attempt_rid: str, max_body: int) -> Segment:
        """One segment's call on ``server``, its answer checked and decoded into a ``Segment``; the
        backend adapter's (``payload`` is the client's segment request, see :meth:`generate`; a
        2xx that breaks the answer rules raises :class:`MalformedAnswer`)."""
        raise NotImplementedError(f"{type(self).__name__}: sending a segment is the backend adapter's")

    async def _abort_quietly(self, server: ServerState, server_rid_: str) -> None:
        """Best effort: abort one server rid on ``server`` (one that timed out may not answer);
        the backend adapter's call."""
        raise NotImplementedError(f"{type(self).__name__}: aborting a request is the backend adapter's")

    # ------------------------------------------------------------------ generation
    @classmethod
    def _check_request(cls, input_ids: Sequence[int], sampling: dict, rid: str | None) -> None:
        if isinstance(input_ids, str | bytes | bytearray | memoryview) or not hasattr(input_ids, "__len__"):
            raise TypeError(f"input_ids must be a sequence of token ids (a list, tuple or array('i')), "
                            f"got {type(input_ids).__name__}")
        if len(input_ids) == 0:
            raise ValueError("input_ids must be a non-empty sequence of token ids")
        unknown = [] if cls.SAMPLING_KEYS is None else sorted(k for k in sampling if k not in cls.SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: not a sampling parameter {cls.SAMPLING_KEYS_OF} "
                             f"knows{cls.UNKNOWN_KEY_NOTE}")
        n = sampling.get("n", 1)
        if n not in (1, None):
            raise ValueError(f"sampling_params.n={n!r}: {cls.__name__}.generate asks for one sample per call "
                             "(a server answers n > 1 with a list); call generate once per sample with its own rid")
        if rid is not None and (not isinstance(rid, str) or not rid or RID_SEP in rid):
            raise ValueError(f"rid {rid!r} must be a non-empty string without {RID_SEP!r} (the client appends "
                             f"'{RID_SEP}segment{RID_SEP}' so that no rid on a server is a prefix of another)")

    async def generate(self, input_ids: Sequence[int], sampling: dict | None = None, rid: str | None = None,
                       *, priority: int | None = None) -> Sample:
        """Generate to completion across pauses and weight updates; see the module docstring.

        ``priority``: the request's place in a server's queue where the server schedules by priority
        (lower first; every segment of the request keeps it, so a request sent again after an abort
        pause is not queued behind newer ones); None: the admission number of the group it belongs to
        (``rollout.staleness.ADMISSION_ORDER``, set by the controller), 0 outside a group.

        ``input_ids``: the prompt, any sequence of ints (a list, tuple or ``array('i')``: an array is
        sent without a Python list; an array is also the result's ``prompt_ids``, not copied). The
        result is a :class:`~areal_fast.sample.Sample` whose per-token fields are the columns the
        client stitched, handed over as they are (no copy), with a loss mask of ones."""
        sampling = dict(sampling or {})
        self._check_request(input_ids, sampling, rid)
        sampling.pop("n", None)
        if priority is None:
            priority = ADMISSION_ORDER.get() or 0
        elif type(priority) is not int:
            raise TypeError(f"priority must be an int or None, got {type(priority).__name__}")
        max_new = int(sampling.get("max_new_tokens", 128))
        rid = rid or uuid.uuid4().hex
        if rid in self._active:
            raise ValueError(f"rid {rid!r} is already being generated by this client")
        self._active.add(rid)
        t0 = time.monotonic()
        # compact columns (4 + 4 + 4 bytes a token): they cross every wait for continue_all()
        out_ids = array(TOKEN_ARRAY)
        lps = array(LOGPROB_ARRAY)
        versions = array(TOKEN_ARRAY)
        servers: list[str] = []
        width = self.routed_experts_width
        routing = array(ROUTING_ARRAY)  # rows of the forwarded positions recorded so far, width ids each
        prompt = input_ids  # an array('i') copy of it from the first resubmission on (_prompt_plus)
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
                if out_ids and not _is_token_array(prompt):
                    prompt = array(TOKEN_ARRAY, prompt)  # once per request: resubmissions append by memcpy
                payload = {"input_ids": _prompt_plus(prompt, out_ids),
                           "sampling_params": {**sampling, "max_new_tokens": remaining},
                           "return_logprob": True, "logprob_start_len": -1, "stream": False}
                if self.lora_name is not None:  # SGLang's name of a loaded adapter
                    payload["lora_path"] = self.lora_name
                if self.SENDS_PRIORITY:
                    payload["priority"] = priority
                sent = len(prompt) + len(out_ids)
                if width:  # only the positions not recorded yet (SGLang's and vLLM's start offset)
                    payload["return_routed_experts"] = True
                    payload["routed_experts_start_len"] = len(routing) // width
                ans, server, known = await self._generate_segment(rid, server_rid(rid, seg), payload)
                del payload
                if width:
                    routing += segment_routing(ans, width, sent, len(routing) // width, server.url,
                                               self.num_experts)
                seg += 1
                servers.append(server.url)
                if ans.weight_version is not None:
                    server.weight_version = ans.weight_version
                seg_versions = ans.versions
                if seg_versions is None:  # no version in the answer: the one known at send time
                    if known is None:
                        known = await self._current_weight_version(server)
                    seg_versions = _token_versions({"id": ans.rid}, len(ans), fallback=known)
                out_ids += ans.ids
                lps += ans.logprobs
                versions += seg_versions
                fr = ans.finish
                del ans, seg_versions
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
        if routing:  # positions no answer recorded (a segment aborted without its routing): -1
            routing.extend(UNROUTED * ((len(input_ids) + len(out_ids) - 1) * width - len(routing)))
        # the columns themselves: the sample takes arrays of these typecodes as they are (no copy)
        return Sample(prompt_ids=input_ids, output_ids=out_ids, output_logprobs=lps, output_versions=versions,
                      routed_experts=routing,
                      finish_reason=finish, rid=rid, matched=matched, aborted=aborted, num_segments=seg,
                      servers=servers, latency_s=time.monotonic() - t0)

    async def _current_weight_version(self, server: ServerState) -> str | None:
        """``server``'s current weight version, asked now and recorded on it (None if it does not
        answer); the backend adapter's call."""
        raise NotImplementedError(f"{type(self).__name__}: reading a weight version is the backend adapter's")

    async def abort(self, rid: str) -> None:
        """End generation ``rid`` (its result comes back with finish_reason "length", aborted=True)."""
        if rid not in self._active:
            return
        self._user_aborted.add(rid)
        live = self._segment_rid.get(rid)
        if live is not None and live[0] in self._by_url:
            await self._abort_segment(self._by_url[live[0]], live[1])

    async def _abort_segment(self, server: ServerState, server_rid_: str) -> None:
        """Abort the live segment ``server_rid_`` on ``server`` (the caller's ``abort``); the backend
        adapter's call."""
        raise NotImplementedError(f"{type(self).__name__}: aborting a request is the backend adapter's")


def _is_token_array(x) -> bool:
    return type(x) is array and x.typecode == TOKEN_ARRAY


# orjson writes a numpy view of an array('i') ~4-6x faster than it writes the same ids as a list
# (3-6 vs 18-29 ns a token, tolist() included, 64-4,000 prompt + 4,000 generated tokens; 2 busy
# cores), and no Python int is made. orjson.Fragment puts the encoded ids into the body (an orjson
# without it, and the json fallback, get a list).
_FRAGMENT = getattr(_orjson, "Fragment", None)


def _json_ids(ids: array):
    """An ``array('i')`` in a form :func:`dumps` encodes as a JSON list of ints."""
    if _FRAGMENT is None:  # the standard library's json: a list
        return ids.tolist()
    import numpy as np  # a dependency of the package; imported on first use

    return _FRAGMENT(_orjson.dumps(np.frombuffer(ids, dtype=np.intc), option=_orjson.OPT_SERIALIZE_NUMPY))


def _prompt_plus(prompt: Sequence[int], out_ids: array):
    """The ``input_ids`` of the next segment, ready for :func:`dumps`: the prompt, then the tokens
    generated so far. A list or tuple prompt of the first segment goes as it is; arrays (the prompt
    of a resubmission is one: ``generate``) are joined by memcpy and encoded without a Python list."""
    if out_ids:
        return _json_ids((prompt if _is_token_array(prompt) else array(TOKEN_ARRAY, prompt)) + out_ids)
    if _is_token_array(prompt):
        return _json_ids(prompt)
    return prompt if type(prompt) in (list, tuple) else list(prompt)


def _token_versions(meta: dict, n: int, fallback: str | None = None) -> array:
    """Per-token versions of one answer: from weight_versions spans (>= 0.5.19) or weight_version.

    SGLang 0.5.6-0.5.8 sends no weight_version for requests aborted while waiting (e.g. retracted);
    their tokens get ``fallback``, the server's version known when the segment was sent, never 0 by
    default. With neither, RolloutError: a wrong label would corrupt the staleness accounting.
    """
    out = token_versions(meta, n, fallback)
    if out is None:
        raise RolloutError(f"answer for rid {meta.get('id')!r} carries no weight_version and none is known")
    return out


def segment_routing(ans: Segment, width: int, sent: int, start: int, url: str,
                    num_experts: int | None = None) -> array:
    """The routing rows of one answer (``width`` ids each) for the positions ``[start, sent + len(ans)
    - 1)`` it was asked for (``sent`` tokens sent as its prompt), flat ``array('h')``. An answer
    without routing gives none; an aborted one whose rows do not cover that range gives none either
    (its positions are asked again by the next segment, or stay unrecorded). A finished answer with
    another count or width is a ``MalformedAnswer``: the server does not record what we ask; so is an
    answer, finished or not, naming an expert outside ``[0, num_experts)`` (the model's count): replay
    would index past the router (a device assert on CUDA), and a kept sample would carry it into
    checkpoints."""
    if ans.routing is None:
        return array(ROUTING_ARRAY)
    want = sent + len(ans.ids) - 1 - start
    try:  # SGLang's raw int32 ids (the shape not sent: rows of ``width``), or the vLLM adapter's decoded rows
        rows = from_sglang(ans.routing, 1, width) if isinstance(ans.routing, str) else ans.routing
        check_expert_ids(rows, num_experts)
    except ValueError as e:
        raise MalformedAnswer(url, str(ans.rid), f"{url} (rid {ans.rid!r}): {e}") from None
    rows = rows.reshape(len(rows), -1)
    if rows.shape != (want, width):
        if ans.finish.get("type") == "abort":
            return array(ROUTING_ARRAY)
        raise MalformedAnswer(url, str(ans.rid), f"{url} (rid {ans.rid!r}): routed_experts: {rows.size} expert ids "
                              f"for {want} positions of {width} (layers x top_k) asked")
    return routing_from_rows(rows)
