"""Tool calls out of a model's text, in the format the model was taught, chosen by name.

Each parser is ``parse(text, tools) -> (content, calls)``: ``calls`` are the
:class:`~areal_fast.agent.request.ToolCall` (no ids yet; the session numbers them) of the functions
offered in ``tools``, in the order written; ``content`` is the text less the call blocks (stripped).
A block that is not a well-formed call, or that calls a function not offered, stays in the text:
the agent sees what the model wrote rather than a call it cannot run; JSON nested deeper than the
decoder's recursion limit is not well-formed (its RecursionError would otherwise escape the parser
and lose the turn). Several calls in one output are parallel tool calls. Every parser is one
left-to-right scan with ``str.find`` (linear in the output, whatever the model wrote: these run on
the event loop).

``hermes``
    ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number of blocks: the format
    Qwen2.5's and Hermes' chat templates teach. Once one block is a call, every block leaves the
    content (a malformed one included).
``qwen3_coder``
    Qwen3-Coder's XML::

        <tool_call>
        <function=f>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    each value is text; it becomes the JSON type the function's schema gives the parameter
    (``integer``, ``number``, ``boolean``, ``object``/``array`` read as JSON, ``null``), and stays a
    string when the schema says string, says nothing, or the text does not read as that type.
``json``
    the whole output (less white space and an optional Markdown code fence) is one call object
    ``{"name": "f", "arguments": {...}}`` (``"parameters"`` is read as ``"arguments"``, as Llama 3
    writes them) or a JSON list of them; anything else is text.

:data:`TOOL_PARSERS` maps the names to the parsers; ``rollout.workflow_args.tool_parser`` (or
``engine.openai(tool_parser=...)``) picks one for a tokenizer's own chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from areal_fast.agent.request import Tool, ToolCall

Parsed = tuple[str, list[ToolCall]]


def _call(name, args, offered: dict[str, Tool]) -> ToolCall | None:
    if not isinstance(name, str) or name not in offered:
        return None
    if args is None:
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON text already
        return ToolCall(id="", name=name, arguments=args) if _loads(args) is not _MALFORMED else None
    if not isinstance(args, dict):
        return None
    try:
        return ToolCall(id="", name=name, arguments=json.dumps(args))
    except RecursionError:  # nested about as deep as the decoder allows, then deeper on this stack
        return None


_MALFORMED = object()


def _loads(text: str):
    """``json.loads(text)``, or :data:`_MALFORMED` when it is not JSON. Nesting deeper than the
    decoder's recursion limit (``[[[[...`` a thousand deep) is malformed too: the decoder raises
    RecursionError, which would otherwise escape the parser and lose the turn."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _MALFORMED


def blocks(text: str, open_: str, close: str) -> list[tuple[int, int, str]]:
    """The ``open_ ... close`` blocks of ``text``: (start, end, the text inside), in order. A block ends
    at the first close after its open (an open inside a block is text of that block); an open never
    closed is text. One scan: linear in ``len(text)`` (a regex ``open(.*?)close`` backtracks
    polynomially after an unclosed open)."""
    out = []
    pos = 0
    while True:
        start = text.find(open_, pos)
        if start < 0:
            return out
        end = text.find(close, start + len(open_))
        if end < 0:
            return out  # no close after this open, so none after any later one either
        out.append((start, end + len(close), text[start + len(open_):end]))
        pos = end + len(close)


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    kept, pos = [], 0
    for start, end in spans:
        kept.append(text[pos:start])
        pos = end
    kept.append(text[pos:])
    return "".join(kept).strip()


def _from_blocks(text: str, found: list[tuple[int, int, ToolCall | None]], drop_all: bool = False) -> Parsed:
    """``drop_all``: once one block is a call, every block goes from the content (Hermes, as before)."""
    calls = [c for _, _, c in found if c is not None]
    if not calls:
        return text, []
    return _without(text, [(s, e) for s, e, c in found if drop_all or c is not None]), calls


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, tools: tuple[Tool, ...]) -> Parsed:
    offered = {t.name: t for t in tools}
    found = []
    for start, end, inner in blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        d = _loads(inner.strip())
        ok = isinstance(d, dict)
        found.append((start, end, _call(d.get("name"), d.get("arguments", {}), offered) if ok else None))
    return _from_blocks(text, found, drop_all=True)


_FUNCTION_OPEN, _FUNCTION_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"


def _typed(value: str, schema: dict):
    """``value`` (a parameter's text) as the JSON type ``schema`` gives it; the text when it does not read."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or kind is None:
        return value
    if value.strip().lower() == "null" and "null" in kinds:
        return None
    for k in kinds:
        try:
            if k == "integer":
                return int(value.strip())
            if k == "number":
                v = float(value.strip())
                return int(v) if v.is_integer() and "." not in value and "e" not in value.lower() else v
            if k == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if k in ("object", "array"):
                v = _loads(value)
                if isinstance(v, dict if k == "object" else list):
                    return v
        except ValueError:
            continue
    return value


def _strip_one_newline(value: str) -> str:
    """The value between ``<parameter=x>`` and ``</parameter>`` less the one line break each tag adds."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _xml_call(inner: str, offered: dict[str, Tool]) -> ToolCall | None:
    fn = blocks(inner, _FUNCTION_OPEN, _FUNCTION_CLOSE)
    if len(fn) != 1:
        return None
    body = fn[0][2]
    head_end = body.find(">")
    if head_end < 0:
        return None
    name = body[:head_end].strip()
    tool = offered.get(name)
    if tool is None:
        return None
    props = tool.parameters.get("properties") or {}
    args: dict = {}
    for _, _, p in blocks(body[head_end + 1:], _PARAM_OPEN, _PARAM_CLOSE):
        k = p.find(">")
        if k < 0:
            return None
        key = p[:k].strip()
        args[key] = _typed(_strip_one_newline(p[k + 1:]), props.get(key) or {})
    return ToolCall(id="", name=name, arguments=json.dumps(args))


def parse_qwen3_coder(text: str, tools: tuple[Tool, ...]) -> Parsed:
    offered = {t.name: t for t in tools}
    found = [(s, e, _xml_call(inner, offered)) for s, e, inner in blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)]
    return _from_blocks(text, found)


def _unfenced(text: str) -> str:
    t = text.strip()
    if t.startswith("```") and t.endswith("```") and len(t) >= 6:
        t = t[3:-3]
        t = t[4:] if t.startswith("json") else t
    return t.strip()


def parse_json(text: str, tools: tuple[Tool, ...]) -> Parsed:
    offered = {t.name: t for t in tools}
    body = _unfenced(text)
    if body[:1] not in ("{", "["):
        return text, []
    d = _loads(body)
    if d is _MALFORMED:
        return text, []
    items = d if isinstance(d, list) else [d]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return text, []
        c = _call(item.get("name"), item.get("arguments", item.get("parameters")), offered)
        if c is None:
            return text, []  # all or nothing: a list with a bad item is not a call list
        calls.append(c)
    return ("", calls) if calls else (text, [])


TOOL_PARSERS: dict[str, Callable[[str, tuple[Tool, ...]], Parsed]] = {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "json": parse_json,
}


def tool_parser(name: str):
    """The parser called ``name`` (ValueError naming the known ones)."""
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"tool_parser: expected one of {sorted(TOOL_PARSERS)}, got {name!r}") from None
