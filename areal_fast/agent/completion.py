"""A recorded call as the OpenAI API answers it: the ``ChatCompletion`` JSON (:func:`completion_dict`)
and, for the in-process client, an object with the openai SDK's attributes (:func:`as_completion`).

When the ``openai`` package is installed the object *is* ``openai.types.chat.ChatCompletion``
(imported here, on first use, never at import time); without it, a read-only tree of
:class:`Record` with the same attribute names (``choices[0].message.tool_calls[0].function.arguments``)
and ``model_dump()``. The streamed form (``stream=True``) is :mod:`areal_fast.agent.stream`.

``logprobs=True``: ``choices[0].logprobs.content`` has one entry per recorded output token, in
order: its recorded log-prob (``sample.output_logprobs``), its text decoded alone
(:meth:`Session.token_texts`) and that text's UTF-8 bytes; ``top_logprobs`` is always empty (only
the sampled token's log-prob is recorded; asking for more is refused by the request checks).

With a reasoning parser (``areal_fast.agent.reasoning``) the message has ``reasoning_content``
(the ``<think>`` part) beside ``content``; the SDK's message type keeps the extra field
(``message.reasoning_content``).
"""

from __future__ import annotations

import importlib

from areal_fast.agent.session import ChatCall, Session


def usage_dict(call: ChatCall) -> dict:
    n_prompt, n_out = len(call.sample.prompt_ids), len(call.sample.output_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def logprobs_dict(call: ChatCall, session: Session) -> dict | None:
    """``choices[0].logprobs`` of ``call``: None unless the caller asked ``logprobs=True``."""
    if not call.answer.logprobs:
        return None
    texts = session.token_texts(call.sample.output_ids)
    content = [{"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
               for t, lp in zip(texts, call.sample.output_logprobs, strict=True)]
    return {"content": content, "refusal": None}


def completion_dict(call: ChatCall, session: Session) -> dict:
    """The ``chat.completion`` JSON of ``call`` (the OpenAI API's shape, ``n`` = 1)."""
    message = {"role": "assistant", "content": call.content if (call.content or not call.tool_calls) else None,
               "refusal": None, "tool_calls": [c.to_dict() for c in call.tool_calls] or None}
    if call.reasoning_content is not None:  # a reasoning parser split it off (as vLLM and SGLang name it)
        message["reasoning_content"] = call.reasoning_content
    return {
        "id": call.completion_id,
        "object": "chat.completion",
        "created": int(call.created),
        "model": session.model,
        "choices": [{"index": 0, "message": message, "finish_reason": call.finish_reason,
                     "logprobs": logprobs_dict(call, session)}],
        "usage": usage_dict(call),
        "system_fingerprint": None,
    }


class Record:
    """Attribute access over a JSON object (the fallback when openai is not installed)."""

    def __init__(self, data: dict):
        object.__setattr__(self, "_data", data)

    def __getattr__(self, name):
        try:
            return _wrap(self._data[name])
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("a completion record is read-only")

    def model_dump(self, **_) -> dict:
        return self._data

    def __repr__(self) -> str:
        return f"Record({self._data!r})"


def _wrap(v):
    if isinstance(v, dict):
        return Record(v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


def as_sdk(data: dict, type_name: str = "ChatCompletion"):
    """``openai.types.chat.<type_name>`` (``ChatCompletion``, ``ChatCompletionChunk``) of ``data``
    when openai is installed, else a :class:`Record`."""
    try:
        chat = importlib.import_module("openai.types.chat")
    except ImportError:
        return Record(data)
    return getattr(chat, type_name).model_validate(data)


def as_completion(data: dict):
    """``openai.types.chat.ChatCompletion`` of ``data`` when openai is installed, else a :class:`Record`."""
    return as_sdk(data, "ChatCompletion")
