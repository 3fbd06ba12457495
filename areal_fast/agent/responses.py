"""The Responses API (``client.responses.create``, what the openai-agents SDK calls by default) on
the same episode and the same recording as ``chat.completions.create``.

::

    r = await client.responses.create(model="areal-fast", instructions="...", input="7*34=",
                                      tools=[{"type": "function", "name": "calc", "parameters": {...}}])
    r.output        # [ResponseFunctionToolCall(call_id=..., name="calc", arguments=...)] or a message
    r = await client.responses.create(model="areal-fast", input=[..., *r.output,
        {"type": "function_call_output", "call_id": ..., "output": "238"}])      # or previous_response_id=r.id

A request is translated into the chat request it means (:func:`chat_body`) and made through the
episode's :class:`~areal_fast.agent.session.Session`: the same checks, the same prompt built on the
exact earlier tokens, the same :class:`~areal_fast.agent.session.ChatCall` recorded (tokens,
log-probs, versions; only model tokens trained), so trajectories do not depend on which API the
agent used. The answer is that call in the Responses shape (:func:`response_dict`); its id is
``resp_<rid>`` (``set_reward`` takes it, as it takes the ``chatcmpl-<rid>`` form).

The translation, item by item (``input`` a string is one user message):

- ``instructions``: a system message first (not carried over by ``previous_response_id``, as the
  OpenAI API);
- a message item (``{"role", "content"}``, with or without ``"type": "message"``): that message;
  content a string or ``input_text`` / ``output_text`` parts;
- the items of one model turn as the answer lists them (a ``reasoning`` item, an assistant message,
  ``function_call`` items): one assistant message with its ``reasoning_content``, text and
  ``tool_calls`` (``call_id`` is the tool call's id), which equals the recorded answer when sent
  back unchanged, so the next turn continues its tokens;
- ``function_call_output``: a tool message answering ``call_id``;
- ``previous_response_id``: that response's conversation (its input and its output) before ``input``.

Tools: ``{"type": "function", "name", "description", "parameters"}``; ``tool_choice`` ``auto``,
``none``, ``required`` or ``{"type": "function", "name"}``. ``max_output_tokens``, ``temperature``,
``top_p``, ``parallel_tool_calls`` as in chat; ``include: ["message.output_text.logprobs"]`` gives the
recorded log-prob of each output token on the ``output_text`` part. ``stream=True``: the Responses
event stream of the whole answer, sent once the turn is generated (buffered, as chat's stream:
``areal_fast.agent.stream``). Refused with a 400 naming the parameter: other tool types (web search,
file search, MCP, computer, custom), other input items (images, files, item references), a
``text.format`` other than text, ``background``, ``conversation``, stored ``prompt``s,
``truncation: auto``, ``context_management``. Accepted and ignored: ``store``, ``metadata``,
``user``, ``service_tier``, ``safety_identifier``, ``prompt_cache_*``, ``reasoning`` (the template's
reasoning parser decides), ``max_tool_calls``, ``include`` values of tools we do not serve.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping

from areal_fast.agent.completion import Record, logprobs_dict
from areal_fast.agent.request import ChatRequestError, culprit
from areal_fast.agent.sdk_args import sdk_body, within
from areal_fast.agent.session import ChatCall, Session

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_IGNORED = ("store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
            "prompt_cache_retention", "prompt_cache_options", "reasoning", "max_tool_calls", "stream_options")
_INCLUDES_IGNORED = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                     "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs")
_REFUSED = {"background": "background responses (each call is one recorded turn, answered when generated)",
            "conversation": "server-side conversations (send the items, or previous_response_id)",
            "prompt": "stored prompts", "context_management": "context management"}
KNOWN = {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "max_output_tokens",
         "temperature", "top_p", "parallel_tool_calls", "stream", "include", "top_logprobs", "text",
         "truncation", *_IGNORED, *_REFUSED}


def response_id(call: ChatCall) -> str:
    return "resp_" + call.completion_id.removeprefix("chatcmpl-")


def _plain(obj, where: str) -> dict:
    if isinstance(obj, Mapping):
        return dict(obj)
    dump = getattr(obj, "model_dump", None)
    if callable(dump):  # the SDK's own item objects (a previous response's r.output)
        return dump(exclude_none=True)
    raise ChatRequestError(f"{where}: expected an object, got {type(obj).__name__}", where)


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list | tuple):
        raise ChatRequestError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}",
                               where)
    out = []
    for k, part in enumerate(content):
        p = _plain(part, f"{where}[{k}]")
        if p.get("type") not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
            raise ChatRequestError(f"{where}[{k}]: only text parts are supported (input_text, output_text), "
                                   f"got type {culprit(p.get('type'))}", f"{where}[{k}]")
        out.append(p["text"])
    return "".join(out)


class _Conversation:
    """Chat messages built from Responses items; ``origin[i]`` names where message i came from."""

    def __init__(self):
        self.messages: list[dict] = []
        self.origin: list[str] = []
        self._open: dict | None = None  # the assistant turn that later items of the same turn join

    def add(self, message: dict, where: str, *, open_turn: bool = False) -> None:
        self.messages.append(message)
        self.origin.append(where)
        self._open = message if open_turn else None

    def assistant(self, where: str, *, joinable) -> dict:
        """The open assistant turn when ``joinable(turn)``, else a new one."""
        if self._open is not None and joinable(self._open):
            return self._open
        turn = {"role": "assistant", "content": ""}
        self.add(turn, where, open_turn=True)
        return turn

    def item(self, raw, where: str) -> None:
        d = _plain(raw, where)
        kind = d.get("type", "message")
        if kind == "message":
            role = d.get("role")
            text = _text(d.get("content"), f"{where}.content")
            if role != "assistant":
                self.add({"role": role, "content": text}, where)  # the role is checked by the chat request
                return
            turn = self.assistant(where, joinable=lambda t: not t["content"] and not t.get("tool_calls"))
            turn["content"] = text
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(d.get(key), str):
                    raise ChatRequestError(f"{where}.{key}: expected a string, got {culprit(d.get(key))}",
                                           f"{where}.{key}")
            turn = self.assistant(where, joinable=lambda t: True)
            turn.setdefault("tool_calls", []).append(
                {"id": d["call_id"], "type": "function", "function": {"name": d["name"], "arguments": d["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(d.get("call_id"), str):
                raise ChatRequestError(f"{where}.call_id: expected the id of the call it answers", f"{where}.call_id")
            self.add({"role": "tool", "tool_call_id": d["call_id"], "content": _text(d.get("output"),
                                                                                     f"{where}.output")}, where)
        elif kind == "reasoning":
            parts = d.get("content") or []
            text = "".join(_plain(p, f"{where}.content").get("text", "") for p in parts)
            turn = {"role": "assistant", "content": ""}
            if text:
                turn["reasoning_content"] = text
            self.add(turn, where, open_turn=True)
        else:
            raise ChatRequestError(f"{where}.type: {culprit(kind)} items are not supported (messages, function_call, "
                                   "function_call_output and reasoning are)", f"{where}.type")


def _tools(raw) -> list[dict]:
    out = []
    for k, t in enumerate(raw or ()):
        d = _plain(t, f"tools[{k}]")
        if d.get("type") != "function":
            raise ChatRequestError(f"tools[{k}].type: only function tools are supported, got {culprit(d.get('type'))}",
                                   f"tools[{k}].type")
        fn = {"name": d.get("name"), "description": d.get("description") or "", "parameters": d.get("parameters")}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    d = _plain(choice, "tool_choice")
    if d.get("type") == "function" and isinstance(d.get("name"), str):
        return {"type": "function", "function": {"name": d["name"]}}
    raise ChatRequestError(f"tool_choice: expected auto, none, required or {{'type': 'function', 'name': ...}}, "
                           f"got {culprit(choice)}", "tool_choice")


def _check(body: Mapping) -> None:
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ChatRequestError(f"unsupported parameter(s) {unknown}", unknown[0])
    for key, what in _REFUSED.items():
        if body.get(key) not in (None, False):
            raise ChatRequestError(f"{key}: not supported ({what}), got {culprit(body[key])}", key)
    if body.get("truncation") not in (None, "disabled"):
        raise ChatRequestError(f"truncation: only 'disabled' is supported (the context is never cut), got "
                               f"{culprit(body['truncation'])}", "truncation")
    fmt = (_plain(body["text"], "text").get("format") if body.get("text") is not None else None)
    if fmt is not None and _plain(fmt, "text.format").get("type") != "text":
        raise ChatRequestError(f"text.format: only 'text' is supported, got {culprit(fmt)}", "text.format")
    n = body.get("max_output_tokens")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ChatRequestError(f"max_output_tokens: expected an integer >= 1, got {culprit(n)}", "max_output_tokens")
    include = body.get("include") or []
    if not isinstance(include, list | tuple):
        raise ChatRequestError(f"include: expected a list, got {culprit(include)}", "include")
    for k, v in enumerate(include):
        if v != LOGPROBS_INCLUDE and v not in _INCLUDES_IGNORED:
            raise ChatRequestError(f"include[{k}]: unknown value {culprit(v)}", f"include[{k}]")


def chat_body(body: Mapping, session: Session) -> tuple[dict, list[str], list[dict]]:
    """The chat request ``body`` means, where each of its messages came from, and the conversation
    it carries on (``previous_response_id``'s and ``input``'s messages, without the instructions)."""
    if not isinstance(body, Mapping):
        raise ChatRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check(body)
    conv = _Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        conv.add({"role": "system", "content": _text(instructions, "instructions")}, "instructions")
    prev = body.get("previous_response_id")
    if prev is not None:
        earlier = session.responses.get(prev) if isinstance(prev, str) else None
        if earlier is None:
            raise ChatRequestError(f"previous_response_id: no response {culprit(prev)} in this episode",
                                   "previous_response_id")
        for m in earlier:
            conv.add(m, "previous_response_id")
    raw = body.get("input")
    if isinstance(raw, str):
        conv.add({"role": "user", "content": raw}, "input")
    elif isinstance(raw, list | tuple) and raw:
        for i, item in enumerate(raw):
            conv.item(item, f"input[{i}]")
    else:
        raise ChatRequestError("input: expected a string or a non-empty list of items", "input")
    chat = {"model": body.get("model"), "messages": conv.messages, "stream": False}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    for key, value in (("tool_choice", _tool_choice(body.get("tool_choice"))),
                       ("max_completion_tokens", body.get("max_output_tokens")),
                       ("temperature", body.get("temperature")), ("top_p", body.get("top_p")),
                       ("parallel_tool_calls", body.get("parallel_tool_calls")),
                       ("top_logprobs", body.get("top_logprobs"))):
        if value is not None:
            chat[key] = value
    if LOGPROBS_INCLUDE in (body.get("include") or ()):
        chat["logprobs"] = True
    skip = 1 if instructions is not None else 0
    return chat, conv.origin, conv.messages[skip:]


_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


def _renamed(e: ChatRequestError, origin: list[str]) -> ChatRequestError:
    """``e`` with the chat request's names (``messages[i]``, ``max_completion_tokens``) as the
    Responses request's (``input[j]``, ``max_output_tokens``)."""
    def sub(text: str | None) -> str | None:
        if text is None:
            return None
        text = re.sub(r"messages\[(\d+)\]", lambda m: origin[int(m.group(1))] if int(m.group(1)) < len(origin)
                      else m.group(0), text)
        for a, b in _CHAT_NAMES.items():
            text = text.replace(a, b)
        return text
    return ChatRequestError(sub(str(e)), sub(e.param))


