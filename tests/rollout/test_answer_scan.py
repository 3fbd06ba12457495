"""The native /generate answer scanner against its reference (the orjson path of parse_generate).

Every answer is parsed both ways and the Segments compared field by field, log-probs bit for bit;
answers the scanner must leave to the reference must give the reference's result or AnswerError."""

from __future__ import annotations

import json
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_fast import _C
from areal_fast.rollout import answer
from areal_fast.rollout.answer import AnswerError, _parse_native, _parse_reference, parse_generate


def _orjson():
    """orjson (SGLang's own encoder: its exact bytes are what the scanner must read), or skip the
    test: an optional package (the rollout extra) is never needed to collect this module."""
    return pytest.importorskip("orjson")


WHERE = "http://s0 rid=r"


def sglang_answer(n: int, seed: int = 0, version: str = "3", spans: bool = False) -> dict:
    """The shape SGLang's /generate answers with return_logprob (text, output_ids, meta_info with
    the prompt's log-probs first as null, then [logprob, id, null] per generated token)."""
    rng = random.Random(seed)
    ids = [rng.randrange(0, 151_936) for _ in range(n)]
    meta = {"id": f"rid-{seed}", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 5,
            "weight_version": version, "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.25,
            "input_token_logprobs": [[None, 1, None]] + [[-rng.random() * 9, 2, None]] * 4,
            "output_token_logprobs": [[-rng.expovariate(2.0), t, None] for t in ids]}
    if spans:
        meta["weight_versions"] = [{"start": 0, "end": n // 2, "version": "2"},
                                   {"start": n // 2, "end": n, "version": version}]
    return {"text": "tok " * n, "output_ids": ids, "meta_info": meta}


def same(a, b) -> None:
    assert a.ids == b.ids
    assert a.logprobs.tobytes() == b.logprobs.tobytes()  # bit for bit, -0.0 and NaN-free
    assert (a.versions is None) == (b.versions is None)
    if a.versions is not None:
        assert a.versions == b.versions
    assert a.finish == b.finish and a.weight_version == b.weight_version and a.rid == b.rid


def native_handles(raw: bytes):
    seg = _parse_native(raw)
    assert seg is not None, _C.scan_generate_answer(raw)
    return seg


def outcome(fn, raw):
    try:
        return fn(raw)
    except AnswerError as e:
        return ("AnswerError", str(e))
    except Exception as e:  # noqa: BLE001 - the reference's own exceptions must match too
        return (type(e).__name__, str(e))


def check_either(raw: bytes) -> None:
    """parse_generate (native first) gives what the reference gives: the same Segment or error."""
    ref = outcome(lambda r: _parse_reference(r, WHERE), raw)
    got = outcome(lambda r: parse_generate(r, WHERE), raw)
    if isinstance(ref, tuple):
        assert got == ref
    else:
        same(got, ref)


def test_the_scanner_is_built_and_used():
    assert hasattr(_C, "scan_generate_answer") and answer._scan is _C.scan_generate_answer
    answer.FALLBACKS.clear()
    for n in (0, 1, 100):
        raw = _orjson().dumps(sglang_answer(n, seed=n, spans=True))
        same(parse_generate(raw, WHERE), _parse_reference(raw, WHERE))
    assert answer.FALLBACKS == {}


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_real_shapes_every_buffer_kind(kind):
    for n, spans in ((0, False), (1, True), (7, False), (4000, True)):
        raw = _orjson().dumps(sglang_answer(n, seed=n, spans=spans))
        same(native_handles(kind(raw)), _parse_reference(raw, WHERE))
        # the standard library's spacing ("key": value, ", ") too
        raw = json.dumps(sglang_answer(n, seed=n + 1, spans=spans)).encode()
        same(native_handles(kind(raw)), _parse_reference(raw, WHERE))


def test_other_inputs_go_to_the_reference():
    raw = _orjson().dumps(sglang_answer(3, seed=4))
    strided = memoryview(raw + raw)[::2]  # not contiguous: the scanner declines, never copies
    assert _C.scan_generate_answer(strided) == "not a contiguous buffer"
    check_either(strided)
    answer.FALLBACKS.clear()
    same(parse_generate(raw.decode(), WHERE), _parse_reference(raw, WHERE))
    assert answer.FALLBACKS == {"a str, not bytes": 1}


def test_forced_reference(monkeypatch):
    monkeypatch.setenv(answer.PARSER_ENV, "python")
    assert answer._native_scanner() is None
    monkeypatch.setenv(answer.PARSER_ENV, "native")
    assert answer._native_scanner() is _C.scan_generate_answer
    monkeypatch.setenv(answer.PARSER_ENV, "fast")
    with pytest.raises(ValueError, match="AREAL_FAST_ANSWER_PARSER='fast'"):
        answer._native_scanner()


def test_the_rest_keeps_everything_but_the_two_arrays():
    ans = sglang_answer(5, seed=3)
    ids, lps, rest = _C.scan_generate_answer(_orjson().dumps(ans))
    ans["output_ids"] = []
    ans["meta_info"]["output_token_logprobs"] = []
    assert _orjson().loads(rest) == ans
    assert struct.unpack("5i", ids) == tuple(sglang_answer(5, seed=3)["output_ids"])
    assert len(lps) == 5 * 4


def test_decoys_do_not_fool_it():
    raw = (b'{"text": "\\"output_ids\\": [1], \\"meta_info\\": {}", "extra": {"output_ids": [9, 9],'
           b' "meta_info": {"output_token_logprobs": [[0.5, 1]]}}, "meta_info": {"x": {"output_token_logprobs":'
           b' [[1.0, 2, null]]}, "output_token_logprobs": [[-1.5e-05, 42, "tok\\u00e9\\n"]], "id": "a\\"b"},'
           b' "output_ids": [42]}')
    seg = native_handles(raw)
    same(seg, _parse_reference(raw, WHERE))
    assert list(seg.ids) == [42] and seg.rid == 'a"b'


@pytest.mark.parametrize("text,reason", [
    (b'[{"output_ids": [], "meta_info": {}}]', "top level is not an object"),
    (b'{"output_ids": [1]}', "no meta_info"),
    (b'{"meta_info": {}}', "no output_ids"),
    (b'{"output_ids": [1], "output_ids": [2], "meta_info": {"output_token_logprobs": [[-1, 2]]}}',
     "duplicate key output_ids"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 2]], "output_token_logprobs": []}}',
     "duplicate key output_token_logprobs"),
    (b'{"output_ids": [1], "meta_info": {}, "meta_info": {"output_token_logprobs": [[-1, 1]]}}',
     "duplicate key meta_info"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[null, 1, null]]}}', "a log-prob is not a number"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[true, 1, null]]}}', "a log-prob is not a number"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[NaN, 1, null]]}}', "a log-prob is not a number"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-Infinity, 1]]}}', "invalid JSON (not a value)"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[]]}}', "a log-prob is not a number"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [{"0": 1}]}}', "a log-prob entry is not an array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": "a"}}',
     "output_token_logprobs is neither an array nor null"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[1e400, 1]]}}', "log-prob out of double range"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[1e300, 1]]}}', "log-prob out of float range"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, 1e999]]}}',
     "log-prob out of double range"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\\ud800"]]}}',
     "lone surrogate escape inside a per-token array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\\ude00\\ud800"]]}}',
     "lone surrogate escape inside a per-token array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\\ud800x"]]}}',
     "lone surrogate escape inside a per-token array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\xff"]]}}',
     "invalid UTF-8 inside a per-token array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\xed\xa0\x80"]]}}',
     "invalid UTF-8 inside a per-token array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\xc0\x80"]]}}',
     "invalid UTF-8 inside a per-token array"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, "\xf4\x90\x80\x80"]]}}',
     "invalid UTF-8 inside a per-token array"),
    (b'{"output_ids": [1.0], "meta_info": {}}', "an output id is not an integer"),
    (b'{"output_ids": [2147483648], "meta_info": {}}', "an output id is outside int32"),
    (b'{"output_ids": [-2147483649], "meta_info": {}}', "an output id is outside int32"),
    (b'{"output_ids": [12345678901234567890123], "meta_info": {}}', "integer too long"),
    (b'{"output_ids": [01], "meta_info": {}}', "expected , or ] in output_ids"),
    (b'{"output_ids": [true], "meta_info": {}}', "an output id is not a number"),
    (b'{"output_ids": null, "meta_info": {}}', "output_ids is not an array"),
    (b'{"output_ids": [1], "meta_info": null}', "meta_info is not an object"),
    (b'{"output_ids": [1], "meta_info": []}', "meta_info is not an object"),
    (b'{"output_ids": [1], "meta_info": {}} x', "bytes after the top-level object"),
    (b'{"output_ids": [1], "meta_info": {},}', "invalid JSON (expected a key)"),
    (b'{"output\\u005fids": [1], "output_ids": [2], "meta_info": {}}', "duplicate key output_ids"),
    (b'{"output_ids": [1], "meta_info": {"a": "\x01"}}', "control character in a string"),
    (b'{"output_ids": [1], "meta_info": {"a": "\\x"}}', "bad escape"),
    (b'{"output_ids": [1], "meta_info": {"a": ' + b"[" * 300 + b"]" * 300 + b"}}", "nested too deep"),
    (b'\xef\xbb\xbf{"output_ids": [], "meta_info": {}}', "top level is not an object"),
])
def test_not_handled_goes_to_the_reference(text, reason):
    assert _C.scan_generate_answer(text) == reason
    check_either(text)


