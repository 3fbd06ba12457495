"""The controller process's event loop: uvloop where it is installed, asyncio's otherwise.

    from areal_fast.rollout.loop import run_event_loop
    summary = run_event_loop(main())          # like asyncio.run(main())

uvloop (libuv under the asyncio API) runs the loop's own work (polling, callbacks, timers,
transports) in C; asyncio's loop was 13% of the controller's CPU in a cProfile at 64 servers.
Choice: ``loop=`` (``"auto"``, ``"uvloop"``, ``"asyncio"``), else the environment variable
``AREAL_FAST_EVENT_LOOP``, else ``"auto"``: uvloop when it can be imported, asyncio otherwise (said
once in the log). ``AREAL_FAST_EVENT_LOOP=asyncio`` turns uvloop off; an explicit ``"uvloop"``
that is not installed is an error. uvloop is an optional dependency of the ``rollout`` extra
(Linux and macOS; it does not exist for Windows).

SIGTERM: where the process asked SIGTERM to unwind (a Python handler is installed, as `areal-fast
train` does), the loop takes the signal over while it runs, as asyncio does for Ctrl-C: the signal
cancels the main coroutine from the loop (its ``finally`` blocks run) and ``run_event_loop`` raises
KeyboardInterrupt. A handler that raises wherever the main thread happens to be can land in an
object's ``__del__``, where Python prints the exception and drops it: the run went on training.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

EVENT_LOOP_ENV = "AREAL_FAST_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")

log = logging.getLogger(__name__)
_said_fallback = False
T = TypeVar("T")


def event_loop_choice(loop: str | None = None) -> str:
    """The loop to use, ``"uvloop"`` or ``"asyncio"``, for the setting ``loop`` (see the module docstring)."""
    global _said_fallback
    source = "loop" if loop else EVENT_LOOP_ENV
    choice = (loop or os.environ.get(EVENT_LOOP_ENV) or "auto").strip().lower()
    if choice not in EVENT_LOOPS:
        raise ValueError(f"{source} must be one of {EVENT_LOOPS}, got {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError(f"{source}='uvloop' but uvloop is not installed (pip install uvloop, or "
                               f"{EVENT_LOOP_ENV}=asyncio)") from None
        if not _said_fallback:
            log.info("uvloop is not installed: the controller runs on asyncio's event loop")
            _said_fallback = True
        return "asyncio"
    return "uvloop"


def loop_factory(loop: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for ``asyncio.Runner(loop_factory=...)``: uvloop's, or None for asyncio's default."""
    if event_loop_choice(loop) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run_event_loop(main: Coroutine[Any, Any, T], loop: str | None = None) -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    try:
        factory = loop_factory(loop)
    except BaseException:
        main.close()  # never started: no "coroutine was never awaited" warning on top of the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_sigterm_cancels(main))


async def _sigterm_cancels(main: Coroutine[Any, Any, T]) -> T:
    """Await ``main``; a SIGTERM meanwhile cancels it and becomes KeyboardInterrupt (module docstring).
    Left alone: SIGTERM's default (the process dies) or ignored, and any thread but the main one."""
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):
        return await main
    task, loop, hit = asyncio.current_task(), asyncio.get_running_loop(), []

    def on_sigterm() -> None:
        hit.append(signal.SIGTERM)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        result = await main
    except asyncio.CancelledError:
        if not hit:
            raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)  # sets SIG_DFL: the process's own handler again
        signal.signal(signal.SIGTERM, previous)
    if hit:  # also when main caught the cancellation and returned
        raise KeyboardInterrupt(f"signal {signal.SIGTERM.value}")
    return result
