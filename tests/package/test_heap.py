"""areal_fast.heap: the C heap's free pages go back to the OS (glibc), and the controller's trimmer
runs only while a run does."""

from __future__ import annotations

import asyncio
import resource
import time
from pathlib import Path

import pytest

from areal_fast import heap
from areal_fast.heap import HeapTrimmer

GLIBC = heap.trim() is not None


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's; elsewhere trim() is a no-op returning None")
def test_trim_returns_freed_pages_below_a_live_chunk():
    """The fragmentation it is for: ~200 MB of 24 KB blocks (below glibc's mmap threshold: they come
    from the heap) freed while a small block allocated after them stays alive. glibc keeps those
    pages (it trims only a heap's top); malloc_trim gives them back."""
    heap.trim()
    blocks = [bytes(24_000) for _ in range(8_000)]  # touched (zeroed): counted in RSS
    keep = bytes(600)  # noqa: F841 - a live chunk above the freed ones (pymalloc takes < 512 B)
    pin = bytearray(32_000)  # allocated after the blocks: the heap's top stays in use
    before = rss_mb()
    del blocks
    held = rss_mb()
    assert held > before - 50, (before, held)  # freed, but still held by the allocator
    assert heap.trim() is True
    after = rss_mb()
    assert after < held - 100, (held, after)
    del pin


def test_the_trimmer_runs_in_its_thread_only_between_start_and_stop():
    t = HeapTrimmer(period_s=0.01)
    assert not t.active and t.calls == 0
    with t:
        assert t.active == GLIBC
        thread = t._thread
        deadline = time.monotonic() + 10
        while GLIBC and t.calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not t.active
    calls = t.calls
    assert (calls >= 3) if GLIBC else calls == 0
    assert thread is None or not thread.is_alive()  # stop() joined it: nothing can call after it
    assert t.calls == calls
    assert t.stats()["calls"] == calls and t.stats()["max_s"] <= t.stats()["busy_s"]


def test_period_zero_starts_no_thread(monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    t = HeapTrimmer()
    assert t.period_s == 0
    with t:
        assert not t.active


@pytest.mark.parametrize("bad", ["soon", "-1", "nan"])
def test_a_bad_period_in_the_environment_is_named(monkeypatch, bad):
    monkeypatch.setenv(heap.ENV, bad)
    with pytest.raises(ValueError, match=heap.ENV):
        HeapTrimmer()


def test_the_controller_runs_the_trimmer_during_run_and_reports_it(tmp_path, monkeypatch):
    from test_controller_buffer import controller

    monkeypatch.setenv(heap.ENV, "0.01")
    ctl = controller(tmp_path, bound_mb=None, steps=3)
    assert ctl.heap.period_s == 0.01 and not ctl.heap.active
    summary = asyncio.run(ctl.run())
    assert not ctl.heap.active  # stopped with the run
    assert summary["heap_trim"] == ctl.heap.stats()


def test_a_bad_period_is_refused_at_config_load(monkeypatch):
    from areal_fast.config import RolloutConfig

    monkeypatch.setenv(heap.ENV, "-2")
    with pytest.raises(ValueError, match="AREAL_FAST_HEAP_TRIM_S='-2'"):
        RolloutConfig()