@pytest.mark.parametrize("text", [
    b'{"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1, 1]]}}',  # length mismatch
    b'{"output_ids": [1], "meta_info": {"a": "\xff"}}',  # invalid UTF-8 in the rest: orjson's call
    b'{"output_ids": [], "meta_info": {"output_token_logprobs": null}}',
    b'{"output_ids": [0, -0, 2147483647, -2147483648], "meta_info": {"output_token_logprobs":'
    b' [[-0, 1], [-0.0, 2, null], [0, 3, "x", 4], [-1.5e-05, 4]]}}',
])
def test_edges_match_the_reference(text):
    check_either(text)


def test_escaped_keys_are_the_same_keys():
    raw = (b'{"output\\u005fids": [5], "meta_info": {"output_token\\u005flogprobs": [[-1.0, 5]], "\\u00e9\\n": 1},'
           b' "id\\"": 2}')
    seg = native_handles(raw)
    same(seg, _parse_reference(raw, WHERE))
    assert list(seg.ids) == [5]


def test_token_texts_in_entries_are_read_natively():
    raw = ('{"output_ids": [1, 2, 3], "meta_info": {"output_token_logprobs": [[-0.5, 1, "é中"], '
           '[-0.25, 2, "\\ud83d\\ude00"], [-2, 3, "😀\\n\\"\\u0000"]]}}').encode()
    same(native_handles(raw), _parse_reference(raw, WHERE))