async def create_response(session: Session, body: Mapping) -> tuple[ChatCall, dict]:
    """One ``responses.create``: recorded as a chat call; the call and the ``response`` JSON."""
    chat, origin, conversation = chat_body(body, session)
    try:
        call = await session.create(chat)
    except ChatRequestError as e:
        raise _renamed(e, origin) from None
    data = response_dict(call, session, body)
    session.responses[data["id"]] = conversation + [call.response.to_dict()]
    return call, data


def _usage(call: ChatCall) -> dict:
    n_in, n_out = len(call.sample.prompt_ids), len(call.sample.output_ids)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def output_items(call: ChatCall, session: Session) -> list[dict]:
    """The ``output`` items of ``call``: its reasoning, its text, its function calls, in that order."""
    rid = call.completion_id.removeprefix("chatcmpl-")
    status = "incomplete" if call.finish_reason == "length" else "completed"
    out: list[dict] = []
    if call.reasoning_content:
        out.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": call.reasoning_content}]})
    if call.content or not call.tool_calls:
        lp = logprobs_dict(call, session)
        out.append({"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
                    "content": [{"type": "output_text", "text": call.content, "annotations": [],
                                 "logprobs": lp["content"] if lp else []}]})
    for k, c in enumerate(call.tool_calls):
        out.append({"type": "function_call", "id": f"fc_{rid}_{k}", "call_id": c.id, "name": c.name,
                    "arguments": c.arguments, "status": "completed"})
    return out


