"""The SGLang adapter of the rollout client: :class:`SGLangRolloutClient` drives SGLang servers (real
ones or the embedded engine, SGLang's twin) with the generic client core of ``rollout/client.py``.

What SGLang says its way (``docs/sglang.md``; the gates are ``compat.py``'s):

- a server's facts are ``GET /server_info`` (``/get_server_info`` on servers older than it), and
  from 0.5.19 its current weight version is in ``/model_info`` (``/server_info`` keeps the launch value);
- a segment is ``POST /generate`` with the client's segment request as it is (it is SGLang's body),
  its answer read by ``rollout.answer.parse_generate``;
- abort is ``/abort_request`` (a rid prefix: the client's server rids are never prefixes of another);
- pause is ``/pause_generation`` with a mode (from 0.5.6; ``auto``: :func:`auto_pause_mode`), continue
  ``/continue_generation``, flush ``/flush_cache`` (400 while requests hold KV: polled);
- before 0.5.22 an unknown sampling key is a bare 500 naming a TypeError: the caller's error
  (``compat.refuses_unknown_sampling_keys_with_400``); the keys SGLang knows are checked first.
"""

from __future__ import annotations

import asyncio
from functools import partial

from packaging.version import Version

from areal_fast.backends.sglang.compat import (
    PAUSE_MODE_SINCE,
    SGLANG_SAMPLING_KEYS,
    in_place_server_refusal,
    refuses_unknown_sampling_keys_with_400,
    reports_weight_version_spans,
    server_info_reports_launch_version,
    supports_pause_mode,
)
from areal_fast.rollout.answer import AnswerError, Segment, parse_generate
from areal_fast.rollout.calls import RequestError, RetryPolicy, RolloutError, no_answer_errors
from areal_fast.rollout.client import ABORT_TIMEOUT_S, MalformedAnswer, RolloutClient
from areal_fast.rollout.client_pool import ServerState, apply_server_info, str_or_none
from areal_fast.rollout.config import PAUSE_MODE_CHOICES


def auto_pause_mode(version: Version) -> str:
    """The pause mode ``"auto"`` picks for a server of SGLang ``version``.

    ``retract`` from 0.5.19: requests stay on the server (their KV is dropped and recomputed by the
    new weights after continue), nothing comes back to the client, and the answer's weight_versions
    spans label each token with the weights that made it. Before 0.5.19 an answer has one
    weight_version for all its tokens, so a retracted request's tokens from before the update would
    be labelled with the new version: ``abort`` (the client resubmits, one version per segment)."""
    return "retract" if reports_weight_version_spans(version) else "abort"


