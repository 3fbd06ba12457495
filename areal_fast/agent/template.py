"""Chat templates: messages to token ids, once per turn, and the model's output back to a message.

A template has three jobs (``docs/agents.md``):

- ``render(before, new, tools)``: the token ids of the messages ``new`` that follow the messages
  ``before`` (already in the context as tokens), then the generation prompt; and where each new
  message ends. Only the new messages are tokenized: the context is never re-encoded.
- ``close_turn(output_ids)``: the end-of-turn tokens the template would have written after the
  model's output when the model did not write them (the turn was cut at ``max_tokens``).
- ``parse(output_ids, tools)``: the assistant message's text and the tool calls in it, in the
  template's format of tool calls; ``parse_answer(output_ids, request)`` the same for a request
  (its ``tool_choice`` and ``parallel_tool_calls``), with the reasoning split off (:class:`Answer`);
- ``check(request)``: what the template cannot answer, refused before anything is generated.

Two templates ship:

:class:`TinyChatTemplate`, for the character tokenizer of the tiny tasks (whose vocabulary is a
dozen characters: it cannot spell a role name or a JSON schema). Written for this package::

    system     <content>
    user       <bos><content>
    assistant  <content><eos>           (a call: the call's text, see below)
    tool       <content>
    generation prompt: nothing (the model writes right after the last message)

Tools are not rendered (the vocabulary cannot spell them). The tools format: when exactly one
tool can be called (one offered, or one named by ``tool_choice``) and ``call_marker`` is set, an
output that contains ``call_marker`` is a call of that tool whose arguments are
``{"<its first parameter>": "<the output's text>"}``; any other output is text. Several tools
that could be called are refused (400 naming ``tools``): the format cannot say which one a call is.
The tiny tool task's model writes calls as text containing ``*`` (``areal_fast/recipes/tool_task.py``),
so its template is ``TinyChatTemplate(tok, call_marker="*")``.

:class:`HFChatTemplate`, for a Hugging Face tokenizer that has a chat template (e.g. Qwen2.5):
the tokenizer's own Jinja template renders, with ``tools``; tool calls are parsed by the tool
parser named (``areal_fast.agent.tool_parsers``: ``hermes``, the default, the format Qwen2.5's
templates teach; ``qwen3_coder``; ``json``), after the reasoning parser (``reasoning_parser="think"``,
``areal_fast.agent.reasoning``) took ``<think>...</think>`` out. The new messages' ids are the
tokens of the text the template adds after ``before``: the template is rendered for ``before`` and
for ``before + new`` and the difference tokenized, each message's text on its own; where each
message ends is found in windows of a few messages (linear in the new messages,
:meth:`HFChatTemplate._window_cuts`), and the rendering runs off the event loop
(:meth:`HFChatTemplate.render_async`).

Some templates render the earlier messages differently once new ones follow (Qwen3's drops the
``<think>`` of assistant messages before the last user message), so ``before`` is not a prefix of
``before + new``. ``continuation`` says what then happens:

- ``"concat"`` (the default): the new messages are rendered after a stand-in conversation (a user
  message and an assistant message) and the text after the stand-in assistant's end of turn is
  tokenized: the new messages' tokens as the template writes them after an assistant turn, appended
  to the exact earlier tokens (the conversation goes on token for token, as AReaL's ``concat`` mode);
- ``"template"``: :class:`HistoryRendersDifferently` is raised and the session renders the whole
  conversation again with the template (a new trajectory: the model sees the history as the
  template shows it, not as it was generated).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass, field
from typing import Protocol

from areal_fast.agent.reasoning import reasoning_parser as _reasoning_parser
from areal_fast.agent.request import ChatRequest, ChatRequestError, Message, Tool, ToolCall
from areal_fast.agent.tool_parsers import tool_parser as _tool_parser
from areal_fast.data.tokenizer import encode_text, hf_plain_ids

CONTINUATIONS = ("concat", "template")


class HistoryRendersDifferently(ChatRequestError):
    """The template renders the earlier messages differently once new ones follow (a 400 where the
    caller does not render the conversation again: ``continuation='template'``)."""


@dataclass
class Answer:
    """The assistant message parsed out of a turn's tokens."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def _answer(content: str, calls: list[ToolCall], req: ChatRequest, reasoning: str | None = None) -> Answer:
    return Answer(content, reasoning, calls if req.parallel_tool_calls else calls[:1])