def test_truncated_at_every_offset_is_never_a_wrong_answer():
    raw = _orjson().dumps(sglang_answer(6, seed=9, spans=True)) + b" "
    full = _C.scan_generate_answer(raw)
    assert isinstance(full, tuple)
    for cut in range(len(raw) - 1):
        piece = raw[:cut]
        assert isinstance(_C.scan_generate_answer(piece), str)
        assert isinstance(_C.scan_generate_answer(memoryview(raw)[:cut]), str)  # a view: no byte past it
        check_either(piece)


def test_random_bytes_never_crash():
    rng = random.Random(1)
    base = _orjson().dumps(sglang_answer(4, seed=2))
    for _ in range(3000):
        b = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.choice(b'[]{}",:0-e.\\ nu1')
        check_either(bytes(b))


# ----------------------------------------------------------------------- hypothesis-generated
_WS = st.text(alphabet=" \t\n\r", max_size=3)
_TEXT = st.text(max_size=12)  # any unicode: quotes, backslashes, controls, surrogates escaped by json
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), _TEXT,
                    st.floats(allow_nan=False, allow_infinity=False, width=64))
_JUNK = st.recursive(_SCALAR, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(_TEXT, c, max_size=3)),
                     max_leaves=6)
_LOGPROB = st.one_of(st.floats(-50, 0, allow_nan=False), st.sampled_from([0, -0.0, -1.5e-05, -1e-45, -3.4e38]),
                     st.integers(-40, 0))


def _dump(obj, ws) -> str:
    """JSON with random whitespace around every token."""
    w = ws.draw(_WS)
    if isinstance(obj, dict):
        return w + "{" + ",".join(f"{ws.draw(_WS)}{json.dumps(k)}{ws.draw(_WS)}:{_dump(v, ws)}"
                                  for k, v in obj.items()) + ws.draw(_WS) + "}" + w
    if isinstance(obj, list):
        return w + "[" + ",".join(_dump(v, ws) for v in obj) + ws.draw(_WS) + "]" + w
    text = json.dumps(obj, ensure_ascii=ws.draw(st.booleans()))
    if isinstance(obj, float) and ws.draw(st.booleans()):
        text = text.replace("e-0", "E-").replace("e+", "e")
    return w + text + w


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_answers(data):
    n = data.draw(st.integers(0, 12))
    ids = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    entries = [[data.draw(_LOGPROB), t] + data.draw(st.lists(st.one_of(st.none(), _TEXT), max_size=2))
               for t in ids]
    meta = data.draw(st.dictionaries(_TEXT, _JUNK, max_size=3))
    meta.update({"output_token_logprobs": entries, "id": data.draw(_TEXT),
                 "weight_version": data.draw(st.sampled_from(["0", "7", "default", None]))})
    if data.draw(st.booleans()):
        meta["finish_reason"] = {"type": "stop", "matched": data.draw(_TEXT)}
    top = data.draw(st.dictionaries(_TEXT, _JUNK, max_size=3))
    top.update({"output_ids": ids, "meta_info": dict(data.draw(st.permutations(list(meta.items()))))})
    top = dict(data.draw(st.permutations(list(top.items()))))
    raw = _dump(top, data).encode("utf-8", "surrogatepass")
    ref = outcome(lambda r: _parse_reference(r, WHERE), raw)
    if not isinstance(ref, tuple):  # a valid answer: the scanner must read it itself
        same(native_handles(raw), ref)
    check_either(raw)
