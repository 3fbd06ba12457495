"""Cheap /generate answers: fast JSON, compact per-token arrays, and a garbage collector kept off them.

At 16k requests in flight the controller takes in ~10^6 tokens/s, and SGLang sends each token's
log-prob as a small list ``[logprob, id, null]``. Decoded with ``json`` and kept as Python objects
that is ~150 bytes and four objects per token, and every full collection of the garbage collector
scans the lists. So one answer is decoded here (orjson when installed: ~2.5x faster than ``json``
on these answers, 106 vs 270 ns per token on our 2-core machine), its tokens, log-probs and
per-token versions are copied at once into ``array`` columns (4 + 4 + 4 bytes per token, not
tracked by the collector), and the decoded answer is dropped before anything waits. The collector
is paused while one answer is decoded and copied: its thousands of short-lived lists would
otherwise trigger generation-0 collections that promote them, live, to older generations.

The native scanner (``areal_fast._C.scan_generate_answer``, ``csrc/rollout/answer_scan.cpp``)
goes further: it reads ``output_ids`` and the log-probs straight from the answer's bytes into the
columns, and orjson decodes only the small rest (73-114 vs 210-260 ns per token for orjson and
the column picking, 100 to 32,000 tokens an answer, ``bench/bench_answer_parse.py``). The orjson
path (:func:`_parse_reference`) stays the reference: the shape rules and errors live there, and it
takes every answer the scanner declines (counted by reason in :data:`FALLBACKS`).
``AREAL_FAST_ANSWER_PARSER=python`` forces it alone; ``docs/scale.md`` has both.

What an answer must be (both paths; anything else is an :class:`AnswerError` naming the server and
the rid): one JSON object that orjson reads (no NaN or Infinity, valid UTF-8) with no duplicate
key in any object; ``output_ids``
integers (not booleans) in ``[0, vocab)`` (``[0, 2**31)`` when the vocabulary is not known);
``meta_info`` an object whose ``output_token_logprobs`` has one ``[logprob, id, ...]`` entry per
output id, ``id`` equal to that output id and ``logprob`` a finite number <= 0 (after rounding to
float32); ``id`` a string, ``finish_reason`` an object with a string ``type``, ``weight_version``
and the ``weight_versions`` spans' versions in ``[0, 2**31)`` (or a non-numeric string), spans
with integer ``start`` and ``end``. The native scanner declines (to the reference) every answer
that breaks a per-token rule, so both paths accept exactly the same answers.

:func:`tune_gc` is for the controller process after start-up (``gc.freeze()`` of what start-up
built, and higher thresholds); ``docs/scale.md`` has the numbers before and after.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
from array import array
from collections import Counter
from dataclasses import dataclass
from operator import itemgetter

from areal_fast.columns import LOGPROB_ARRAY, TOKEN_ARRAY

try:  # a dependency of the rollout extra; the standard library's json is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised only where orjson is missing
    _orjson = None

_INT_RE = re.compile(r"^-?\d+$")
SCAN_RULES = 2  # the answer rules a native scanner must enforce to be used (areal_fast._C.ANSWER_SCAN_RULES)
MAX_VERSION = 2**31 - 1  # versions live in int32 columns

PARSER_ENV = "AREAL_FAST_ANSWER_PARSER"  # "native" (default: the scanner when built) or "python"


def _native_scanner():
    choice = os.environ.get(PARSER_ENV, "native")
    if choice not in ("native", "python"):
        raise ValueError(f"{PARSER_ENV}={choice!r}: expected 'native' or 'python'")
    if choice == "python":
        return None
    try:
        from areal_fast import _C
    except ImportError:  # a source checkout without the built module: the reference alone
        return None
    scan = getattr(_C, "scan_generate_answer", None)
    if scan is not None and getattr(_C, "ANSWER_SCAN_RULES", 0) < SCAN_RULES:
        # a module built before the answer rules: it would accept answers the reference refuses
        import logging

        logging.getLogger(__name__).warning(
            "areal_fast._C predates the answer rules (ANSWER_SCAN_RULES < %d): every answer is parsed by "
            "the reference until the package is rebuilt (pip install -e .)", SCAN_RULES)
        return None
    return scan


_scan = _native_scanner()  # areal_fast._C.scan_generate_answer, or None for the reference alone
FALLBACKS: Counter[str] = Counter()  # answers the scanner left to the reference, by its reason
_first = itemgetter(0)


class AnswerError(ValueError):
    """An answer that does not have the shape of a /generate result (the message names the rid)."""


def loads(raw: bytes | bytearray | memoryview | str):
    """Decode JSON bytes (orjson when installed; the HTTP path hands a memoryview of its buffer)."""
    if _orjson is not None:
        return _orjson.loads(raw)
    return json.loads(raw.tobytes() if isinstance(raw, memoryview) else raw)


def dumps(obj) -> bytes:
    """Encode to JSON bytes (orjson when installed)."""
    if _orjson is not None:
        return _orjson.dumps(obj)
    return json.dumps(obj, separators=(",", ":")).encode()


def version_to_int(v: str | int | None) -> int:
    """Server weight_version string -> int: "7" -> 7, "default" (the initial weights) -> 0, else -1."""
    if isinstance(v, int):
        return v
    if v is not None and _INT_RE.match(v):
        return int(v)
    return 0 if v in (None, "default") else -1


@dataclass(slots=True)
class Segment:
    """One /generate answer, compact: what the client keeps of it (the decoded JSON is gone).

    ``versions`` is None when the answer names no version at all (SGLang 0.5.6-0.5.8 for a request
    aborted while waiting); the client then labels its tokens with the version it knew."""

    ids: array
    logprobs: array
    versions: array | None
    finish: dict
    weight_version: str | None
    rid: object = None
    routing: object = None
    """MoE routing the server returned for the answer's forwarded positions, as it came: SGLang's
    ``meta_info["routed_experts"]`` (a base64 string), or the vLLM adapter's decoded int16
    ``[positions, layers, top_k]`` array; None when the answer has none (the client decodes it,
    knowing how many positions it asked for: ``areal_fast.rollout.client``)."""

    def __len__(self) -> int:
        return len(self.ids)


def token_versions(meta: dict, n: int, fallback: str | None = None) -> array | None:
    """Per-token versions of one answer (``array('i')``): from the ``weight_versions`` spans
    (SGLang >= 0.5.19: tokens made before and after an update keep their own) or the answer's
    ``weight_version``, else ``fallback``; None when none of them is known."""
    wv = meta.get("weight_version")
    if wv is None:
        wv = fallback
    spans = meta.get("weight_versions")
    if wv is None and n and not spans:
        return None
    out = array(TOKEN_ARRAY, [version_to_int(wv)]) * n
    for sp in spans or ():
        start, end = max(0, int(sp["start"])), min(n, int(sp["end"]))
        if end > start:
            out[start:end] = array(TOKEN_ARRAY, [version_to_int(sp.get("version"))]) * (end - start)
    return out


class _Refused(ValueError):
    """A rule of the module docstring broken; the message says which (AnswerError adds the where)."""


def _version(v, what: str) -> int:
    """A weight version as an int: numeric ones in [0, MAX_VERSION], "default" 0, other strings -1."""
    if v is None:
        return 0
    if type(v) is int or (type(v) is str and _INT_RE.match(v)):
        if len(str(v)) > 11 or not 0 <= int(v) <= MAX_VERSION:  # no int() of 5000 digits
            raise _Refused(f"{what} {str(v)[:40]!r} outside [0, {MAX_VERSION}]")
        return int(v)
    if type(v) is str:
        return version_to_int(v)
    raise _Refused(f"{what} is a {type(v).__name__}, not a string or an integer")


def checked_version(v, what: str) -> int:
    """A weight version under this module's rules (``[0, 2**31)``, "default" 0, other strings -1);
    ValueError naming ``what`` otherwise. The vLLM adapter's answers are held to the same rule."""
    return _version(v, what)


