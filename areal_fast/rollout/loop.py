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
"""

from __future__ import annotations

import asyncio
import logging
import os
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
        return runner.run(main)
