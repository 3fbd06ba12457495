"""A recorded call as the OpenAI API answers it: the ``ChatCompletion`` JSON (:func:`completion_dict`)
and, for the in-process client, an object with the openai SDK's attributes (:func:`as_completion`).

When the ``openai`` package is installed the object *is* ``openai.types.chat.ChatCompletion``
(imported here, on first use, never at import time); without it, a read-only tree of
:class:`Record` with the same attribute names (``choices[0].message.tool_calls[0].function.arguments``)
and ``model_dump()``.
"""

from __future__ import annotations

from areal_fast.agent.session import ChatCall


def completion_dict(call: ChatCall, model: str) -> dict:
    """The ``chat.completion`` JSON of ``call`` (the OpenAI API's shape, ``n`` = 1)."""
    n_prompt, n_out = len(call.sample.prompt_ids), len(call.sample.output_ids)
    message = {"role": "assistant", "content": call.content if (call.content or not call.tool_calls) else None,
               "refusal": None, "tool_calls": [c.to_dict() for c in call.tool_calls] or None}
    return {
        "id": call.completion_id,
        "object": "chat.completion",
        "created": int(call.created),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": call.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
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


def as_completion(data: dict):
    """``openai.types.chat.ChatCompletion`` of ``data`` when openai is installed, else a :class:`Record`."""
    try:
        from openai.types.chat import ChatCompletion
    except ImportError:
        return Record(data)
    return ChatCompletion.model_validate(data)
