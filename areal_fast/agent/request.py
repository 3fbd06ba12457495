"""What a ``chat.completions.create`` call asks for, checked up front (:func:`parse_request`).

The same checks serve both forms of the chat API (the in-process client and the HTTP endpoint),
so an agent gets the same answer either way: a :class:`ChatRequestError` (HTTP 400, which the
openai SDK raises as ``BadRequestError``) naming the parameter and the value it refused.

Messages are reduced to a canonical :class:`Message` (role, text, tool calls, tool call id,
name): the openai SDK's objects, plain dicts and content given as a list of text parts all give
the same value, so a history the agent sends back can be compared with the one recorded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from areal_fast.configutil import finite_number

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # as the OpenAI API
# accepted and ignored: they change nothing about the tokens (or only bookkeeping on OpenAI's side)
_IGNORED = ("user", "metadata", "store", "seed", "service_tier", "prompt_cache_key", "safety_identifier")
TOOL_CHOICES = ("auto", "none", "required")  # or a named function: {"type": "function", "function": {"name": f}}
MAX_TOP_LOGPROBS = 20  # as the OpenAI API
_STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # the latter accepted and ignored


SHOWN_CHARS = 200
"""An error message shows at most this many characters of the value it refused."""


def culprit(value) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN_CHARS` characters; a value with no
    repr to give (an integer of more than 4,300 digits, which Python will not print; a structure
    nested past the recursion limit) is named by its type. So that showing a refused value cannot
    itself fail, and a megabyte of it is not sent back whole."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        return f"<{type(value).__name__}{size}>"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


class ChatRequestError(ValueError):
    """A request the chat API refuses: HTTP 400, ``param`` names the culprit."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is a JSON text, as in the OpenAI API."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    """A chat message reduced to what a chat template reads; equal values render equal tokens."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = field(default=None, compare=False)
    """An assistant message's reasoning (``<think>``), when a reasoning parser split it off. Not
    compared: an agent that sends the answer back without it sends the same answer (the recorded
    tokens hold the reasoning either way)."""

    def to_dict(self) -> dict:
        d: dict = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict, hash=False, compare=True)

    def first_parameter(self) -> str:
        """The parameter a one-argument call fills: the first required one, else the first declared."""
        req = self.parameters.get("required") or []
        props = list((self.parameters.get("properties") or {}).keys())
        return req[0] if req else (props[0] if props else "input")

    def to_dict(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class AnswerForm:
    """How the caller wants the answer given; nothing here changes the tokens sampled or recorded."""

    stream: bool = False
    """``stream=True``: chat.completion.chunk events (the whole answer, sent once generated)."""
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk with ``usage`` and no choices."""
    logprobs: bool = False
    """``logprobs=True``: each output token's recorded log-prob in ``choices[0].logprobs``."""


@dataclass
class ChatRequest:
    """A checked request. ``max_tokens``/``temperature``/``top_p`` None: the run's value."""

    model: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    """auto | none | required | function (a named function: ``tool_choice_name``)."""
    tool_choice_name: str | None = None
    parallel_tool_calls: bool = True
    """False: only the first call the model wrote is returned (the tokens of all are recorded)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    answer: AnswerForm = AnswerForm()

    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools whose calls are parsed out of the answer: none with ``tool_choice`` none, the
        named one with a named function, all offered otherwise."""
        if self.tool_choice == "none":
            return ()
        if self.tool_choice == "function":
            return tuple(t for t in self.tools if t.name == self.tool_choice_name)
        return self.tools


def _plain(obj, where: str) -> dict:
    """A dict from a dict, a pydantic model (the SDK's types) or an object with attributes."""
    if isinstance(obj, Mapping):
        return dict(obj)
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=False)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise ChatRequestError(f"{where}: expected an object, got {type(obj).__name__}", where)


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        out = []
        for k, part in enumerate(content):
            p = _plain(part, f"{where}[{k}]")
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ChatRequestError(f"{where}[{k}]: only text content parts are supported, got type "
                                       f"{culprit(p.get('type'))}", where)
            out.append(p["text"])
        return "".join(out)
    raise ChatRequestError(f"{where}: content must be a string or a list of text parts, got "
                           f"{type(content).__name__}", where)


