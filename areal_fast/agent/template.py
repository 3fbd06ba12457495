"""Chat templates: messages to token ids, once per turn, and the model's output back to a message.

A template has three jobs (``docs/agents.md``):

- ``render(before, new, tools)``: the token ids of the messages ``new`` that follow the messages
  ``before`` (already in the context as tokens), then the generation prompt; and where each new
  message ends. Only the new messages are tokenized: the context is never re-encoded.
- ``close_turn(output_ids)``: the end-of-turn tokens the template would have written after the
  model's output when the model did not write them (the turn was cut at ``max_tokens``).
- ``parse(output_ids, tools)``: the assistant message's text and the tool calls in it, in the
  template's format of tool calls.

Two templates ship:

:class:`TinyChatTemplate`, for the character tokenizer of the tiny tasks (whose vocabulary is a
dozen characters: it cannot spell a role name or a JSON schema). Written for this package::

    system     <content>
    user       <bos><content>
    assistant  <content><eos>           (a call: the call's text, see below)
    tool       <content>
    generation prompt: nothing (the model writes right after the last message)

Tools are not rendered (the vocabulary cannot spell them). The tools format: when exactly one
tool is offered and ``call_marker`` is set, an output that contains ``call_marker`` is a call of
that tool whose arguments are ``{"<its first parameter>": "<the output's text>"}``; any other
output is text. The tiny tool task's model writes calls as text containing ``*``
(``areal_fast/data/tool_task.py``), so its template is ``TinyChatTemplate(tok, call_marker="*")``.

:class:`HFChatTemplate`, for a Hugging Face tokenizer that has a chat template (e.g. Qwen2.5):
the tokenizer's own Jinja template renders, with ``tools``; tool calls are parsed in the Hermes
format those templates teach (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). The
new messages' ids are the tokens of the text the template adds after ``before``: the template
is rendered for ``before`` and for ``before + new`` and the difference tokenized.
"""

from __future__ import annotations

import json
import re
from typing import Protocol

from areal_fast.agent.request import ChatRequestError, Message, Tool, ToolCall


class ChatTemplate(Protocol):
    renders_tools: bool
    """True when the tools are part of the rendered context (a change of tools re-renders it)."""

    def render(self, before: tuple[Message, ...], new: tuple[Message, ...],
               tools: tuple[Tool, ...]) -> tuple[list[int], list[int]]: ...
    def close_turn(self, output_ids) -> list[int]: ...
    def parse(self, output_ids, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]: ...


def call_id(completion_id: str, k: int) -> str:
    """The id of the ``k``-th tool call of a completion (unique in the run, as completion ids are)."""
    return f"call_{completion_id.removeprefix('chatcmpl-')}_{k}"


class TinyChatTemplate:
    """The tiny tasks' template (see the module docstring)."""

    renders_tools = False

    def __init__(self, tokenizer, call_marker: str | None = None):
        self.tok = tokenizer
        self.call_marker = call_marker or None
        self.bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
        self.eos = tokenizer.eos_token_id

    def _encode(self, text: str, i: int) -> list[int]:
        try:
            return list(self.tok.encode(text, add_bos=False))
        except ValueError as e:
            raise ChatRequestError(f"messages[{i}].content: {e}", f"messages[{i}].content") from None

    def _message(self, m: Message, i: int) -> list[int]:
        if m.role == "user":
            return self.bos + self._encode(m.content, i)
        if m.role == "assistant":
            text = m.content or "".join(self._call_text(c) for c in m.tool_calls)
            return self._encode(text, i) + [self.eos]
        return self._encode(m.content, i)  # system, tool: plain text

    @staticmethod
    def _call_text(call: ToolCall) -> str:
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError:
            return call.arguments
        return "".join(str(v) for v in args.values()) if isinstance(args, dict) else str(args)

    def render(self, before, new, tools):
        ids: list[int] = []
        ends: list[int] = []
        for i, m in enumerate(new, start=len(before)):
            ids += self._message(m, i)
            ends.append(len(ids))
        return ids, ends

    def close_turn(self, output_ids) -> list[int]:
        return [] if len(output_ids) and output_ids[-1] == self.eos else [self.eos]

    def parse(self, output_ids, tools):
        text = self.tok.decode(list(output_ids))
        if self.call_marker and len(tools) == 1 and self.call_marker in text:
            tool = tools[0]
            return "", [ToolCall(id="", name=tool.name, arguments=json.dumps({tool.first_parameter(): text}))]
        return text, []


_MARK = "AREALFASTMARK"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class HFChatTemplate:
    """A Hugging Face tokenizer's own chat template (see the module docstring)."""

    renders_tools = True

    def __init__(self, hf_tokenizer):
        self.tok = getattr(hf_tokenizer, "tok", hf_tokenizer)  # our HFTokenizer adapter or the raw one
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"tokenizer {type(self.tok).__name__} has no chat template")
        self.eos = self.tok.eos_token_id
        self._tail: str | None = None

    def _text(self, messages, tools, generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template([m.to_dict() for m in messages], tools=[t.to_dict() for t in tools] or None,
                                            tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []

    def render(self, before, new, tools):
        base = self._text(before, tools, False)
        texts = [self._text(before + new[: k + 1], tools, False) for k in range(len(new))]
        full = self._text(before + new, tools, True)
        if not all(t.startswith(base) for t in texts + [full]):
            raise ChatRequestError("the chat template renders the earlier messages differently once new ones "
                                   "follow; this conversation cannot continue token for token", "messages")
        ids: list[int] = []
        ends: list[int] = []
        prev = base
        for t in texts:  # each message's own text, tokenized once
            ids += self._ids(t[len(prev):])
            ends.append(len(ids))
            prev = t
        ids += self._ids(full[len(prev):])  # the generation prompt
        return ids, ends

    def close_turn(self, output_ids) -> list[int]:
        """What the template writes after an assistant message's text (Qwen: ``<|im_end|>\n``), less
        the end-of-turn token when the model wrote it."""
        if self._tail is None:
            text = self._text((Message("user", "x"), Message("assistant", _MARK)), (), False)
            self._tail = text[text.rindex(_MARK) + len(_MARK):]
        tail = self._tail
        eos_text = self.tok.decode([self.eos]) if self.eos is not None else ""
        if len(output_ids) and output_ids[-1] == self.eos and eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text):]
        return self._ids(tail)

    def parse(self, output_ids, tools):
        text = self.tok.decode(list(output_ids), skip_special_tokens=True)
        if not tools:
            return text, []
        calls = []
        for block in _HERMES_CALL.findall(text):
            try:
                d = json.loads(block)
            except ValueError:
                continue  # not a call: it stays in the text
            if isinstance(d, dict) and isinstance(d.get("name"), str):
                args = d.get("arguments", {})
                calls.append(ToolCall(id="", name=d["name"],
                                      arguments=args if isinstance(args, str) else json.dumps(args)))
        content = _HERMES_CALL.sub("", text).strip() if calls else text
        return content, calls


def template_for(tokenizer, call_marker: str | None = None) -> ChatTemplate:
    """The template of ``tokenizer``: its own chat template when it has one, else the tiny one."""
    inner = getattr(tokenizer, "tok", tokenizer)
    if getattr(inner, "chat_template", None) and hasattr(inner, "apply_chat_template"):
        return HFChatTemplate(tokenizer)
    return TinyChatTemplate(tokenizer, call_marker)