def checked_logprob(x, what: str) -> float:
    """A log-prob under this module's rules: a number (not a boolean), finite and <= 0 after
    rounding to float32 (the column's type); ValueError naming ``what`` otherwise."""
    if type(x) not in (int, float):
        raise _Refused(f"{what} is a {type(x).__name__}, not a number")
    f = array(LOGPROB_ARRAY, [x])[0] if math.isfinite(x) else x
    if not math.isfinite(f) or f > 0:
        raise _Refused(f"{what} {x!r} is not a finite log-prob <= 0")
    return float(f)


def _check_meta(meta) -> None:
    """The rules for meta_info's small fields (shared by both paths)."""
    if type(meta) is not dict:
        raise _Refused(f"meta_info is a {type(meta).__name__}, not an object")
    rid = meta.get("id")
    if rid is not None and type(rid) is not str:
        raise _Refused(f"meta_info.id is a {type(rid).__name__}, not a string")
    fr = meta.get("finish_reason")
    if fr is not None:
        if type(fr) is not dict or type(fr.get("type")) is not str:
            raise _Refused(f"finish_reason {str(fr)[:80]!r} is not an object with a string type")
        matched = fr.get("matched")
        if matched is not None and type(matched) not in (int, str):
            raise _Refused(f"finish_reason.matched is a {type(matched).__name__}")
    _version(meta.get("weight_version"), "weight_version")
    routed = meta.get("routed_experts")
    if routed is not None and type(routed) is not str:
        raise _Refused(f"routed_experts is a {type(routed).__name__}, not a base64 string")
    spans = meta.get("weight_versions")
    if spans is not None:
        if type(spans) is not list:
            raise _Refused(f"weight_versions is a {type(spans).__name__}, not a list of spans")
        for sp in spans:
            if type(sp) is not dict or type(sp.get("start")) is not int or type(sp.get("end")) is not int:
                raise _Refused(f"weight_versions span {str(sp)[:80]!r} has no integer start and end")
            _version(sp.get("version"), "weight_versions version")


