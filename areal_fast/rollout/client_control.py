"""The rollout client's control of every server: pause, continue, abort all, flush, versions.

``RolloutClient`` (``areal_fast.rollout.client``) is the server pool (``client_pool``), the
generate path (``client``) and this part, which owns:

- the pause modes and the choice ``"auto"`` makes per server (:func:`auto_pause_mode`);
- the pause state: ``pause_mode`` and ``server_pause_modes`` while paused, and the ``_running``
  event that interrupted generations wait on until ``continue_all``;
- the control calls sent to every server (``pause_all``, ``continue_all``, ``abort_all``,
  ``flush_cache_all``, ``weight_versions``), each with its retry policy (``CONTROL_RETRY``, or the
  400-while-busy poll of /flush_cache).

Weight updates are not here: every weight-update transport lives in ``areal_fast.weights``. The
attributes it reads are set by ``RolloutClient.__init__``; the calls go through ``ServerPool``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace as _replace

from packaging.version import Version

from areal_fast.backends.sglang.compat import (
    PAUSE_MODE_SINCE,
    in_place_server_refusal,
    reports_weight_version_spans,
    supports_pause_mode,
)
from areal_fast.rollout.calls import CONTROL_RETRY, RetryPolicy, RolloutError
from areal_fast.rollout.client_pool import ServerState

PAUSE_MODES = ("abort", "retract", "in_place")
PAUSE_MODE_CHOICES = ("auto", *PAUSE_MODES)


def auto_pause_mode(version: Version) -> str:
    """The pause mode ``"auto"`` picks for a server of SGLang ``version``.

    ``retract`` from 0.5.19: requests stay on the server (their KV is dropped and recomputed by the
    new weights after continue), nothing comes back to the client, and the answer's weight_versions
    spans label each token with the weights that made it. Before 0.5.19 an answer has one
    weight_version for all its tokens, so a retracted request's tokens from before the update would
    be labelled with the new version: ``abort`` (the client resubmits, one version per segment)."""
    return "retract" if reports_weight_version_spans(version) else "abort"


class ServerControl:
    """Pause, continue, abort and flush every server of the pool; see the module docstring."""

    @property
    def is_paused(self) -> bool:
        """True between our ``pause_all`` and ``continue_all`` (the servers answer 503 on /health then)."""
        return self.pause_mode is not None

    @property
    def paused(self) -> bool:  # older name
        return self.is_paused

    # ------------------------------------------------------------------ control of all servers
    async def _control(self, server: ServerState, method: str, path: str, body: dict | None = None):
        """An idempotent control call (pause, continue, abort, info), sent again once when its
        connection broke (``CONTROL_RETRY``; on aiohttp it goes on a new connection; on our pool, on
        a kept-alive one checked as for /generate)."""
        policy = _replace(CONTROL_RETRY, timeout_s=self.control_timeout_s)
        return await self._call(server, method, path, body, control=True, policy=policy)

    async def _all(self, method: str, path: str, body: dict | None = None) -> list:
        return await asyncio.gather(*(self._control(s, method, path, body) for s in self.servers))

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

    @property
    def may_flush(self) -> bool:
        """False after an ``in_place`` pause: requests keep KV, and an update with flush_cache then
        crashes SGLang's scheduler (0.5.6-0.5.21) or is refused (0.5.22+). Pause with ``retract``
        (or ``abort``) before an update that flushes."""
        return "in_place" not in self.server_pause_modes.values()

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
