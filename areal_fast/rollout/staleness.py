"""Staleness manager: the rollout-side admission bound of decoupled PPO (``shared/spec/decoupled_ppo.md``).

With B samples per training step, maximum staleness eta and trainer version v, a new generation may
start only while::

    running < max_concurrent  and  accepted + running < (eta + v + 1) * B

``accepted`` counts finished samples accepted into the buffer, ``running`` the generations in flight.
After restoring from a checkpoint at version v, ``accepted = v * B`` and ``running = 0``. eta = 0 is
the synchronous baseline (at most one step of samples ahead of the trainer).

Strict mode additionally checks a finished sample when it is consumed: if any of its tokens was made by
weights older than ``v - eta`` it is dropped; the drop gives its slot back (``accepted -= 1``) so the
controller can generate a replacement, and ``stats.dropped_stale`` records it.

Thread- and asyncio-safe: counters sit behind a lock; ``await acquire()`` waits for capacity and is
woken (via ``call_soon_threadsafe``) by every change that can free capacity.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass


@dataclass
class StalenessStats:
    """Counters for every admission decision (all monotonic)."""

    admitted: int = 0  # generations started
    refused: int = 0  # try_admit calls answered False (no capacity)
    accepted: int = 0  # finished and accepted into the buffer
    rejected: int = 0  # finished but rejected (e.g. filtered), slot freed
    dropped_stale: int = 0  # strict mode: consumed sample with a token older than v - eta
    restores: int = 0


class StalenessManager:
    """Admission control for rollouts; see the module docstring for the rule."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int, *, version: int = 0,
                 strict: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness (eta) must be >= 0, got {max_staleness}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.strict = strict
        self._version = version
        self._accepted = version * batch_size
        self._running = 0
        self.stats = StalenessStats()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        return self._version

    @property
    def accepted(self) -> int:
        return self._accepted

    @property
    def running(self) -> int:
        return self._running

    def bound(self) -> int:
        """(eta + v + 1) * B: the most samples that may be accepted or running at version v."""
        return (self.max_staleness + self._version + 1) * self.batch_size

    def capacity(self) -> int:
        """How many generations may start now."""
        with self._lock:
            return self._capacity_locked()

    def _capacity_locked(self) -> int:
        return max(0, min(self.max_concurrent - self._running, self.bound() - self._accepted - self._running))

    # ------------------------------------------------------------------ admission
    def try_admit(self) -> bool:
        """Start one generation if the bound allows it (running += 1); False otherwise."""
        with self._lock:
            if self._capacity_locked() > 0:
                self._running += 1
                self.stats.admitted += 1
                return True
            self.stats.refused += 1
            return False

    async def acquire(self) -> None:
        """Wait until a generation may start, then admit it."""
        while True:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            with self._lock:
                if self._capacity_locked() > 0:
                    self._running += 1
                    self.stats.admitted += 1
                    return
                self._waiters.append((loop, fut))
            await fut

    def on_accept(self) -> None:
        """A running generation finished and its sample was accepted into the buffer."""
        with self._lock:
            self._check_running()
            self._running -= 1
            self._accepted += 1
            self.stats.accepted += 1
            self._wake_locked()

    def on_reject(self) -> None:
        """A running generation finished (or failed) and its sample was discarded: the slot is free again."""
        with self._lock:
            self._check_running()
            self._running -= 1
            self.stats.rejected += 1
            self._wake_locked()

    def _check_running(self) -> None:
        if self._running <= 0:
            raise RuntimeError("finish reported with no running generation (on_accept/on_reject without admit)")

    # ------------------------------------------------------------------ versions
    def set_version(self, version: int) -> None:
        """The trainer published weights ``version`` (never decreases; use restore() after a reload)."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"version went back from {self._version} to {version}; use restore()")
            self._version = version
            self._wake_locked()

    def restore(self, version: int, accepted: int | None = None) -> None:
        """Recovery from a checkpoint at ``version``: accepted = version * B (the spec), nothing running.

        ``accepted`` overrides the count when the checkpoint also restored buffered samples (they were
        accepted before the crash and still count against the bound).
        """
        if accepted is not None and accepted < 0:
            raise ValueError(f"accepted must be >= 0, got {accepted}")
        with self._lock:
            self._version = version
            self._accepted = version * self.batch_size if accepted is None else accepted
            self._running = 0
            self.stats.restores += 1
            self._wake_locked()

    # ------------------------------------------------------------------ strict mode
    def is_fresh(self, token_versions: list[int]) -> bool:
        """True unless some token is older than v - eta (always True outside strict mode)."""
        if not self.strict or not token_versions:
            return True
        return min(token_versions) >= self._version - self.max_staleness

    def check_consumed(self, token_versions: list[int]) -> bool:
        """Strict mode, when a finished accepted sample is consumed: keep it (True) or drop it (False).

        A dropped sample frees its accepted slot so a replacement can be generated.
        """
        with self._lock:
            if not self.strict or not token_versions:
                return True
            if min(token_versions) >= self._version - self.max_staleness:
                return True
            self.stats.dropped_stale += 1
            self._accepted = max(0, self._accepted - 1)
            self._wake_locked()
            return False

    # ------------------------------------------------------------------ wake-ups
    def _wake_locked(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)

    def __repr__(self) -> str:
        return (f"StalenessManager(v={self._version}, accepted={self._accepted}, running={self._running}, "
                f"bound={self.bound()}, max_concurrent={self.max_concurrent})")


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
