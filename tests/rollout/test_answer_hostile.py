"""Hostile /generate answers (``areal_fast.rollout.answer``): every malformed answer is one
``AnswerError`` naming the server and rid (never a raw JSONDecodeError, KeyError, IndexError...),
the rules of the module docstring hold on both paths, and the native scanner declines every
answer the reference refuses (so the two accept exactly the same answers)."""

from __future__ import annotations

import json
import random

import pytest

from areal_fast.rollout import answer
from areal_fast.rollout.answer import AnswerError, _parse_reference, parse_generate

WHERE = "http://s0/generate (rid 'q|0|')"


def good(n: int = 3, **meta) -> dict:
    ids = [5 + i for i in range(n)]
    m = {"id": "q|0|", "finish_reason": {"type": "length"}, "weight_version": "3",
         "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)]}
    m.update(meta)
    return {"text": "", "output_ids": ids, "meta_info": m}


def raw_of(obj) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


def _scanner():
    return answer._scan


def refused_everywhere(raw: bytes, match: str, vocab: int = 0) -> None:
    """The reference and parse_generate refuse it with one AnswerError naming where, and the native
    scanner (when built with the rules) declines it."""
    for fn in (lambda: _parse_reference(raw, WHERE, vocab), lambda: parse_generate(raw, WHERE, vocab)):
        with pytest.raises(AnswerError) as e:
            fn()
        assert WHERE in str(e.value) and match in str(e.value), str(e.value)
    scan = _scanner()
    if scan is not None:
        assert isinstance(scan(raw, vocab), str) or answer._parse_native(raw, vocab) is None


L1_CASES = [
    (b'{"output_ids": [1], "meta_info": {', "not a valid /generate result"),  # JSONDecodeError
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[NaN, 1, null]]}}', "not a valid /generate result"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1e400, 1, null]]}}',
     "not a valid /generate result"),
    (raw_of({"output_ids": [1], "meta_info": []}), "meta_info is a list"),
    (raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[]]}}), "is not [logprob, id, ...]"),
    (raw_of({"output_ids": [], "meta_info": {"finish_reason": "stop"}}), "finish_reason 'stop'"),
    (raw_of(good(weight_versions=[{"end": 3, "version": "1"}])), "no integer start and end"),
    (raw_of(good(weight_versions=[{"start": "0", "end": 3}])), "no integer start and end"),
    (raw_of(good(weight_version="9" * 5000)), "weight_version"),
    (raw_of(good(weight_version=2**40)), "outside [0, 2147483647]"),
    (raw_of(good(weight_versions=[{"start": 0, "end": 3, "version": 2**40}])), "weight_versions version"),
    (raw_of({"output_ids": [2**40], "meta_info": {"output_token_logprobs": [[-1, 2**40]]}}), "OverflowError"),
    (raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1]], "id": 7}}), "meta_info.id"),
    (raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1]],
                                              "finish_reason": {"type": "stop", "matched": [1]}}}), "matched"),
    (raw_of([good()]), "answered list"),
    (b"[" * 5000 + b"]" * 5000, "not a valid /generate result"),  # RecursionError in the reference
    (b"\xef\xbb\xbf" + raw_of(good()), "not a valid /generate result"),
    (raw_of(good()).replace(b'"text": ""', b'"text": "\xff"'), "not a valid /generate result"),
]


@pytest.mark.parametrize("raw,match", L1_CASES)
def test_malformed_answers_are_one_error_naming_server_and_rid(raw, match):
    refused_everywhere(raw, match)


L2_CASES = [
    (raw_of({"output_ids": [-1], "meta_info": {"output_token_logprobs": [[-1.0, -1, None]]}}),
     "outside the vocabulary"),
    (raw_of({"output_ids": [3, 9], "meta_info": {"output_token_logprobs": [[-1.0, 3], [-1.0, 8]]}}), "differs"),
    (raw_of({"output_ids": [3], "meta_info": {"output_token_logprobs": [[0.5, 3, None]]}}), "<= 0"),
    (raw_of({"output_ids": [3], "meta_info": {"output_token_logprobs": [[1, 3, None]]}}), "<= 0"),
    (raw_of({"output_ids": [True], "meta_info": {"output_token_logprobs": [[-1.0, 1]]}}), "output_ids holds a bool"),
    (raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[False, 1]]}}), "a log-prob holds a bool"),
    (raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, True]]}}), "token id holds a bool"),
    (raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 1.0]]}}), "TypeError"),
    (b'{"output_ids": [1], "output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1]]}}', "duplicate key"),
    (b'{"output_ids": [1], "meta_info": {"id": "a", "id": "b", "output_token_logprobs": [[-1, 1]]}}',
     "duplicate key 'id'"),
    (b'{"output_ids": [1], "meta_info": {"weight_version": "1", "weight_version": "2",'
     b' "output_token_logprobs": [[-1, 1]]}}', "duplicate key 'weight_version'"),
    (b'{"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop", "type": "length"},'
     b' "output_token_logprobs": [[-1, 1]]}}', "duplicate key 'type'"),
    (b'{"x": {"a": 1, "\\u0061": 2}, "output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1]]}}',
     "duplicate key 'a'"),
    (b'{"x": {"\xc3\xa9": 1, "\\u00e9": 2}, "output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1]]}}',
     "duplicate key"),
    (b'{"x": {"\xf0\x9f\x98\x80": 1, "\\ud83d\\ude00": 2}, "output_ids": [1], "meta_info": {"output_token_logprobs":'
     b' [[-1, 1]]}}', "duplicate key"),
    (b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, {"t": 1, "t": 2}]]}}', "duplicate key"),
    # a dropped duplicate balanced by a ':' spelled as an escape: the colon count alone would miss it
    (b'{"text": "\\u003a", "output_ids": [1], "meta_info": {"id": "a", "id": "b", "output_token_logprobs":'
     b' [[-1, 1]]}}', "duplicate key 'id'"),
    (b'{"text": "a:b", "output_ids": [1], "meta_info": {"x": "1", "x": "2:", "output_token_logprobs": [[-1, 1, ":"]]}}',
     "duplicate key 'x'"),
]