def _segment(ids: array, lps: array, meta: dict) -> Segment:
    _check_meta(meta)
    wv = meta.get("weight_version")
    return Segment(ids=ids, logprobs=lps, versions=token_versions(meta, len(ids)),
                   finish=meta.get("finish_reason") or {"type": "length"},
                   weight_version=None if wv is None else str(wv), rid=meta.get("id"),
                   routing=meta.get("routed_experts"))


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"duplicate key {k[:80]!r}")
            seen.add(k)
    return obj


def _no_constant(name: str):
    raise _Refused(f"{name} is not JSON")


# Duplicate keys: orjson (the reference's decoder) keeps the last value, so a second decoder that
# sees every key (the standard library's, with a pairs hook) judges the answers that may hold one.
_PAIRS_JSON = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _keys_and_colons(obj, skip: tuple) -> tuple[int, int]:
    """Keys of the dicts in ``obj`` and the ':' in their strings, not looking inside ``skip``."""
    keys = colons = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if any(o is x for x in skip):
            continue
        if type(o) is dict:
            keys += len(o)
            for k, v in o.items():
                colons += k.count(":")
                stack.append(v)
        elif type(o) is list:
            stack.extend(o)
        elif type(o) is str:
            colons += o.count(":")
    return keys, colons


def _check_unique_keys(raw: bytes, data) -> None:
    """Refuse a duplicate key anywhere in ``raw`` (decoded by orjson as ``data``).

    Cheap proof first: every key is followed by one ':' outside strings, and orjson keeps one key per
    distinct name, so when the answer has no \\u escape (the only way to spell ':' without the byte)
    and its ':' bytes number exactly the keys plus the ':' in the strings that orjson kept (counted
    outside the two per-token arrays), no key was dropped: a duplicate, a dict or a string with ':'
    inside the per-token arrays would all leave more ':' bytes than that. Otherwise the pairs
    decoder looks at every key."""
    if b"\\u" not in raw and type(data) is dict:
        meta = data.get("meta_info")
        skip = (data.get("output_ids"), meta.get("output_token_logprobs") if type(meta) is dict else None)
        keys, colons = _keys_and_colons(data, tuple(x for x in skip if x is not None))
        if raw.count(b":") == keys + colons:
            return
    _PAIRS_JSON.decode(raw.decode("utf-8"))  # orjson accepted it: only a duplicate (_Refused) can fail


def _types(values, allowed: tuple, what: str) -> None:
    extra = set(map(type, values)).difference(allowed)
    if extra:
        raise _Refused(f"{what} holds a {sorted(t.__name__ for t in extra)[0]}")


