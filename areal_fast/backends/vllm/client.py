"""The vLLM adapter of the rollout client: :class:`VLLMRolloutClient` drives vLLM servers (real ones
or the embedded engine's vLLM twin) with the shared client core of ``rollout/client.py``.

What stays shared, once, in ``RolloutClient`` and its parts: the transport and retry policy
(``rollout.calls``), the pool and routing (``rollout.client_pool``), one request across pauses and failover, the
stitching of segments into one ``Sample`` and the per-token versions. What this adapter replaces
is only what vLLM spells differently (``docs/vllm.md``; the bodies come from ``requests.py``):

- a segment is ``POST /v1/completions`` (token ids in and out, one log-prob a token, the
  ``weight_versions`` spans from 0.33.0) instead of SGLang's ``/generate``;
- a server's facts are ``GET /version`` (and ``GET /weight_info`` from 0.27.0) instead of
  ``/server_info``;
- pause and continue are ``/pause?mode=abort|keep`` and ``/resume``; abort is ``/abort_requests``
  with the engine's id of the request (``cmpl-{request_id}-0``) from 0.26.0, where it is mounted
  by default; a release without /pause (0.11.x) is paused by letting its requests finish;
- vLLM has no cache flush to wait for: ``flush_cache_all`` only checks the rule of an in_place pause;
- prefix caching: an in-place pause (keep with ``clear_cache=false``) keeps vLLM's prefix cache
  across the update, and a new request with a cached prefix would be computed on KV of the old
  weights. A server the client pauses in place must run without it: its
  ``GET /server_info?config_format=json`` (dev mode, as /pause) is read when the client connects
  with a mode that resolves to in place, or at the first such pause, and a server with
  ``enable_prefix_caching`` on is refused, naming the fix (``--no-enable-prefix-caching`` or
  ``pause_mode: abort``; an abort pause with vLLM's default ``clear_cache=true`` resets the cache);
- scheduling: every completion carries the request's ``priority``, the admission order of its
  group (``rollout.staleness.ADMISSION_ORDER``), the same for every segment. A server started with
  ``--scheduling-policy priority`` (the launcher's) runs the oldest groups' requests first, so a
  request interrupted by an abort pause and sent again is never queued behind newer ones; vLLM's
  default, first come first served, ignores the field, and there the requests sent again after a
  pause queue in whatever order they arrive (``docs/staleness.md``, "The server's queue"). A server
  the client pauses with abort that reports another policy in its ``/server_info`` is named in a
  warning when the client connects;
- a server's release is what its ``/version`` reports, read leniently (``compat.served_release``:
  ``0.33.0+cu126`` is 0.33.0, a newer release behaves as the newest one read, with a warning);
  the model name every completion carries is the one ``/v1/models`` lists.

Per-token versions. From 0.33.0 every answer labels its tokens (``weight_versions`` spans). Before,
an answer carries no version, and a segment's tokens get the version the server held when it was
sent (``server.weight_version``): exact because an update happens only inside an abort pause,
which stops all generation, and because :meth:`continue_all` settles each such server before it
resumes it: the new label is read from ``/weight_info`` first (every segment sent from then on is
labelled with it), then every segment still in flight there is aborted until none is left (a
segment that reached the server during the pause is queued by vLLM before 0.33.0 and would run
under the new weights with the old label; aborted, it comes back empty and goes again).

The request id of a segment is the shared client's server rid (``rid|k|``, ``rid|k.a|``).
"""

from __future__ import annotations

import asyncio
import logging
from array import array

from areal_fast.backends.sglang.compat import SGLANG_SAMPLING_KEYS
from areal_fast.backends.vllm.compat import (
    DEFAULT_VLLM_VERSION,
    VLLMBehaviour,
    served_release,
    vllm_pause_mode,
)
from areal_fast.backends.vllm.requests import (
    COMPLETIONS_PATH,
    DEFAULT_MODEL,
    CompletionAnswerError,
    abort_body,
    completion_body,
    parse_completion,
    pause_query,
    routing_start_field,
)
from areal_fast.columns import LOGPROB_ARRAY, TOKEN_ARRAY
from areal_fast.rollout.answer import Segment, token_versions
from areal_fast.rollout.calls import RequestError, RolloutError, no_answer_errors
from areal_fast.rollout.client import ABORT_TIMEOUT_S, MalformedAnswer, RolloutClient
from areal_fast.rollout.client_pool import ServerState, apply_server_info, str_or_none
from areal_fast.rollout.liveness_route import VLLM_LIVENESS_PATH, register_liveness_path
from areal_fast.rollout.routed_experts import from_vllm