@pytest.mark.parametrize("raw,match", L2_CASES)
def test_silently_accepted_answers_are_refused_on_both_paths(raw, match):
    refused_everywhere(raw, match)


def test_ids_outside_a_known_vocabulary_are_refused():
    raw = raw_of(good(3))  # ids 5, 6, 7
    assert list(parse_generate(raw, WHERE, vocab=8).ids) == [5, 6, 7]
    refused_everywhere(raw, "outside the vocabulary [0, 7)", vocab=7)


def test_distinct_keys_that_only_look_alike_are_fine():
    raw = (b'{"x": {"a": 1, "\\u0062": 2, "\xc3\xa9": 3, "\\u00e8": 4, "\\ud83d\\ude00": 5, "\\ud83d\\ude01": 6},'
           b' "output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.0, 1, "\\u00e9"]], "id": "q|0|"}}')
    seg = parse_generate(raw, WHERE)
    assert list(seg.ids) == [1] and seg.rid == "q|0|"
    if _scanner() is not None:
        assert not isinstance(_scanner()(raw), str)


def test_colons_in_texts_and_keys_are_not_duplicates():
    raw = (b'{"text": "Step 1: a:b", "output_ids": [1, 2], "meta_info": {"a:b": {"c:": ":"}, "id": "q|0|",'
           b' "output_token_logprobs": [[-1, 1, "x:"], [-2, 2, ":"]],'
           b' "finish_reason": {"type": "stop", "matched": ":"}}}')
    assert list(parse_generate(raw, WHERE).ids) == [1, 2]
    assert list(_parse_reference(raw, WHERE).ids) == [1, 2]


def test_a_tiny_positive_log_prob_that_rounds_to_zero_is_zero_on_both_paths():
    raw = raw_of({"output_ids": [1], "meta_info": {"output_token_logprobs": [[1e-50, 1]]}})
    assert list(_parse_reference(raw, WHERE).logprobs) == [0.0]
    assert list(parse_generate(raw, WHERE).logprobs) == [0.0]


def _mutations(rng: random.Random, n: int):
    """Valid answers with one rule broken (or not) at a random place."""
    for _ in range(n):
        obj = good(rng.randrange(0, 6), weight_versions=[{"start": 0, "end": 9, "version": "2"}])
        ids, entries = obj["output_ids"], obj["meta_info"]["output_token_logprobs"]
        k = rng.randrange(len(ids)) if ids else None
        op = rng.randrange(8)
        if k is not None and op == 0:
            entries[k][1] += rng.choice([-1, 1])
        elif k is not None and op == 1:
            ids[k] = entries[k][1] = -ids[k]
        elif k is not None and op == 2:
            entries[k][0] = rng.choice([1e-3, 2, 0.0, -0.0, 1e-50, -3.5e38, -3.4e38])
        elif k is not None and op == 3:
            entries[k][rng.randrange(2)] = rng.choice([True, False, None, "1", 1.0])
        elif k is not None and op == 4:
            entries[k] = entries[k][:rng.randrange(3)]
        raw = json.dumps(obj).encode()
        if op == 5:
            raw = raw.replace(b'"weight_version"', b'"weight_version": "9", "weight_version"', 1)
        elif op == 6:
            raw = raw.replace(b'"start"', b'"start": 1, "\\u0073tart"', 1)
        yield raw


def test_native_and_reference_accept_exactly_the_same_answers():
    scan = _scanner()
    if scan is None:
        pytest.skip("no native scanner with the answer rules in this build")
    for raw in _mutations(random.Random(7), 3000):
        try:
            ref = _parse_reference(raw, WHERE)
        except AnswerError:
            assert isinstance(scan(raw), str) or answer._parse_native(raw) is None, raw
            continue
        nat = answer._parse_native(raw)
        assert nat is not None, (raw, scan(raw))
        assert nat.ids == ref.ids and nat.logprobs.tobytes() == ref.logprobs.tobytes() and nat.versions == ref.versions
