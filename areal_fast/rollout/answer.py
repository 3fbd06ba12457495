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

:func:`tune_gc` is for the controller process after start-up (``gc.freeze()`` of what start-up
built, and higher thresholds); ``docs/scale.md`` has the numbers before and after.
"""

from __future__ import annotations

import gc
import json
import os
import re
from array import array
from collections import Counter
from dataclasses import dataclass
from operator import itemgetter

try:  # a dependency of the rollout extra; the standard library's json is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised only where orjson is missing
    _orjson = None

_INT_RE = re.compile(r"^-?\d+$")

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
    return getattr(_C, "scan_generate_answer", None)


_scan = _native_scanner()  # areal_fast._C.scan_generate_answer, or None for the reference alone
FALLBACKS: Counter[str] = Counter()  # answers the scanner left to the reference, by its reason
TOKEN_ARRAY = "i"  # token ids and versions: C int (vocabularies and versions fit in 31 bits)
LOGPROB_ARRAY = "f"  # log-probs: C float (float32): the precision the trainer computes with
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


def _segment(ids: array, lps: array, meta: dict) -> Segment:
    wv = meta.get("weight_version")
    return Segment(ids=ids, logprobs=lps, versions=token_versions(meta, len(ids)),
                   finish=meta.get("finish_reason") or {"type": "length"},
                   weight_version=None if wv is None else str(wv), rid=meta.get("id"))


def _parse_reference(raw, where: str) -> Segment:
    """The reference: decode everything, then pick the columns. The shape rules and their errors."""
    data = loads(raw)
    if not isinstance(data, dict):
        raise AnswerError(f"{where}: answered {type(data).__name__}, not one result: {str(data)[:200]}")
    try:
        meta = data["meta_info"]
        ids = array(TOKEN_ARRAY, data["output_ids"])
        triples = meta.get("output_token_logprobs") or ()
        lps = array(LOGPROB_ARRAY, [t[0] for t in triples])
    except (KeyError, TypeError, OverflowError) as e:
        raise AnswerError(f"{where}: not a /generate result ({type(e).__name__}: {e})") from None
    if len(lps) != len(ids):
        raise AnswerError(f"{where}: {len(ids)} output ids but {len(lps)} logprobs")
    return _segment(ids, lps, meta)


def _parse_native(raw) -> Segment | None:
    """The scanner's columns and the small rest decoded by :func:`loads`; None (counted in
    :data:`FALLBACKS` by reason) when the answer is one for the reference to judge."""
    got = _scan(raw) if not isinstance(raw, str) else "a str, not bytes"
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
    return _segment(ids, lps, meta)


def parse_generate(raw: bytes | bytearray | memoryview, where: str) -> Segment:
    """Decode one /generate answer into a :class:`Segment`; ``where`` (url and rid) names it in errors.

    The native scanner reads the answer when the module has it (see the module docstring), and the
    reference (:func:`_parse_reference`) takes every answer the scanner leaves to it. The collector
    is paused for the decode and the copy; what was decoded is freed by reference counting."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if _scan is not None:
            seg = _parse_native(raw)
            if seg is not None:
                return seg
        return _parse_reference(raw, where)
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
