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
from areal_fast.data.tokenizer import encode_text, hf_plain_ids


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
            return encode_text(self.tok, text)  # plain text: no control token from its characters
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
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def hermes_blocks(text: str) -> list[tuple[int, int, str]]:
    """The ``<tool_call>...</tool_call>`` blocks of ``text``: (start, end, the text inside, less
    surrounding white space), in order. A block ends at the first close after its open (an open
    inside a block is text of that block); an open never closed is text. One scan with
    ``str.find``: linear in ``len(text)`` whatever the model wrote (a regex over the same shape,
    ``<tool_call>\\s*(.*?)\\s*</tool_call>``, backtracked polynomially after an unclosed open
    followed by white space, on the event loop)."""
    out = []
    pos = 0
    while True:
        start = text.find(_CALL_OPEN, pos)
        if start < 0:
            return out
        close = text.find(_CALL_CLOSE, start + len(_CALL_OPEN))
        if close < 0:
            return out  # no close after this open, so none after any later one either
        end = close + len(_CALL_CLOSE)
        out.append((start, end, text[start + len(_CALL_OPEN):close].strip()))
        pos = end


_HIDE_OPEN, _HIDE_CLOSE = "\ufdd0", "\ufdd1"  # Unicode noncharacters: never text of a chat
_HIDDEN = re.compile(_HIDE_OPEN + r"(\d+)" + _HIDE_CLOSE)


class _Specials:
    """The special tokens of a ``transformers`` tokenizer, and the hiding of their text in content.

    A chat template is rendered to text and the text tokenized, and a tokenizer turns the *text*
    of a special token (``<|im_start|>``) into the token itself: content that spells one would open
    turns of its own (a user message forging a system turn). So before rendering, each occurrence
    of a special token's text in the messages and tools (content, tool calls' arguments, names,
    schemas) is replaced by a placeholder of two Unicode noncharacters around its number; the
    template's own markers stay. A rendered text with placeholders is then tokenized in pieces: at
    the template's special tokens (each its id), and between them the text with the hidden content
    put back, as plain text (``split_special_tokens``). A text without placeholders (no content
    spelled a special token) is tokenized whole, as before."""

    def __init__(self, tok):
        table: dict[str, tuple[int, bool, bool]] = {}
        for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items():
            if getattr(t, "special", False) and str(t):
                table[str(t)] = (int(i), bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
        if not table:
            for s in getattr(tok, "all_special_tokens", ()):
                table[s] = (tok.convert_tokens_to_ids(s), False, False)
        self.table = table
        self.hidden = sorted(table, key=len, reverse=True) + [_HIDE_OPEN, _HIDE_CLOSE]  # those two: kept as text
        self._find_hidden = re.compile("|".join(re.escape(s) for s in self.hidden))
        self._index = {s: k for k, s in enumerate(self.hidden)}
        self._find_special = re.compile("|".join(re.escape(s) for s in self.hidden[:-2])) if table else None

    def hide(self, value):
        """``value`` (a message's or a tool's dict) with the special-token text in its strings hidden."""
        if isinstance(value, str):
            return self._find_hidden.sub(lambda m: f"{_HIDE_OPEN}{self._index[m.group()]}{_HIDE_CLOSE}", value)
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(v) for v in value]
        return value

    def ids(self, tok, text: str) -> list[int]:
        """The ids of a rendered ``text`` with placeholders (see the class docstring)."""
        parts = _HIDDEN.split(text)  # template text, a placeholder's number, template text, ...
        pieces: list[tuple[str, int | None]] = []  # (text, None) or (special token text, its id)
        for k, part in enumerate(parts):
            if k % 2:
                pieces.append((self.hidden[int(part)], None))
                continue
            pos = 0
            for m in self._find_special.finditer(part) if self._find_special else ():
                pieces.append((part[pos:m.start()], None))
                pieces.append((m.group(), self.table[m.group()][0]))
                pos = m.end()
            pieces.append((part[pos:], None))
        out: list[int] = []
        buf: list[str] = []
        strip_left = False  # the special token before the text takes the white space after it (rstrip)
        for text_, sid in pieces:
            if sid is None:
                buf.append(text_)
                continue
            chunk = "".join(buf)
            if strip_left:
                chunk = chunk.lstrip()
            if self.table[text_][1]:  # lstrip: this token takes the white space before it
                chunk = chunk.rstrip()
            out += hf_plain_ids(tok, chunk)
            out.append(sid)
            buf, strip_left = [], self.table[text_][2]
        chunk = "".join(buf)
        out += hf_plain_ids(tok, chunk.lstrip() if strip_left else chunk)
        return out


class HFChatTemplate:
    """A Hugging Face tokenizer's own chat template (see the module docstring)."""

    renders_tools = True

    def __init__(self, hf_tokenizer):
        self.tok = getattr(hf_tokenizer, "tok", hf_tokenizer)  # our HFTokenizer adapter or the raw one
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"tokenizer {type(self.tok).__name__} has no chat template")
        self.eos = self.tok.eos_token_id
        self._tail: str | None = None
        self._specials: _Specials | None = None

    def _text(self, messages, tools, generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self._render([m.to_dict() for m in messages], [t.to_dict() for t in tools], generation_prompt)

    def _render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        if _HIDE_OPEN not in text:  # no special-token text came from the content: the template's text, as is
            return list(self.tok.encode(text, add_special_tokens=False))
        return self._sp().ids(self.tok, text)

    def _sp(self) -> _Specials:
        if self._specials is None:
            self._specials = _Specials(self.tok)
        return self._specials

    def render(self, before, new, tools):
        # every string of the messages and tools is rendered with the text of special tokens hidden
        # (so that only the template's own markers become control tokens), then tokenized
        sp = self._sp()
        msgs = [sp.hide(m.to_dict()) for m in before + new]
        tool_dicts = [sp.hide(t.to_dict()) for t in tools]
        nb = len(before)
        base = self._render(msgs[:nb], tool_dicts, False)
        texts = [self._render(msgs[: nb + k + 1], tool_dicts, False) for k in range(len(new))]
        full = self._render(msgs, tool_dicts, True)
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
        blocks = hermes_blocks(text)
        for _, _, block in blocks:
            try:
                d = json.loads(block)
            except ValueError:
                continue  # not a call: it stays in the text
            if isinstance(d, dict) and isinstance(d.get("name"), str):
                args = d.get("arguments", {})
                calls.append(ToolCall(id="", name=d["name"],
                                      arguments=args if isinstance(args, str) else json.dumps(args)))
        if not calls:
            return text, calls
        kept, pos = [], 0
        for start, end, _ in blocks:  # every block goes, a call or not (as the regex's sub did)
            kept.append(text[pos:start])
            pos = end
        kept.append(text[pos:])
        content = "".join(kept).strip()
        return content, calls


def template_for(tokenizer, call_marker: str | None = None) -> ChatTemplate:
    """The template of ``tokenizer``: its own chat template when it has one, else the tiny one."""
    inner = getattr(tokenizer, "tok", tokenizer)
    if getattr(inner, "chat_template", None) and hasattr(inner, "apply_chat_template"):
        return HFChatTemplate(tokenizer)
    return TinyChatTemplate(tokenizer, call_marker)
