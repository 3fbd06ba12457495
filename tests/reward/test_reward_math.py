"""Math reward: equivalence table (math-verify + the plain-number fast path), extraction, errors."""

import pytest

from areal_fast.reward.math import fast_numeric_equal, last_boxed, math_equal, math_reward
from areal_fast.reward.result import RewardResult

B = lambda s: "The final answer is $\\boxed{" + s + "}$."
EQUIVALENT = [
    (B("\\frac{3}{4}"), "3/4"),
    (B("0.75"), "\\frac{3}{4}"),
    (B("\\dfrac{3}{4}"), "0.75"),
    (B("\\frac{1}{\\frac{2}{3}}"), "\\frac{3}{2}"),            # nested fraction
    (B("\\frac{\\frac{1}{2}}{\\frac{3}{4}}"), "\\frac{2}{3}"),   # nested fraction
    (B("\\frac{1}{1+\\frac{1}{2}}"), "2/3"),                    # continued fraction
    (B("42"), "42"),
    (B("-7"), "-7"),
    (B("1,000"), "1000"),
    (B("5\\text{ cm}"), "5"),                                   # units
    (B("5 \\mathrm{m}"), "5"),
    (B("90^\\circ"), "90"),
    (B("12\\text{ dollars}"), "12"),
    (B("10\\%"), "0.1"),
    (B("[1,2)"), "[1,2)"),                                      # intervals
    (B("(-\\infty, 2]"), "(-\\infty,2]"),
    (B("(0, \\infty)"), "(0,\\infty)"),
    (B("\\{1,2\\}"), "\\{2,1\\}"),
    (B("x^2+2x+1"), "(x+1)^2"),
    (B("\\sqrt{2}/2"), "\\frac{1}{\\sqrt2}"),
    (B("2\\sqrt{2}"), "\\sqrt{8}"),
    (B("x=3"), "3"),
    (B("\\pi"), "\\pi"),
    (B("2\\pi"), "\\pi \\cdot 2"),
    (B("\\infty"), "\\infty"),
    (B("(1, 2)"), "(1,2)"),
    ("So the answer is 17.", "17"),                              # no box
    (B("0.5"), "1/2"),
    (B("\\frac12"), "0.5"),
    (B("3.0"), "3"),
    (B("\\frac{6}{8}"), "3/4"),
    (B("\\frac{3}{4}"), "\\boxed{\\frac{6}{8}}"),
]
NOT_EQUIVALENT = [
    (B("\\frac{4}{3}"), "3/4"),
    (B("0.76"), "\\frac{3}{4}"),
    (B("\\frac{1}{\\frac{3}{2}}"), "\\frac{3}{2}"),             # nested fraction, inverted
    (B("(1,2)"), "[1,2]"),                                      # open vs closed interval
    (B("[1,2]"), "[1,2)"),
    (B("(-\\infty, 2)"), "(-\\infty,2]"),
    (B("43"), "42"),
    (B("-42"), "42"),
    (B("x^2+1"), "(x+1)^2"),
    (B("\\sqrt{3}"), "\\sqrt{2}"),
    (B("\\{1,3\\}"), "\\{1,2\\}"),
    (B("6\\text{ cm}"), "5"),
    (B("2\\pi"), "\\pi"),
    ("I don't know.", "42"),
    (B(""), "3"),                                               # empty box
    ("$$\\frac{", "3"),                                         # malformed LaTeX
    (B("\\frac{3}{4"), "3/4"),                                  # unbalanced brace
    ("\\boxed{\\frac{3}{4}", "1/2"),                            # unclosed box
    (B("\\sqrt{}"), "2"),
    (B("\\left( 1, 2"), "(1,2)"),                               # malformed delimiters
    (B("}{}{\\\\"), "1"),
    (B("0.333"), "1/3"),
    (B("1e100"), "1"),
]


def test_table_is_big_enough():
    assert len(EQUIVALENT) + len(NOT_EQUIVALENT) >= 40


@pytest.mark.parametrize("pred,gold", EQUIVALENT)
def test_equivalent(pred, gold):
    assert math_equal(pred, gold), (pred, gold)


@pytest.mark.parametrize("pred,gold", NOT_EQUIVALENT)
def test_not_equivalent(pred, gold):
    assert not math_equal(pred, gold), (pred, gold)


# where math-verify and the exact comparison of plain numbers part ways (its 6-digit rounding; it reads
# the e of 4e-7 as Euler's number)
EXACT_ONLY = {(B("0.3333333"), "0.333333"), (B("4e-7"), "0.0000004")}

# (prediction, gold, what the fast path must say: True/False, or None = defer to math-verify)
FAST_CASES = [
    (B("42"), "42", True),
    (B("42.0"), "42", True),
    (B("3/4"), "0.75", True),
    (B("43"), "42", False),
    (B("-3"), "3", False),
    (B("0.3333333"), "0.333333", False),  # plain numbers are decided exactly (math-verify rounds to 6 digits)
    (B("4e-7"), "0.0000004", True),
    (B("1,000"), "1000", None),  # not a plain number: math-verify
    (B("\\frac{3}{4}"), "0.75", None),
    ("no box 42", "42", None),
    (B("1") + B("2"), "2", None),  # several boxes: math-verify (it accepts any)
    (B("5"), "x+1", None),  # gold not a number
]