def _tool_call(raw, where: str) -> ToolCall:
    d = _plain(raw, where)
    fn = _plain(d.get("function") or {}, f"{where}.function")
    name, args = fn.get("name"), fn.get("arguments", "")
    if not isinstance(name, str) or not name:
        raise ChatRequestError(f"{where}.function.name: expected a non-empty string, got {culprit(name)}", where)
    if not isinstance(args, str):
        try:
            args = json.dumps(args)
        except (TypeError, ValueError, RecursionError):
            raise ChatRequestError(f"{where}.function.arguments: expected a JSON text or a JSON value, got "
                                   f"{culprit(args)}", f"{where}.function.arguments") from None
    return ToolCall(id=str(d.get("id") or ""), name=name, arguments=args)


def parse_message(raw, i: int) -> Message:
    """One message (a dict or an SDK object) as a :class:`Message`; ChatRequestError names ``messages[i]``."""
    where = f"messages[{i}]"
    d = _plain(raw, where)
    role = d.get("role")
    if role not in ROLES:
        raise ChatRequestError(f"{where}.role: expected one of {ROLES}, got {culprit(role)}", where)
    calls = tuple(_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(d.get("tool_calls") or ()))
    if calls and role != "assistant":
        raise ChatRequestError(f"{where}: only assistant messages carry tool_calls (role {culprit(role)})", where)
    tcid = d.get("tool_call_id")
    if role == "tool" and not isinstance(tcid, str):
        raise ChatRequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers", where)
    name = d.get("name")
    reasoning = d.get("reasoning_content")
    return Message(role="system" if role == "developer" else role, content=_text(d.get("content"), f"{where}.content"),
                   tool_calls=calls, tool_call_id=tcid if role == "tool" else None,
                   name=name if isinstance(name, str) else None,
                   reasoning_content=reasoning if role == "assistant" and isinstance(reasoning, str) else None)


def _tool(raw, k: int) -> Tool:
    where = f"tools[{k}]"
    d = _plain(raw, where)
    if d.get("type", "function") != "function":
        raise ChatRequestError(f"{where}.type: only 'function' tools are supported, got {culprit(d.get('type'))}",
                               where)
    fn = _plain(d.get("function") or {}, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ChatRequestError(f"{where}.function.name: expected a non-empty string, got {culprit(name)}", where)
    params = fn.get("parameters") or {}
    if not isinstance(params, dict):
        raise ChatRequestError(f"{where}.function.parameters: expected a JSON schema object", where)
    return Tool(name=name, description=str(fn.get("description") or ""), parameters=params)


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not finite_number(v) or not lo <= v <= hi:
        raise ChatRequestError(f"{key}: expected a number in [{lo}, {hi}], got {culprit(v)}", key)
    return float(v)


def _max_tokens(body: dict) -> int | None:
    got = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(set(got.values())) > 1:
        raise ChatRequestError(f"max_tokens and max_completion_tokens disagree: {culprit(got)}", "max_tokens")
    for k, v in got.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ChatRequestError(f"{k}: expected an integer >= 1, got {culprit(v)}", k)
        return v
    return None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > MAX_STOP):
        raise ChatRequestError(f"stop: expected a non-empty string or a list of up to {MAX_STOP}, got "
                               f"{culprit(stop)}", "stop")
    return tuple(stop)


