"""The staleness gate: the admission bound of decoupled PPO (described in ``docs/staleness.md``).

With B samples per training step, maximum staleness eta and trainer version v, a new generation may
start only while::

    running < max_concurrent  and  accepted + running < (eta + v + 1) * B

``accepted`` counts finished samples accepted into the buffer, ``running`` the generations in flight.
eta = 0 is the synchronous baseline (at most one step of samples ahead of the trainer).

Strict mode additionally checks a finished sample when it is consumed: if any of its tokens was made by
weights older than ``v - eta`` it is dropped; the drop gives its slot back (``accepted -= 1``) so the
controller can generate a replacement.

:class:`StalenessManager` is the one implementation of this rule; it is the controller's ``Gate``
(``areal_fast.controller.Gate``) as it is, with no adapter in between.

The bound holds for groups that finish in the order they were admitted. A server that queues
requests by arrival breaks that order after every abort pause: every interrupted request is sent
again, all at once, and arrives in no particular order, so an old request can wait behind newer
ones through several updates. :data:`ADMISSION_ORDER` is the admission number of the group a request
belongs to (the controller sets it for each group's task; its episodes' requests inherit it), which
the rollout client sends as the request's scheduling priority where the server runs priority
scheduling (vLLM's ``--scheduling-policy priority``: ``docs/staleness.md``), so an interrupted
request keeps its place in the queue.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import asdict, dataclass

ADMISSION_ORDER: ContextVar[int | None] = ContextVar("areal_fast_admission_order", default=None)
"""The admission number (1, 2, ... over the run) of the group whose task is running, None outside a
group (evaluation, a client used on its own). Set by the controller's admission loop when it
starts a group's task, which inherits it, as do the tasks it starts (its episodes). See the module docstring."""


@dataclass
class StalenessStats:
    """Counters of every decision (all monotonic)."""

    admitted: int = 0  # generations started
    refused: int = 0  # try_admit calls answered False (no capacity)
    accepted: int = 0  # finished and accepted into the buffer
    rejected: int = 0  # finished but rejected (failed, filtered), slot freed
    dropped_stale: int = 0  # strict mode: consumed sample with a token older than v - eta
    restores: int = 0


class StalenessManager:
    """Admission control for rollouts; see the module docstring for the rule.

    The counters sit behind a lock, so a manager may be shared with threads (the controller itself
    calls it from its one event loop)."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int, *, version: int = 0,
                 strict: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness (eta) must be >= 0, got {max_staleness}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.strict = strict
        self._version = version
        self._accepted = version * batch_size
        self._running = 0
        self.counts = StalenessStats()
        self._lock = threading.Lock()

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

    def stats(self) -> dict:
        """The counts the bound uses now (accepted, running, bound) and the monotonic counters."""
        with self._lock:
            c = asdict(self.counts)
            del c["accepted"]  # the monotonic count; "accepted" below is the one the bound uses
            return {"accepted": self._accepted, "running": self._running, "bound": self.bound(), **c}

    # ------------------------------------------------------------------ admission
    def try_admit(self) -> bool:
        """Start one generation if the bound allows it (running += 1); False otherwise."""
        with self._lock:
            if self._capacity_locked() > 0:
                self._running += 1
                self.counts.admitted += 1
                return True
            self.counts.refused += 1
            return False

    def finish(self, accepted: bool) -> None:
        """A running generation ended: its sample was accepted into the buffer (``accepted=True``) or
        discarded (failed, filtered: the slot is free again)."""
        with self._lock:
            if self._running <= 0:
                raise RuntimeError("finish() reported with no running generation (finish without try_admit)")
            self._running -= 1
            if accepted:
                self._accepted += 1
                self.counts.accepted += 1
            else:
                self.counts.rejected += 1

    # ------------------------------------------------------------------ versions
    def set_version(self, version: int) -> None:
        """The trainer published weights ``version`` (never decreases; use restore() after a reload)."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"version went back from {self._version} to {version}; use restore()")
            self._version = version

    def restore(self, version: int, accepted: int | None = None) -> None:
        """Recovery from a checkpoint at ``version``: accepted = version * B.

        ``accepted`` overrides the count when the checkpoint also restored buffered samples (they were
        accepted before and still count against the bound). Generations still running keep their
        slots: ``running`` is not touched, so when they finish the count stays right (until they do,
        they hold back new admissions exactly as before the restore).
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if accepted is not None and accepted < 0:
            raise ValueError(f"accepted must be >= 0, got {accepted}")
        with self._lock:
            self._version = version
            self._accepted = version * self.batch_size if accepted is None else accepted
            self.counts.restores += 1

    # ------------------------------------------------------------------ strict mode
    def check_consumed(self, token_versions: list[int]) -> bool:
        """When a finished accepted sample is consumed: keep it (True) or drop it (False, strict mode
        only, when a token is older than v - eta). A dropped sample frees its accepted slot so a
        replacement can be generated."""
        with self._lock:
            if not self.strict or not token_versions:
                return True
            if min(token_versions) >= self._version - self.max_staleness:
                return True
            self.counts.dropped_stale += 1
            self._accepted = max(0, self._accepted - 1)
            return False

    def __repr__(self) -> str:
        return (f"StalenessManager(v={self._version}, accepted={self._accepted}, running={self._running}, "
                f"bound={self.bound()}, max_concurrent={self.max_concurrent}, strict={self.strict})")