def _columns(data, raw, vocab: int) -> tuple[array, array, dict]:
    """The reference's columns and rules (see the module docstring)."""
    if type(data) is not dict:
        raise _Refused(f"answered {type(data).__name__}, not one result: {str(data)[:200]}")
    if "meta_info" not in data or "output_ids" not in data:
        raise _Refused(f"not a /generate result (no {'meta_info' if 'meta_info' not in data else 'output_ids'})")
    meta, out = data["meta_info"], data["output_ids"]
    if type(meta) is not dict:
        raise _Refused(f"meta_info is a {type(meta).__name__}, not an object")
    if type(out) is not list:
        raise _Refused(f"output_ids is a {type(out).__name__}, not a list")
    entries = meta.get("output_token_logprobs")
    entries = [] if entries is None else entries
    if type(entries) is not list:
        raise _Refused(f"output_token_logprobs is a {type(entries).__name__}, not a list")
    if len(entries) != len(out):
        raise _Refused(f"{len(out)} output ids but {len(entries)} logprobs")
    try:
        lp_values = [e[0] for e in entries]
        entry_ids = [e[1] for e in entries]
    except (IndexError, KeyError, TypeError):
        raise _Refused("a log-prob entry is not [logprob, id, ...]") from None
    if b"true" in raw or b"false" in raw:  # JSON booleans are Python ints: array() would take them
        _types(out, (int,), "output_ids")
        _types(lp_values, (float, int), "a log-prob")
        _types(entry_ids, (int,), "a log-prob entry's token id")
    ids = array(TOKEN_ARRAY, out)  # TypeError for a float or a string, OverflowError outside int32
    if array(TOKEN_ARRAY, entry_ids) != ids:
        raise _Refused("a log-prob entry's token id differs from output_ids at its place")
    if ids and (min(ids) < 0 or (vocab > 0 and max(ids) >= vocab)):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise _Refused(f"output id {bad} outside the vocabulary [0, {vocab or 2**31})")
    lps = array(LOGPROB_ARRAY, lp_values)  # OverflowError for an int past float
    if lps and not (math.isfinite(sum(lps)) and max(lps) <= 0.0):
        raise _Refused("log-probs must be finite and <= 0")
    return ids, lps, meta


def _parse_reference(raw, where: str, vocab: int = 0) -> Segment:
    """The reference: decode everything, check every rule, then pick the columns."""
    try:
        raw = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
        data = loads(raw)  # orjson: NaN, Infinity, invalid UTF-8, a BOM and lone surrogates refused
        _check_unique_keys(raw, data)
        return _segment(*_columns(data, raw, vocab))
    except (ValueError, TypeError, OverflowError, RecursionError) as e:  # _Refused, JSON and UTF-8 errors too
        why = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
        raise AnswerError(f"{where}: not a valid /generate result: {why[:300]}") from None


def _parse_native(raw, vocab: int = 0) -> Segment | None:
    """The scanner's columns and the small rest decoded by :func:`loads`; None (counted in
    :data:`FALLBACKS` by reason) when the answer is one for the reference to judge."""
    got = _scan(raw, vocab) if not isinstance(raw, str) else "a str, not bytes"
    if isinstance(got, str):
        FALLBACKS[got] += 1
        return None
    ids_bytes, lps_bytes, rest = got
    try:
        meta = loads(rest)["meta_info"]
    except ValueError:  # the rest holds what the scanner left to orjson (invalid UTF-8...)
        FALLBACKS["rest not decoded"] += 1
        return None
    ids = array(TOKEN_ARRAY)
    ids.frombytes(ids_bytes)
    lps = array(LOGPROB_ARRAY)
    lps.frombytes(lps_bytes)
    if len(lps) != len(ids):  # the reference says so, in its words
        FALLBACKS["length mismatch"] += 1
        return None
    try:
        return _segment(ids, lps, meta)
    except ValueError:  # a rule of the small fields: the reference says which, in its words
        FALLBACKS["meta_info refused"] += 1
        return None


def parse_generate(raw: bytes | bytearray | memoryview, where: str, vocab: int = 0) -> Segment:
    """Decode one /generate answer into a :class:`Segment`; ``where`` (url and rid) names it in errors.
    ``vocab`` > 0: output ids must be below it. Raises :class:`AnswerError` for an answer that breaks
    a rule of the module docstring.

    The native scanner reads the answer when the module has it (see the module docstring), and the
    reference (:func:`_parse_reference`) takes every answer the scanner leaves to it. The collector
    is paused for the decode and the copy; what was decoded is freed by reference counting."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if _scan is not None:
            seg = _parse_native(raw, vocab)
            if seg is not None:
                return seg
        return _parse_reference(raw, where, vocab)
    finally:
        if was_enabled:
            gc.enable()


# Generation 0 is collected after every threshold0 container allocations (CPython's default: 700);
# an HTTP request allocates hundreds, so at thousands of answers a second the young generation was
# collected thousands of times a second, and objects that live for one request (seconds) were
# promoted and scanned again by older collections. 50,000 makes young collections ~70x rarer, each
# scanning at most 50,000 objects; what survives goes to the old generations less often.
GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> dict:
    """Make the collector cheap for a long-running controller: collect once, freeze what exists
    (modules, configs, the server pool: never garbage, never scanned again), raise the thresholds.
    Returns the previous thresholds and the number of frozen objects."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    return {"previous_thresholds": before, "thresholds": thresholds, "frozen": gc.get_freeze_count()}