class ChatTemplate(Protocol):
    renders_tools: bool
    """True when the tools are part of the rendered context (a change of tools re-renders it)."""

    def render(self, before: tuple[Message, ...], new: tuple[Message, ...],
               tools: tuple[Tool, ...]) -> tuple[list[int], list[int]]: ...
    async def render_async(self, before: tuple[Message, ...], new: tuple[Message, ...],
                           tools: tuple[Tool, ...]) -> tuple[list[int], list[int]]: ...
    def close_turn(self, output_ids) -> list[int]: ...
    def parse(self, output_ids, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]: ...
    def parse_answer(self, output_ids, req: ChatRequest) -> Answer: ...
    def check(self, req: ChatRequest) -> None: ...


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
        except (ValueError, RecursionError):  # not JSON, or nested past the decoder's limit: the text
            return call.arguments
        return "".join(str(v) for v in args.values()) if isinstance(args, dict) else str(args)

    def render(self, before, new, tools):
        ids: list[int] = []
        ends: list[int] = []
        for i, m in enumerate(new, start=len(before)):
            ids += self._message(m, i)
            ends.append(len(ids))
        return ids, ends

    async def render_async(self, before, new, tools):
        return self.render(before, new, tools)  # linear, a few characters a message: on the loop

    def close_turn(self, output_ids) -> list[int]:
        return [] if len(output_ids) and output_ids[-1] == self.eos else [self.eos]

    def parse(self, output_ids, tools):
        text = self.tok.decode(list(output_ids))
        if self.call_marker and len(tools) == 1 and self.call_marker in text:
            tool = tools[0]
            return "", [ToolCall(id="", name=tool.name, arguments=json.dumps({tool.first_parameter(): text}))]
        return text, []

    def parse_answer(self, output_ids, req: ChatRequest) -> Answer:
        return _answer(*self.parse(output_ids, req.callable_tools()), req)

    def check(self, req: ChatRequest) -> None:
        """Refuse what this template's tool format cannot say: a call of one of several tools."""
        callable_ = req.callable_tools()
        if not callable_ or req.tool_choice == "none":
            return
        if not self.call_marker:
            if req.tool_choice in ("required", "function"):
                raise ChatRequestError(f"tool_choice: {req.tool_choice!r} needs a tool format; the tiny template "
                                       "has one only with call_marker set", "tool_choice")
            return  # no tool format: the tools are context the model cannot call (as without tools)
        if len(callable_) > 1:
            raise ChatRequestError(f"tools: the tiny template's tool format (call_marker {self.call_marker!r}) "
                                   f"calls one tool, and {len(callable_)} can be called here "
                                   f"({[t.name for t in callable_]}); offer one, or name one with tool_choice",
                                   "tools")


_MARK = "AREALFASTMARK"


_HIDE_OPEN, _HIDE_CLOSE = "\ufdd0", "\ufdd1"  # Unicode noncharacters: never text of a chat
_HIDDEN = re.compile(_HIDE_OPEN + r"(\d+)" + _HIDE_CLOSE)


WINDOW = 2
"""Messages before a new one in the window that renders it (:meth:`HFChatTemplate._window_cuts`)."""
MAX_REACH = 32
"""A window that does not agree with the whole conversation grows (twice the messages after the
message, and before it) up to this many messages after it; then each prefix is rendered instead."""


def _agreed(text: str, whole: str, floor: int) -> int:
    """Where ``text`` (a render up to some message) ends in ``whole`` (a render of more): its length
    when ``whole`` starts with it, else where the two stop agreeing, at least ``floor``."""
    return len(text) if whole.startswith(text) else max(floor, len(os.path.commonprefix([text, whole])))


