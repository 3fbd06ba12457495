"""The openai SDK's own keywords of ``create`` (``extra_body``, ``extra_headers``, ``extra_query``,
``timeout``, ``NOT_GIVEN`` / ``omit``), treated as ``AsyncOpenAI`` treats them, for the in-process
clients of chat completions (``agent/client.py``) and of the Responses API (``agent/responses.py``)."""

from __future__ import annotations

import asyncio
import sys

from areal_fast.agent.request import ChatRequestError, culprit

SDK_ONLY = ("extra_headers", "extra_query", "extra_body", "timeout")
"""``create``'s keywords of the SDK itself, not of the request (see the module docstring)."""


def _absent(value) -> bool:
    """``openai.NOT_GIVEN`` / ``openai.omit`` (checked by type, without importing openai)."""
    t = type(value)
    return t.__name__ in ("NotGiven", "Omit") and t.__module__.split(".")[0] == "openai"


def sdk_body(kwargs: dict) -> tuple[dict, float | None]:
    """``create``'s keywords as the request body the SDK would send, and the timeout in seconds."""
    body = {k: v for k, v in kwargs.items() if k not in SDK_ONLY and not _absent(v)}
    extra = kwargs.get("extra_body")
    if extra is not None and not _absent(extra):
        if not isinstance(extra, dict):
            raise ChatRequestError(f"extra_body: expected a mapping, got {type(extra).__name__}", "extra_body")
        body.update(extra)  # the SDK merges it into the JSON body, over the named parameters
    timeout = kwargs.get("timeout")
    if timeout is None or _absent(timeout):
        return body, None
    if hasattr(timeout, "read"):  # an httpx Timeout: the wait for the answer
        timeout = timeout.read
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise ChatRequestError(f"timeout: expected seconds > 0, None or an httpx Timeout, got {culprit(timeout)}",
                               "timeout")
    return body, timeout


def _timeout_error(seconds: float) -> Exception:
    """What the SDK raises when the answer does not come in time."""
    openai = sys.modules.get("openai")
    for name in ("httpx2", "httpx"):
        httpx = sys.modules.get(name)
        if openai is not None and httpx is not None and hasattr(openai, "APITimeoutError"):
            try:
                return openai.APITimeoutError(request=httpx.Request("POST", "http://in-process/chat/completions"))
            except TypeError:
                continue
    return TimeoutError(f"the chat completion took longer than timeout={seconds} s")


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a turn nobody waits for any more: its error is not "never retrieved"


async def within(turn, timeout: float):
    """Await the coroutine ``turn`` at most ``timeout`` seconds, as the SDK's ``timeout`` does: past
    it the SDK's timeout error is raised and the turn goes on (it finishes and is recorded, as over
    HTTP where the server finishes a turn whose client left); cancelling the caller cancels it."""
    task = asyncio.ensure_future(turn)
    task.add_done_callback(_retrieve)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        raise _timeout_error(timeout) from None
    except asyncio.CancelledError:  # the episode itself is cancelled (shutdown): so is its turn
        task.cancel()
        raise