def _tool_choice(body: dict, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    """(auto | none | required | function, the named function's name)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ChatRequestError(f"tool_choice: expected one of {TOOL_CHOICES} or a named function, got "
                                   f"{culprit(choice)}", "tool_choice")
        if choice == "required" and not tools:
            raise ChatRequestError("tool_choice: 'required' needs tools", "tool_choice")
        return choice, None
    d = _plain(choice, "tool_choice")
    name = _plain(d.get("function") or {}, "tool_choice.function").get("name")
    if d.get("type") != "function" or not isinstance(name, str):
        raise ChatRequestError(f"tool_choice: expected {{'type': 'function', 'function': {{'name': ...}}}}, got "
                               f"{culprit(choice)}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise ChatRequestError(f"tool_choice: function {culprit(name)} is not among the tools offered "
                               f"{[t.name for t in tools]}", "tool_choice")
    return "function", name


def _flag(d: Mapping, key: str, where: str | None = None) -> bool:
    v = d.get(key)
    if v is not None and not isinstance(v, bool):
        raise ChatRequestError(f"{where or key}: expected true or false, got {culprit(v)}", where or key)
    return bool(v)


def _logprobs(body: dict) -> bool:
    wanted = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return wanted
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ChatRequestError(f"top_logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}], got {culprit(top)}",
                               "top_logprobs")
    if top:
        raise ChatRequestError(f"top_logprobs: not supported (only the sampled token's log-prob is recorded), got "
                               f"{top}; ask logprobs=True with top_logprobs 0 or absent", "top_logprobs")
    return wanted


def _answer_form(body: dict) -> AnswerForm:
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return AnswerForm(stream=stream, logprobs=_logprobs(body))
    if not stream:
        raise ChatRequestError("stream_options: only allowed with stream=True", "stream_options")
    if not isinstance(opts, Mapping):
        raise ChatRequestError(f"stream_options: expected an object, got {culprit(opts)}", "stream_options")
    for key in opts:
        if key not in _STREAM_OPTIONS:
            raise ChatRequestError(f"stream_options.{key}: unknown stream option (known: {_STREAM_OPTIONS})",
                                   f"stream_options.{key}")
    _flag(opts, "include_obfuscation", "stream_options.include_obfuscation")
    return AnswerForm(stream=True, include_usage=_flag(opts, "include_usage", "stream_options.include_usage"),
                      logprobs=_logprobs(body))


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ChatRequestError(f"n: only n=1 is supported (one recorded completion per call), got {culprit(n)}; "
                               "call again for more samples", "n")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise ChatRequestError(f"{key}: not supported (it would change the sampled distribution), got "
                                   f"{culprit(body[key])}", key)
    fmt = body.get("response_format")
    if fmt is not None and _plain(fmt, "response_format").get("type") != "text":
        raise ChatRequestError(f"response_format: only 'text' is supported, got {culprit(fmt)}", "response_format")


KNOWN = {"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
         "top_p", "stop", "n", "stream", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
         "response_format", "stream_options", "parallel_tool_calls", *_IGNORED}


def parse_request(body: Mapping, served_model: str) -> ChatRequest:
    """``body`` (the create() keywords, or the HTTP JSON) checked against what we serve."""
    if not isinstance(body, Mapping):
        raise ChatRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ChatRequestError(f"unsupported parameter(s) {unknown}", unknown[0])
    model = body.get("model")
    if model != served_model:
        raise ChatRequestError(f"model {culprit(model)} is not served here; this endpoint serves {served_model!r}",
                               "model")
    _refuse_unsupported(body)
    answer = _answer_form(body)
    raw = body.get("messages")
    if not isinstance(raw, list | tuple) or not raw:
        raise ChatRequestError("messages: expected a non-empty list", "messages")
    messages = tuple(parse_message(m, i) for i, m in enumerate(raw))
    tools = tuple(_tool(t, k) for k, t in enumerate(body.get("tools") or ()))
    choice, choice_name = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ChatRequestError(f"parallel_tool_calls: expected true or false, got {culprit(parallel)}",
                               "parallel_tool_calls")
    return ChatRequest(model=model, messages=messages, tools=tools, tool_choice=choice, tool_choice_name=choice_name,
                       parallel_tool_calls=parallel is not False,
                       max_tokens=_max_tokens(body), temperature=_number(body, "temperature", 0.0, 2.0),
                       top_p=_number(body, "top_p", 0.0, 1.0), stop=_stop(body), answer=answer)
