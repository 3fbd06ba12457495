"""The controller's event loop (``areal_fast.rollout.loop``): uvloop or asyncio's, and SIGTERM
delivered through the loop (the main coroutine is cancelled, its ``finally`` blocks run, then
KeyboardInterrupt)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from areal_fast.rollout import loop as loopmod


async def _loop_name() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_event_loop_choice(monkeypatch, caplog):
    pytest.importorskip("uvloop", reason="uvloop is an optional dependency (rollout extra, Linux/macOS)")
    monkeypatch.delenv(loopmod.EVENT_LOOP_ENV, raising=False)
    assert loopmod.run_event_loop(_loop_name()) == "uvloop"  # auto, installed
    assert loopmod.run_event_loop(_loop_name(), "asyncio") == "asyncio"
    monkeypatch.setenv(loopmod.EVENT_LOOP_ENV, "asyncio")
    assert loopmod.run_event_loop(_loop_name()) == "asyncio"
    monkeypatch.setenv(loopmod.EVENT_LOOP_ENV, "tokio")
    coro = _loop_name()
    with pytest.raises(ValueError, match="AREAL_FAST_EVENT_LOOP must be one of"):
        loopmod.run_event_loop(coro)
    assert coro.cr_frame is None  # closed, never left un-awaited


def test_event_loop_falls_back_once_without_uvloop(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    monkeypatch.setattr(loopmod, "_said_fallback", False)
    monkeypatch.delenv(loopmod.EVENT_LOOP_ENV, raising=False)
    with caplog.at_level("INFO", logger=loopmod.__name__):
        assert loopmod.run_event_loop(_loop_name()) == "asyncio"
        assert loopmod.run_event_loop(_loop_name()) == "asyncio"
    assert [r.message for r in caplog.records].count(
        "uvloop is not installed: the controller runs on asyncio's event loop") == 1
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        loopmod.run_event_loop(_loop_name(), "uvloop")


@pytest.fixture
def sigterm_handler():
    """A Python SIGTERM handler, as `areal-fast train` installs: it records, and raises as the CLI's does."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler, calls
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_sigterm_cancels_the_main_coroutine_through_the_loop(loop, sigterm_handler):
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is an optional dependency (rollout extra, Linux/macOS)")
    handler, calls = sigterm_handler
    seen = []

    async def main():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        loopmod.run_event_loop(main(), loop)
    assert seen == ["cancelled", "finally"]
    assert calls == []  # the raising handler never ran: it could have landed in some object's __del__
    assert signal.getsignal(signal.SIGTERM) is handler  # the process's handler again afterwards


def test_sigterm_is_still_an_interrupt_when_main_swallows_the_cancel(sigterm_handler):
    async def main():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "went on"

    with pytest.raises(KeyboardInterrupt):
        loopmod.run_event_loop(main(), "asyncio")


def test_sigterm_left_alone_without_a_python_handler():
    async def main():
        return signal.getsignal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert loopmod.run_event_loop(main(), "asyncio") is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