def _prefix_cuts(start: int, texts: list[str], full: str) -> list[int]:
    """Where each message ends in ``full``, ``texts`` being the renders up to each message: the end of
    its render when that is a prefix of ``full`` (the usual case), else the text both share (a
    template that renders a message differently once more follow, as Qwen3's reasoning, when the
    whole conversation is rendered again). One render per message, each as long as the conversation
    so far: quadratic in the messages; the reference of :meth:`HFChatTemplate._window_cuts`."""
    cuts, prev = [], start
    for t in texts:
        prev = _agreed(t, full, prev)
        cuts.append(prev)
    return cuts


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

    def __init__(self, hf_tokenizer, *, tool_parser: str = "hermes", reasoning_parser: str | None = None,
                 continuation: str = "concat"):
        self.tok = getattr(hf_tokenizer, "tok", hf_tokenizer)  # our HFTokenizer adapter or the raw one
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"tokenizer {type(self.tok).__name__} has no chat template")
        if continuation not in CONTINUATIONS:
            raise ValueError(f"continuation: expected one of {CONTINUATIONS}, got {continuation!r}")
        self.parse_tools = _tool_parser(tool_parser)
        self.split_reasoning = _reasoning_parser(reasoning_parser)
        self.continuation = continuation
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
        """The ids of ``new`` after ``before`` and where each new message ends (see the module
        docstring): :meth:`plan`, then its texts tokenized."""
        return self._tokens(*self.plan(before, new, tools))

    async def render_async(self, before, new, tools):
        """:meth:`render` with the template's rendering (Jinja, the long part: four fifths of the
        time for 1,200 short new messages) in a worker thread, off the event loop; the tokenizing
        stays on the loop's thread, as every other use of the tokenizer (a ``transformers``
        tokenizer switches its one Rust tokenizer between plain-text and special-token encoding per
        call: two threads encoding at once could each get the other's mode, and content could open
        turns of its own)."""
        self._sp()  # read from the tokenizer here, not in the worker
        self._turn_tail()
        return self._tokens(*await asyncio.to_thread(self.plan, before, new, tools))

    def render_reference(self, before, new, tools):
        """:meth:`render` by the definition: the conversation rendered up to each new message."""
        return self._tokens(*self.plan(before, new, tools, windowed=False))

    def plan(self, before, new, tools, *, windowed: bool = True) -> tuple[str, int, list[int]]:
        """The text of the conversation ``before + new`` with its generation prompt, where the new
        messages' text starts in it and where each of them ends; text only (no tokenizer call).
        ``windowed``: each message's end found by :meth:`_window_cuts` (linear in the messages),
        else by rendering each prefix (:func:`_prefix_cuts`, quadratic: 300 short new messages took
        1.6 s that way, 0.23 s in windows; 1,200 took 1 s in windows)."""
        # every string of the messages and tools is rendered with the text of special tokens hidden
        # (so that only the template's own markers become control tokens), then tokenized
        sp = self._sp()
        msgs = [sp.hide(m.to_dict()) for m in before + new]
        tool_dicts = [sp.hide(t.to_dict()) for t in tools]
        nb = len(before)
        base = self._render(msgs[:nb], tool_dicts, False)
        full = self._render(msgs, tool_dicts, True)
        if windowed and full.startswith(base):
            cuts = self._window_cuts(msgs, nb, tool_dicts, full, len(base))
            if cuts is not None:
                return full, len(base), cuts
        texts = [self._render(msgs[: nb + k + 1], tool_dicts, False) for k in range(len(new))]
        if not all(t.startswith(base) for t in texts + [full]):
            if self.continuation == "template":
                raise HistoryRendersDifferently("the chat template renders the earlier messages differently once "
                                                "new ones follow", "messages")
            return self._appended(msgs[nb:], tool_dicts, windowed=windowed)
        return full, len(base), _prefix_cuts(len(base), texts, full)

    def _window_cuts(self, msgs: list[dict], nb: int, tool_dicts: list[dict], full: str,
                     start: int) -> list[int] | None:
        """Where each message ``msgs[nb:]`` ends in ``full`` (the whole conversation rendered, with the
        generation prompt), its text beginning at ``start``; found in windows of a few messages, so
        linear in the messages: None when the windows do not add up to ``full``.

        :func:`_prefix_cuts` finds message i's end by rendering the conversation up to it, a render of
        i messages. Here the render starts :data:`WINDOW` messages before i and goes one message past
        it (or to the generation prompt after the last): in that window message i's text runs from
        where the window up to message i-1 stops agreeing with the whole window to where the window up
        to message i does (the same rule as :func:`_prefix_cuts`, as a message's text may change when
        another follows, e.g. a run of tool results in one turn). Templates render a message from its
        neighbours (the previous role, whether one follows) and the conversation's head (a system
        prompt, the tools), so each message's text is checked against ``full`` where it must stand:
        when it differs the window grows, twice as far each way (Qwen3 keeps an assistant message's
        reasoning unless a user message follows, however far on), up to :data:`MAX_REACH` messages
        after it; past that (a template that numbers its messages), or when the generation prompt
        left over differs, None, and the caller renders each prefix (:meth:`render_reference`).
        """
        pos, cuts = start, []
        ahead, end = "", 0
        for i in range(nb, len(msgs)):
            reach = 1
            while True:
                s = max(0, i - WINDOW * reach)
                last = i + 1 + reach >= len(msgs)
                ahead = self._render(msgs[s:i + 1 + reach], tool_dicts, last)
                begin = _agreed(self._render(msgs[s:i], tool_dicts, False), ahead, 0)
                end = _agreed(self._render(msgs[s:i + 1], tool_dicts, False), ahead, begin)
                if full.startswith(ahead[begin:end], pos):
                    break
                if reach >= MAX_REACH or (s == 0 and last):
                    return None
                reach *= 2  # a template that looks further (Qwen3: is a user message still to come?)
            pos += end - begin
            cuts.append(pos)
        if full[pos:] != ahead[end:]:  # what follows the last message: the generation prompt
            return None
        return cuts

    def _tokens(self, full: str, start: int, cuts: list[int]) -> tuple[list[int], list[int]]:
        """The ids of ``full[start:]``, each message's text (up to its cut) and the generation prompt
        tokenized on their own, and where each message ends in them."""
        ids: list[int] = []
        ends: list[int] = []
        prev = start
        for cut in cuts:
            ids += self._ids(full[prev:cut])
            ends.append(len(ids))
            prev = cut
        ids += self._ids(full[prev:])  # the generation prompt
        return ids, ends

    def _appended(self, new: list[dict], tool_dicts: list[dict], *, windowed: bool) -> tuple[str, int, list[int]]:
        """``continuation='concat'``: ``new`` as the template writes it after an assistant turn, rendered
        after a stand-in conversation (a user message, an assistant message ``_MARK``) whose text up to
        the stand-in's end of turn is left out (see the module docstring)."""
        stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        full = self._render(stand_in + new, tool_dicts, True)
        at = full.find(_MARK)
        base = full[: at + len(_MARK)] + self._turn_tail() if at >= 0 else None
        if windowed and base is not None and full.startswith(base):
            cuts = self._window_cuts(stand_in + new, len(stand_in), tool_dicts, full, len(base))
            if cuts is not None:
                return full, len(base), cuts
        texts = [self._render(stand_in + new[: k + 1], tool_dicts, False) for k in range(len(new))]
        if base is None or not all(t.startswith(base) for t in texts + [full]):
            raise ChatRequestError("the chat template renders the earlier messages differently once new ones "
                                   "follow, and does not write the new ones after an assistant turn the same way "
                                   "either; this conversation cannot continue token for token", "messages")
        return full, len(base), _prefix_cuts(len(base), texts, full)

    def _turn_tail(self) -> str:
        """The text the template writes after an assistant message's content (Qwen: ``<|im_end|>\n``)."""
        if self._tail is None:
            text = self._text((Message("user", "x"), Message("assistant", _MARK)), (), False)
            self._tail = text[text.rindex(_MARK) + len(_MARK):]
        return self._tail

    def close_turn(self, output_ids) -> list[int]:
        """What the template writes after an assistant message's text (Qwen: ``<|im_end|>\n``), less
        the end-of-turn token when the model wrote it."""
        tail = self._turn_tail()
        eos_text = self.tok.decode([self.eos]) if self.eos is not None else ""
        if len(output_ids) and output_ids[-1] == self.eos and eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text):]
        return self._ids(tail)

    def parse(self, output_ids, tools):
        """The text and the tool calls of ``output_ids`` (no reasoning split: :meth:`parse_answer`)."""
        text = self.tok.decode(list(output_ids), skip_special_tokens=True)
        if not tools:
            return text, []
        return self.parse_tools(text, tools)

    def parse_answer(self, output_ids, req: ChatRequest) -> Answer:
        text = self.tok.decode(list(output_ids), skip_special_tokens=True)
        reasoning = None
        if self.split_reasoning is not None:
            reasoning, text = self.split_reasoning(text)
        tools = req.callable_tools()
        content, calls = self.parse_tools(text, tools) if tools else (text, [])
        return _answer(content, calls, req, reasoning)

    def check(self, req: ChatRequest) -> None:
        return None  # every template with tools can say which function a call is


def template_for(tokenizer, call_marker: str | None = None, *, tool_parser: str = "hermes",
                 reasoning_parser: str | None = None, continuation: str = "concat") -> ChatTemplate:
    """The template of ``tokenizer``: its own chat template when it has one (with the tool parser,
    reasoning parser and continuation named), else the tiny one (with ``call_marker``)."""
    inner = getattr(tokenizer, "tok", tokenizer)
    if getattr(inner, "chat_template", None) and hasattr(inner, "apply_chat_template"):
        return HFChatTemplate(tokenizer, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                              continuation=continuation)
    return TinyChatTemplate(tokenizer, call_marker)