@pytest.mark.parametrize("pred,gold,expected", FAST_CASES)
def test_fast_path(pred, gold, expected):
    assert fast_numeric_equal(pred, gold) is expected


@pytest.mark.parametrize("pred,gold,_", [c for c in FAST_CASES if c[2] is not None and c[:2] not in EXACT_ONLY])
def test_fast_path_agrees_with_math_verify(pred, gold, _, monkeypatch):
    fast = math_equal(pred, gold)
    monkeypatch.setattr("areal_fast.reward.math.fast_numeric_equal", lambda p, g: None)
    assert math_equal(pred, gold) == fast


def test_last_boxed_nested_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\fbox{x^{2}} c \\boxed{oops") == ["\\frac{1}{2}", "x^{2}"]


def test_math_reward_result_and_errors():
    r = math_reward({"answer": "3/4"}, B("\\frac{3}{4}"))
    assert isinstance(r, RewardResult) and (r.value, r.status) == (1.0, "ok")
    r = math_reward({"answer": 7}, B("8"))  # a non-string answer is accepted
    assert (r.value, r.status) == (0.0, "ok")
    with pytest.raises(KeyError, match="answer"):
        math_reward({"gold": "1"}, B("1"))


def test_malformed_inputs_never_raise():
    for junk in ["\\", "{{{{", "\\boxed{\\frac{", "$" * 50, "\\begin{matrix", "\\sqrt[", "\x00\xff", "9" * 5000]:
        assert math_equal(junk, "1") is False
        assert math_equal(B("1"), junk) is False


# ------------------------------------------------------------------ plain numbers: exact
PLAIN_EXACT = [  # (prediction, gold, equal): decided exactly, never math-verify's 6-digit rounding
    (B("-0.0000004"), "0.0000004", False),
    (B("-0.0000004"), "4e-7", False),
    (B("0.0000002"), "0.0000001", False),
    (B("2e-7"), "1e-7", False),
    ("The answer is 0.0000002", "0.0000001", False),  # no box: math-verify's extracted answer, compared exactly
    (B("0.0000002\\text{ m}"), "0.0000001", False),   # units: the same
    (B("0.0000001\\text{ m}"), "1e-7", True),
    (B("4e-7"), "0.0000004", True),
    (B("4E-07"), "$4e-7$", True),
    (B("1/10000000"), "1e-7", True),
    (B("-3/4"), "-0.75", True),
    (B("0.3333333"), "0.333333", False),
    (B("1e100"), "1e100", True),
    (B("1e100"), "1", False),
    (B(".5"), "1/2", True),
    (B("\\frac{4}{10000000}"), "4e-7", True),  # not plain: math-verify, given the gold as an exact fraction
    (B("4\\times 10^{-7}"), "4e-7", True),
]


@pytest.mark.parametrize("pred,gold,equal", PLAIN_EXACT)
def test_plain_numbers_are_compared_exactly(pred, gold, equal):
    assert math_equal(pred, gold) is equal


def test_huge_exponents_and_digits_are_not_computed():
    # a plain-number exponent is bounded (10**10**9 would not finish), over-long digits go to math-verify
    assert fast_numeric_equal(B("1e999999999"), "1") is None
    assert math_equal(B("1e999999999"), "1") is False
    assert fast_numeric_equal(B("9" * 5000), "1") is None
    assert math_equal(B("\\frac{1}{2}"), "1e9999") is False  # a gold too long to write out: math-verify as is
    assert math_equal(B("1e9999"), "1e9999") is True


# ------------------------------------------------------------------ \\boxed extraction: one pass
def _reference_last_boxed(text):  # what last_boxed computed (one scan per box): the reference on small inputs
    import re

    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def test_last_boxed_matches_the_scan_it_replaced():
    import random

    rng = random.Random(5)
    atoms = ["\\boxed{", "\\fbox {", "\\boxed", "{", "}", "}", "x", "1", " ", "\\{"]
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        assert last_boxed(text) == _reference_last_boxed(text), text


@pytest.mark.timeout(5)
def test_unclosed_and_nested_boxes_are_scanned_in_one_pass():
    # 8,000 unclosed boxes took 65 s (each scanned to the end of the text)
    assert last_boxed("\\boxed{" * 8000) == []
    assert fast_numeric_equal("\\boxed{" * 8000 + "1}", "1") is True
    assert last_boxed("\\boxed{1} " + "\\fbox{" * 50_000 + "x") == ["1"]
    # 8,000 nested closed boxes: the fast path looks at the box count, never copies each box's text
    assert fast_numeric_equal("\\boxed{" * 8000 + "1" + "}" * 8000, "1") is None