log = logging.getLogger(__name__)
SERVER_INFO_PATH = "/server_info?config_format=json"  # vLLM's dev-mode config dump (its prefix caching)
_DRAIN_POLL_S = 0.02
_SETTLE_POLL_S = 0.05


class VLLMRolloutClient(RolloutClient):
    """``RolloutClient`` over vLLM servers; see the module docstring. ``vllm_version``: the release
    assumed for a server whose ``/version`` has not answered yet."""

    # the client's sampling keys are SGLang's names; ``requests.completion_body`` maps them to vLLM's
    SAMPLING_KEYS = SGLANG_SAMPLING_KEYS
    SAMPLING_KEYS_OF = "SGLang (the client's names, mapped to vLLM's)"
    INFO_PATH = "GET /version"
    SENDS_PRIORITY = True  # every completion carries its group's admission order (see the module docstring)

    def __init__(self, urls: list[str], *, vllm_version: str = DEFAULT_VLLM_VERSION, **options):
        if options.get("pause_mode") == "retract":
            raise ValueError("pause_mode 'retract' is SGLang's; a vLLM server pauses with 'abort' or "
                             "'in_place' (vLLM's keep)")
        super().__init__(urls, **options)
        self.vllm_version = str(VLLMBehaviour.of(vllm_version).version)
        for s in self.servers:  # the watchdogs' liveness check asks /version of these (no /model_info)
            register_liveness_path(s.url, VLLM_LIVENESS_PATH)

    async def add_server(self, url: str) -> None:
        register_liveness_path(url.rstrip("/"), VLLM_LIVENESS_PATH)
        await super().add_server(url)

    def behaviour(self, server: ServerState) -> VLLMBehaviour:
        """What ``server``'s release serves (the declared release until its /version answered)."""
        return VLLMBehaviour(server.version) if server.info else VLLMBehaviour.of(self.vllm_version)

    # ------------------------------------------------------------------ facts
    async def _read_info(self, s: ServerState) -> dict:
        v = await self._call(s, "GET", "/version", timeout_s=self._short_timeout_s)
        reported = str((v or {}).get("version", self.vllm_version))
        try:
            release, warning = served_release(reported)
        except ValueError as e:
            raise RequestError(f"{s.url}/version", 200, str(e)) from None  # refused, not retried: a wrong server
        if warning:
            log.warning("%s: %s", s.url, warning)
        model = DEFAULT_MODEL
        try:
            listed = await self._call(s, "GET", "/v1/models", timeout_s=self._short_timeout_s)
            model = str(listed["data"][0]["id"])
        except (RolloutError, KeyError, IndexError, TypeError):
            pass  # a twin or server without the list: the launcher's --served-model-name
        apply_server_info(s, {"version": str(release), "reported_version": reported, "engine": "vllm", "model": model})
        mode = self._mode_for(s, self.default_pause_mode)
        if mode == "in_place":
            refusal = await self._prefix_cache_refusal(s)
            if refusal:
                raise RequestError(f"{s.url}{SERVER_INFO_PATH}", 200, refusal)  # refused, not retried
        elif mode == "abort" and self.behaviour(s).has_pause:
            await self._warn_first_come_first_served(s)
        await self._current_weight_version(s)
        return s.info

    async def _server_config(self, s: ServerState) -> None:
        """What the client reads of ``s``'s ``/server_info`` (dev mode, as /pause): its prefix caching
        and its scheduling policy, into ``s.info`` (None where the server does not say), once per
        server that answered. A server that did not answer (a timeout, a 5xx) is asked again next
        time: one lost read must not leave the in-place check without its answer for the connection."""
        if "prefix_caching" in s.info:
            return
        try:
            answer = await self._call(s, "GET", SERVER_INFO_PATH, timeout_s=self.control_timeout_s)
        except RequestError as e:
            if e.status != 404:  # 404: no dev mode (no /pause either), known; anything else: ask again
                return
            answer = None
        except (RolloutError, *no_answer_errors()):
            return
        config = answer.get("vllm_config") if isinstance(answer, dict) else None
        config = config if isinstance(config, dict) else {}
        s.info["prefix_caching"] = (config.get("cache_config") or {}).get("enable_prefix_caching")
        s.info["scheduling_policy"] = str_or_none((config.get("scheduler_config") or {}).get("policy"))

    async def _warn_first_come_first_served(self, s: ServerState) -> None:
        """A note for a server paused with abort that schedules first come first served: the requests
        an abort pause interrupts are sent again at once after each update, in no set order, so one of
        an older group can queue behind newer ones; with ``--scheduling-policy priority`` each keeps its
        group's place (each request carries its group's admission order). Said, not refused: measured on
        real vLLM 0.32 it made no difference to staleness at the tiny recipe's load (docs/staleness.md),
        and a server started by someone else may not be ours to restart."""
        await self._server_config(s)
        policy = s.info.get("scheduling_policy")
        if policy is not None and policy != "priority":
            log.info("%s schedules requests %r (first come first served): a request an abort pause interrupts "
                     "may queue behind newer groups' when sent again; --scheduling-policy priority keeps its "
                     "group's place (docs/staleness.md)", s.url, policy)

    async def _prefix_cache_refusal(self, s: ServerState) -> str | None:
        """Why ``s`` may not be paused in place (its prefix cache is on: see the module docstring), or
        None. Read once per server from ``/server_info``; a server without it (not in dev mode, whose
        /pause is missing too) is not refused here."""
        await self._server_config(s)
        if s.info.get("prefix_caching") is True:
            return (f"pause mode 'in_place' refused for {s.url}: it caches prompt prefixes (enable_prefix_caching), "
                    f"and a pause in place keeps that cache across a weight update, so new requests would be computed "
                    f"on KV of the old weights; start it with --no-enable-prefix-caching, or set rollout.pause_mode: "
                    f"abort")
        return None

    async def _current_weight_version(self, server: ServerState) -> str | None:
        if not self.behaviour(server).labels_weight_version:
            return server.weight_version
        try:
            wi = await self._call(server, "GET", "/weight_info", timeout_s=self._short_timeout_s)
        except (RolloutError, *no_answer_errors()):
            return server.weight_version
        server.weight_version = str_or_none((wi or {}).get("weight_version"))
        return server.weight_version

    # ------------------------------------------------------------------ generation
    async def _post_segment(self, server: ServerState, payload: dict, attempt_rid: str, max_body: int) -> Segment:
        b = self.behaviour(server)
        ids = payload["input_ids"]
        model = self.lora_name or server.info.get("model", DEFAULT_MODEL)  # a LoRA run names its adapter
        priority = payload.get("priority")  # the group's admission order (see the module docstring)
        if isinstance(ids, list | tuple):
            body = completion_body(ids, payload["sampling_params"], attempt_rid, b, model, priority=priority)
        else:  # the shared client's pre-encoded ids (an orjson Fragment): sent as they are
            body = {**completion_body([0], payload["sampling_params"], attempt_rid, b, model, priority=priority),
                    "prompt": ids}
        if payload.get("return_routed_experts"):  # vLLM answers routing when launched to; skip recorded rows
            n = len(ids) if isinstance(ids, list | tuple) else None  # pre-encoded: the client counted them
            body.update(routing_start_field(payload["routed_experts_start_len"], n, b))
        where = f"{server.url}{COMPLETIONS_PATH} (request_id {attempt_rid!r})"
        data = await self._call(server, "POST", COMPLETIONS_PATH, body, timeout_s=self.request_timeout_s,
                                max_body=max_body)
        try:
            c = parse_completion(data, request_id=attempt_rid)
            asked = payload.get("return_routed_experts")
            routing = from_vllm(data["choices"][0].get("routed_experts")) if asked else None
        except (CompletionAnswerError, ValueError) as e:
            raise MalformedAnswer(server.url, attempt_rid, f"{where}: {e}") from None
        if self.vocab_size and any(t >= self.vocab_size for t in c["ids"]):
            raise MalformedAnswer(server.url, attempt_rid, f"{where}: a token id >= the vocabulary {self.vocab_size}")
        finish = {"type": c["finish"]}
        if c["finish"] == "stop" and isinstance(c["stop_reason"], int):
            finish["matched"] = c["stop_reason"]
        versions = None
        if c["spans"] is not None:
            versions = token_versions({"weight_versions": c["spans"]}, len(c["ids"]))
        return Segment(ids=array(TOKEN_ARRAY, c["ids"]), logprobs=array(LOGPROB_ARRAY, c["logprobs"]),
                       versions=versions, finish=finish, weight_version=None, rid=attempt_rid, routing=routing)

    async def _abort_quietly(self, server: ServerState, server_rid_: str) -> None:
        if not self.behaviour(server).has_abort_requests:
            return  # before 0.26: closing the connection (done by the timeout) is vLLM's abort
        try:
            async with asyncio.timeout(ABORT_TIMEOUT_S):
                await self._call(server, "POST", "/abort_requests", abort_body([server_rid_]),
                                 timeout_s=ABORT_TIMEOUT_S)
        except (RolloutError, *no_answer_errors()):
            pass

    async def _abort_segment(self, server: ServerState, server_rid_: str) -> None:
        if self.behaviour(server).has_abort_requests:  # before: the request ends with its segment
            await self._call(server, "POST", "/abort_requests", abort_body([server_rid_]))

    # ------------------------------------------------------------------ control
    def _mode_for(self, server: ServerState, mode: str) -> str:
        return vllm_pause_mode(mode, self.behaviour(server).version)

    async def pause_all(self, mode: str | None = None) -> None:
        """Pause every server: 'abort' (requests end and are resubmitted after continue) or 'in_place'
        (vLLM's keep: frozen with their KV; needs 0.33.0's per-token versions), 'auto' per server."""
        mode = mode or self.default_pause_mode
        if mode not in ("auto", "abort", "in_place"):
            raise ValueError(f"pause mode {mode!r}: a vLLM server pauses with 'auto', 'abort' or 'in_place'")
        await self._ensure_info(self.servers)
        modes = {s.url: self._mode_for(s, mode) for s in self.servers}
        for s in self.servers:
            if modes[s.url] == "in_place" and not self.behaviour(s).token_weight_versions:
                raise RolloutError(f"pause mode 'in_place' refused for {s.url}: vLLM {s.version} returns no per-token "
                                   f"weight versions (from 0.33.0)")
        for s in self.servers:
            refusal = await self._prefix_cache_refusal(s) if modes[s.url] == "in_place" else None
            if refusal:
                raise RolloutError(refusal)
        self.pause_mode, self.server_pause_modes = mode, modes
        self._running.clear()
        await asyncio.gather(*(self._pause_one(s, modes[s.url]) for s in self.servers))

    async def _pause_one(self, s: ServerState, mode: str) -> None:
        b = self.behaviour(s)
        if not b.has_pause:  # nothing new starts (generate waits); the running requests finish
            while s.in_flight:
                await asyncio.sleep(_DRAIN_POLL_S)
            return
        q = "&".join(f"{k}={v}" for k, v in pause_query(mode, b).items())
        await self._control(s, "POST", f"/pause?{q}")

    async def continue_all(self) -> None:
        """Settle every server whose answers carry no per-token versions (see the module docstring),
        then resume every server."""
        await asyncio.gather(*(self._settle(s) for s in self.servers if self._needs_settle(s)))
        await asyncio.gather(*(self._control(s, "POST", "/resume") for s in self.servers
                               if self.behaviour(s).has_pause))
        self.pause_mode = None
        self.server_pause_modes = {}
        self._running.set()

    def _needs_settle(self, s: ServerState) -> bool:
        b = self.behaviour(s)
        return b.has_abort_requests and not b.token_weight_versions

    async def _settle(self, s: ServerState) -> None:
        """Before ``s`` (no per-token versions) resumes: its new label first, then no segment of
        ours left in flight there (each aborted: it comes back and goes again after resume)."""
        wi = await self._control(s, "GET", "/weight_info")
        s.weight_version = str_or_none((wi or {}).get("weight_version"))
        deadline = asyncio.get_running_loop().time() + self.control_timeout_s
        while s.in_flight:
            if asyncio.get_running_loop().time() > deadline:
                raise RolloutError(f"{s.url}: {s.in_flight} requests still in flight {self.control_timeout_s}s "
                                   f"after the pause; the server cannot be resumed with exact token versions")
            await self._control(s, "POST", "/abort_requests", abort_body(None))
            await asyncio.sleep(_SETTLE_POLL_S)

    async def abort_all(self) -> None:
        await asyncio.gather(*(self._control(s, "POST", "/abort_requests", abort_body(None)) for s in self.servers
                               if self.behaviour(s).has_abort_requests))

    async def flush_cache_all(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> None:
        """Only the in_place rule is checked: vLLM has no flush of its own to wait for. Its prefix cache
        is reset by the pause (abort, or keep with ``clear_cache=true``), not by a reload; an in-place
        pause keeps it, so those servers run without one (see the module docstring)."""
        if not self.may_flush:
            raise RolloutError("flush_cache_all after an in_place pause: the kept requests hold their KV")

    async def weight_versions(self) -> list[str]:
        return [str(await self._current_weight_version(s)) for s in self.servers]
