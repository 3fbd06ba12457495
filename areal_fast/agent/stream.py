"""``stream=True``: a recorded call as the OpenAI API streams it (``chat.completion.chunk`` objects).

The rollout path generates a turn whole (interrupted and resumed across weight updates, each token
with its version), so the stream is *buffered*: it starts once the turn is generated and recorded,
and carries the whole answer at once. The chunks, all with the completion's ``id``/``created``:

1. ``delta: {"role": "assistant", "content": ""}``;
2. when there is anything to say: ``delta.reasoning_content`` (with a reasoning parser),
   ``delta.content`` (the whole text) and ``delta.tool_calls`` (each call whole, with its
   ``index``), and the log-probs when asked (``logprobs=True``);
3. ``delta: {}`` with the ``finish_reason``;
4. with ``stream_options: {"include_usage": true}``: ``choices: []`` and ``usage`` (every earlier
   chunk then has ``usage: null``, as the OpenAI API).

Over HTTP each chunk is a server-sent event ``data: <json>\\n\\n`` and ``data: [DONE]\\n\\n`` ends
the stream (:func:`sse_body`). The in-process client returns a :class:`ChunkStream`, which behaves
as the openai SDK's ``AsyncStream``. A refused request never starts a stream: the request is checked
(and the turn generated) first, so the refusal is still a 400.
"""

from __future__ import annotations

import json

from areal_fast.agent.completion import as_sdk, logprobs_dict, usage_dict
from areal_fast.agent.session import ChatCall, Session

DONE = b"data: [DONE]\n\n"


def chunk_dicts(call: ChatCall, session: Session) -> list[dict]:
    """The ``chat.completion.chunk`` JSON objects of ``call``, in order (see the module docstring)."""
    head = {"id": call.completion_id, "object": "chat.completion.chunk", "created": int(call.created),
            "model": session.model, "system_fingerprint": None}
    if call.answer.include_usage:
        head["usage"] = None

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    delta: dict = {}
    if call.reasoning_content:
        delta["reasoning_content"] = call.reasoning_content
    if call.content:
        delta["content"] = call.content
    if call.tool_calls:
        delta["tool_calls"] = [{"index": k, **c.to_dict()} for k, c in enumerate(call.tool_calls)]
    logprobs = logprobs_dict(call, session)
    if delta or logprobs is not None:
        out.append(chunk(delta, logprobs=logprobs))
    out.append(chunk({}, call.finish_reason))
    if call.answer.include_usage:
        out.append({**head, "choices": [], "usage": usage_dict(call)})
    return out


def sse_body(chunks: list[dict]) -> bytes:
    """The server-sent events of ``chunks``, then ``[DONE]``."""
    return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks) + DONE


_DELTA = ("role", "content", "refusal", "tool_calls", "function_call")


def _unset_as_none(chunk: dict) -> dict:
    """``chunk`` with the fields a delta or chunk leaves out written as None, as the SDK's types read
    them (so the ``Record`` fallback answers ``delta.tool_calls`` too)."""
    choices = [{**c, "delta": {**dict.fromkeys(_DELTA), **c["delta"]}} for c in chunk["choices"]]
    return {"usage": None, **chunk, "choices": choices}


class ChunkStream:
    """What the in-process ``create(stream=True)`` returns, as the SDK's ``AsyncStream``:
    ``async for chunk in stream``, ``async with stream``, ``await stream.close()``. The chunks are
    ``openai.types.chat.ChatCompletionChunk`` when openai is installed, else ``Record``."""

    def __init__(self, chunks: list[dict]):
        self._chunks = iter([as_sdk(_unset_as_none(c), "ChatCompletionChunk") for c in chunks])

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self):
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    async def close(self) -> None:
        """Drop the chunks not read (the call is recorded either way)."""
        self._chunks = iter(())

    async def __aenter__(self) -> ChunkStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
