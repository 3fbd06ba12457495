"""The rollout client's control of every server: the pause state and the control-call policy.

``RolloutClient`` (``areal_fast.rollout.client``) is the server pool (``client_pool``), the
generate path (``client``) and this part, which owns:

- the pause modes the client knows (``rollout.config.PAUSE_MODES``: ``abort``, ``retract``, ``in_place``;
  ``auto`` lets the backend adapter choose per server) and the pause state: ``pause_mode`` and
  ``server_pause_modes`` while paused, and the ``_running`` event that interrupted generations
  wait on until ``continue_all``;
- ``_control``: an idempotent control call with its retry policy (``CONTROL_RETRY``);
- ``may_flush``: the rule that no cache is flushed after an ``in_place`` pause.

What each call is on the wire (``pause_all``, ``continue_all``, ``abort_all``, ``flush_cache_all``,
``weight_versions``) is the backend adapter's (``areal_fast.backends.<name>.client``). Weight
updates are not here: every weight-update transport lives in ``areal_fast.weights``. The
attributes it reads are set by ``RolloutClient.__init__``; the calls go through ``ServerPool``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace as _replace

from areal_fast.rollout.calls import CONTROL_RETRY
from areal_fast.rollout.client_pool import ServerState


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
        ``mode``: one of ``rollout.config.PAUSE_MODE_CHOICES`` (default the client's ``pause_mode``); the
        adapter refuses one its servers cannot take and records ``server_pause_modes``."""
        raise NotImplementedError(f"{type(self).__name__}: pausing is the backend adapter's")

    async def continue_all(self) -> None:
        """Resume every server paused by ``pause_all`` and let the waiting generations go on."""
        raise NotImplementedError(f"{type(self).__name__}: continuing is the backend adapter's")

    @property
    def may_flush(self) -> bool:
        """False after an ``in_place`` pause: requests keep their KV, so a flush cannot succeed (SGLang's
        scheduler crashes on it before 0.5.22 and refuses it from 0.5.22: docs/sglang.md). Pause with
        ``retract`` (or ``abort``) before an update that flushes."""
        return "in_place" not in self.server_pause_modes.values()

    async def abort_all(self) -> None:
        """Abort every request on every server (interrupted client requests are resubmitted)."""
        raise NotImplementedError(f"{type(self).__name__}: aborting is the backend adapter's")

    async def flush_cache_all(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> None:
        """Flush every server's prefix cache (refused after an ``in_place`` pause: ``may_flush``)."""
        raise NotImplementedError(f"{type(self).__name__}: flushing is the backend adapter's")

    async def weight_versions(self) -> list[str]:
        """Each server's current weight version."""
        raise NotImplementedError(f"{type(self).__name__}: weight versions are the backend adapter's")