def response_dict(call: ChatCall, session: Session, body: Mapping) -> dict:
    """The ``response`` JSON of ``call`` made for the request ``body``."""
    incomplete = call.finish_reason == "length"
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": False} for t in call.tools]
    choice = body.get("tool_choice")
    return {
        "id": response_id(call), "object": "response", "created_at": int(call.created), "model": session.model,
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
        "output": output_items(call, session),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "tool_choice": choice if isinstance(choice, str) else (_plain(choice, "tool_choice") if choice else "auto"),
        "tools": tools, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": _usage(call), "metadata": {},
        "store": False,
    }


def event_dicts(data: dict) -> list[dict]:
    """The Responses stream events of a finished ``response`` JSON, in order (buffered: the whole
    text in one ``response.output_text.delta``, each call's arguments in one delta)."""
    events: list[dict] = []

    def emit(kind: str, **fields) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    emit("response.created", response={**data, "status": "in_progress", "output": [], "usage": None})
    emit("response.in_progress", response={**data, "status": "in_progress", "output": [], "usage": None})
    for i, item in enumerate(data["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                 part={**part, "text": "", "logprobs": []})
            emit("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                 delta=part["text"], logprobs=part["logprobs"])
            emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                 text=part["text"], logprobs=part["logprobs"])
            emit("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        elif item["type"] == "function_call":
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=i, name=item["name"],
                 arguments=item["arguments"])
        else:  # reasoning
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            text = item["content"][0]["text"]
            emit("response.reasoning_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text)
            emit("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.incomplete" if data["status"] == "incomplete" else "response.completed", response=data)
    return events


def as_response(data: dict):
    """``openai.types.responses.Response`` of ``data`` when openai is installed, else a ``Record``."""
    try:
        types = importlib.import_module("openai.types.responses")
    except ImportError:
        return Record(data)
    return types.Response.model_validate(data)


def as_event(data: dict):
    """One stream event as the SDK's type (``ResponseStreamEvent``) when openai is installed."""
    try:
        pydantic = importlib.import_module("pydantic")
        types = importlib.import_module("openai.types.responses")
    except ImportError:
        return Record(data)
    return pydantic.TypeAdapter(types.ResponseStreamEvent).validate_python(data)


class EventStream:
    """What the in-process ``responses.create(stream=True)`` returns, as the SDK's ``AsyncStream``:
    ``async for event in stream``, ``async with stream``, ``await stream.close()``."""

    def __init__(self, events: list[dict]):
        self._events = iter([as_event(e) for e in events])

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self):
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    async def close(self) -> None:
        self._events = iter(())

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def wants_stream(body: Mapping) -> bool:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ChatRequestError(f"stream: expected true or false, got {culprit(stream)}", "stream")
    return bool(stream)


class Responses:
    """``client.responses`` of the in-process client: ``create`` as ``openai.AsyncOpenAI``'s, with the
    SDK's own keywords (``extra_body``, ``extra_headers``, ``extra_query``, ``timeout``, ``NOT_GIVEN``)
    treated as the chat client treats them."""

    def __init__(self, session: Session):
        self._session = session

    async def create(self, **kwargs):
        body, timeout = sdk_body(kwargs)
        stream = wants_stream(body)
        turn = create_response(self._session, body)
        _, data = await (turn if timeout is None else within(turn, timeout))
        return EventStream(event_dicts(data)) if stream else as_response(data)