class SGLangRolloutClient(RolloutClient):
    """``RolloutClient`` over SGLang servers (and the embedded engine); see the module docstring."""

    SAMPLING_KEYS = SGLANG_SAMPLING_KEYS
    SAMPLING_KEYS_OF = "SGLang"
    UNKNOWN_KEY_NOTE = " (SGLang answers it with a bare 500 before 0.5.22 and a 400 from 0.5.22)"
    INFO_PATH = "GET /server_info"

    def _caller_500(self, server: ServerState) -> bool:
        return not server.info or not refuses_unknown_sampling_keys_with_400(server.version)

    # ------------------------------------------------------------------ facts
    async def _read_info(self, s: ServerState) -> dict:
        """GET /server_info (falls back to the deprecated /get_server_info of old servers) and /model_info."""
        try:
            info = await self._call(s, "GET", "/server_info", timeout_s=self._short_timeout_s)
        except RequestError as e:
            if e.status not in (404, 405):  # a server older than /server_info
                raise
            info = await self._call(s, "GET", "/get_server_info", timeout_s=self._short_timeout_s)
        apply_server_info(s, info)
        if not server_info_reports_launch_version(s.version):
            s.weight_version = str_or_none(s.info.get("weight_version"))
        else:  # from 0.5.19 server_info holds the launch value; the current one is in /model_info
            try:
                mi = await self._call(s, "GET", "/model_info", timeout_s=self._short_timeout_s)
                s.weight_version = str_or_none((mi or {}).get("weight_version"))
            except RolloutError:
                pass
        return s.info

    async def _current_weight_version(self, server: ServerState) -> str | None:
        try:
            mi = await self._call(server, "GET", "/model_info", timeout_s=self._short_timeout_s)
        except (RolloutError, *no_answer_errors()):
            return None
        server.weight_version = str_or_none((mi or {}).get("weight_version"))
        return server.weight_version

    # ------------------------------------------------------------------ generation
    async def _post_segment(self, server: ServerState, payload: dict, attempt_rid: str, max_body: int) -> Segment:
        where = f"{server.url}/generate (rid {attempt_rid!r})"
        try:
            data = await self._call(server, "POST", "/generate", {**payload, "rid": attempt_rid},
                                    timeout_s=self.request_timeout_s, max_body=max_body,
                                    parse=partial(parse_generate, where=where, vocab=self.vocab_size))
        except AnswerError as e:
            raise MalformedAnswer(server.url, attempt_rid, str(e)) from None
        if not isinstance(data, Segment):  # a 2xx that was not JSON
            raise MalformedAnswer(server.url, attempt_rid, f"{where} answered {type(data).__name__}, "
                                  f"not one result: {str(data)[:200]}")
        if data.rid is not None and data.rid != attempt_rid:
            raise MalformedAnswer(server.url, attempt_rid, f"{where}: the answer is for rid {data.rid!r}")
        return data

    async def _abort_quietly(self, server: ServerState, server_rid_: str) -> None:
        try:
            async with asyncio.timeout(ABORT_TIMEOUT_S):
                await self._call(server, "POST", "/abort_request", {"rid": server_rid_, "abort_all": False},
                                 timeout_s=ABORT_TIMEOUT_S)
        except (RolloutError, *no_answer_errors()):
            pass

    async def _abort_segment(self, server: ServerState, server_rid_: str) -> None:
        await self._call(server, "POST", "/abort_request", {"rid": server_rid_, "abort_all": False})

    # ------------------------------------------------------------------ control
    async def pause_all(self, mode: str | None = None) -> None:
        """Pause every server; interrupted requests wait in ``generate`` until ``continue_all()``.

        ``abort`` ends running requests (the client resubmits them after continue); ``retract``
        keeps them on the server without KV (recomputed after continue); ``in_place`` keeps them
        with their KV, so no update may flush the cache until continue (see ``may_flush``); it is
        refused up front for a server that cannot label tokens exactly across such an update
        (SGLang < 0.5.19, or without --disable-overlap-schedule / --disable-radix-cache).
        ``auto`` (the default: the client's ``pause_mode``) chooses per server by its SGLang
        version (:func:`auto_pause_mode`): retract from 0.5.19, abort before, and abort for a
        server whose version is not known yet. ``server_pause_modes`` holds what each got.
        """
        mode = mode or self.default_pause_mode
        if mode not in PAUSE_MODE_CHOICES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODE_CHOICES}, got {mode!r}")
        await self._ensure_info(self.servers)

        def knows_modes(s: ServerState) -> bool:  # a server still without facts is taken as current
            return not s.info or supports_pause_mode(s.version)

        old = [s.url for s in self.servers if not knows_modes(s)]
        if mode not in ("abort", "auto") and old:
            raise RolloutError(f"pause mode {mode!r} needs SGLang >= {PAUSE_MODE_SINCE}; {old[0]} is older")
        if mode == "in_place":
            self._check_in_place()
        modes = {s.url: (auto_pause_mode(s.version) if s.info else "abort") if mode == "auto" else mode
                 for s in self.servers}
        self.pause_mode = mode
        self.server_pause_modes = modes
        self._running.clear()
        await asyncio.gather(*(self._control(s, "POST", "/pause_generation",
                                             {"mode": modes[s.url]} if knows_modes(s) else {})
                               for s in self.servers))

    def _check_in_place(self) -> None:
        """Refuse an in_place pause, before any server is paused, when a server cannot keep every
        token's version exact across an update without flush (``compat.in_place_server_refusal``)."""
        for s in self.servers:
            why = (in_place_server_refusal(s.info, s.version) if s.info
                   else "its /server_info did not answer (version and flags unknown)")
            if why:
                raise RolloutError(f"pause mode 'in_place' refused for {s.url}: {why}")

    async def continue_all(self) -> None:
        await self._all("POST", "/continue_generation", {})
        self.pause_mode = None
        self.server_pause_modes = {}
        self._running.set()

    async def abort_all(self) -> None:
        """Abort every request on every server (interrupted client requests are resubmitted)."""
        await self._all("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def flush_cache_all(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> None:
        """POST /flush_cache on every server, retrying each while it answers 400 (requests still hold KV)."""
        if not self.may_flush:
            raise RolloutError("flush_cache_all after an in_place pause: the paused requests keep their KV, so "
                               "the flush cannot succeed; pause with mode='retract' or 'abort' to flush")

        # 400 is transient here (requests still hold KV): retried every poll_s until the deadline
        policy = RetryPolicy(timeout_s=self.control_timeout_s, attempts=None, deadline_s=timeout_s, backoff_s=poll_s,
                             backoff_max_s=poll_s, retry_statuses=frozenset({400}))
        await asyncio.gather(*(self._call(s, "POST", "/flush_cache", policy=policy) for s in self.servers))

    async def weight_versions(self) -> list[str]:
        """Each server's current weight_version (from /model_info; /server_info's is the launch value)."""
        return [str(d.get("weight_version")) for d in await self._all("GET", "/model_info")]
