"""Give freed C-heap memory back to the OS while the controller runs (glibc only).

Why: the controller's memory is mostly short-lived column arrays (answers, trajectories, groups
spilled or trained) of tens of KB each, allocated by CPython through ``malloc``. glibc returns
freed memory to the OS only from the top of a heap; below a live chunk it stays mapped and counts
in RSS. At 256 servers / 16,384 requests in flight with full-length answers, ``mallinfo2`` showed
1.0-1.2 GB freed but still held at the RSS peak, more than the columns actually alive (0.7-0.9 GB).
jemalloc and mimalloc purge such pages after a decay time; :class:`HeapTrimmer` does the same for
glibc: a daemon thread calls ``malloc_trim(0)`` every ``period_s`` seconds, which returns every
whole free page of every arena (``madvise(MADV_DONTNEED)``), not only the heap tops.

Cost: 9-21 ms a call on average at that scale (max 54-117 ms), in its own thread with the GIL
released; the event loop's ``malloc`` calls wait for an arena's lock while that arena is trimmed.

Elsewhere (musl, macOS, a build without ``malloc_trim``) :func:`trim` returns None and the trimmer
does nothing. ``AREAL_FAST_HEAP_TRIM_S`` sets the period (seconds; ``0`` turns it off).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

DEFAULT_PERIOD_S = 1.0
ENV = "AREAL_FAST_HEAP_TRIM_S"

_malloc_trim = None  # resolved on first use: False where there is none


def _resolve():
    global _malloc_trim
    if _malloc_trim is None:
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _malloc_trim = fn
        except (OSError, AttributeError):
            _malloc_trim = False
    return _malloc_trim


def trim() -> bool | None:
    """Return the C heap's free pages to the OS now. True if some memory was released, False if
    none could be, None where the C library has no ``malloc_trim``."""
    fn = _resolve()
    return None if fn is False else bool(fn(0))


def period_from_env(default: float = DEFAULT_PERIOD_S) -> float:
    """The trim period: ``AREAL_FAST_HEAP_TRIM_S`` when set (a number of seconds >= 0; 0 = off)."""
    text = os.environ.get(ENV)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: not a number of seconds (0 turns heap trimming off)") from None
    if not value >= 0:
        raise ValueError(f"{ENV}={text!r}: must be >= 0 seconds (0 turns heap trimming off)")
    return value


class HeapTrimmer:
    """``with HeapTrimmer():`` trims the C heap every ``period_s`` seconds in a daemon thread until
    the block ends. ``calls``, ``busy_s`` and ``max_s`` say what it cost."""

    def __init__(self, period_s: float | None = None):
        self.period_s = period_from_env() if period_s is None else float(period_s)
        if not self.period_s >= 0:
            raise ValueError(f"HeapTrimmer: period_s must be >= 0, got {period_s!r}")
        self.calls = 0
        self.busy_s = self.max_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> HeapTrimmer:
        if self._thread is None and self.period_s > 0 and _resolve() is not False:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="areal-fast-heap-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        t, self._thread = self._thread, None
        if t is not None:
            self._stop.set()
            t.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            t0 = time.perf_counter()
            trim()
            d = time.perf_counter() - t0
            self.calls += 1
            self.busy_s += d
            self.max_s = max(self.max_s, d)

    def stats(self) -> dict:
        return {"calls": self.calls, "busy_s": self.busy_s, "max_s": self.max_s}

    def __enter__(self) -> HeapTrimmer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
