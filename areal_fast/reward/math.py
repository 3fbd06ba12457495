"""Math answer reward: extract the final answer of a completion and compare it with the gold one.

Equivalence is `math-verify` (LaTeX/expression parsing into sympy: boxed answers, fractions,
sets, intervals, units and percentages normalised). It costs ~1-20 ms per pair and sympy can
blow up on adversarial input, so:
  * plain numbers are decided exactly, without math-verify's 6-digit rounding (which accepted
    -4e-7 for 4e-7 and 2e-7 for 1e-7): a plain number is an integer, a decimal, either in
    scientific notation (``42``, ``-0.5``, ``.5``, ``4e-7``, ``1.5E+3``; an exponent of at most 4
    digits) or a simple fraction of integers (``3/4``, ``-3/4``), optionally between ``$``. When
    the gold answer is one, the completion's answer is compared with it as an exact fraction
    (equal or not, no tolerance: both are exact values as written) whenever that answer is a
    plain number too: first (~5 us, no sympy) when the completion has exactly one
    ``\\boxed{...}`` holding one, else when the answer math-verify extracts (a number in the
    text, a box with units) is one. Anything else (``\\frac{3}{4}``, ``1,000``, ``10\\%``,
    expressions, several boxes) is math-verify's; a plain gold in scientific notation is given
    to it as an exact fraction (it would read the ``e`` of ``4e-7`` as Euler's number).
  * boxes are found in one pass over the text, linear in its length.
  * math-verify's own parse and verify time limits (signal based, main thread only) are set
    from ``time_limit_s``; the reward service additionally kills the worker if a call runs past
    its per-call timeout.
Malformed LaTeX never raises: it parses to nothing and scores 0.

Task keys: ``answer`` (required, str or number), ``time_limit_s`` (optional, default 5).
"""

from __future__ import annotations

import functools
import re
import threading
from fractions import Fraction

from .result import RewardResult

DEFAULT_TIME_LIMIT_S = 5
_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?", re.ASCII)
_SIMPLE_FRACTION = re.compile(r"[-+]?\d+\s*/\s*\d+", re.ASCII)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def plain_number(text: str) -> Fraction | None:
    """The exact value of ``text`` when it is a plain number (see the module docstring), else None
    (also for a number of more digits than Python converts, 4300)."""
    text = text.strip().strip("$").strip()
    if not (_DECIMAL.fullmatch(text) or _SIMPLE_FRACTION.fullmatch(text)):
        return None
    try:
        return Fraction(text.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """Where the contents of every ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces lie in
    ``text`` (start, end), in order of the boxes. One pass over the braces, whatever the nesting
    or the number of boxes never closed."""
    openers = {m.end() - 1 for m in _BOX.finditer(text)}  # the position of each box's own brace
    if not openers:
        return []
    found = []
    stack: list[int] = []
    for m in _BRACE.finditer(text, min(openers)):
        i = m.start()
        if text[i] == "{":
            stack.append(i)
        elif stack:
            o = stack.pop()
            if o in openers:
                found.append((o + 1, i))
    found.sort()
    return found


def last_boxed(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, in order."""
    return [text[a:b] for a, b in boxed_spans(text)]


def fast_numeric_equal(pred: str, gold: str) -> bool | None:
    """Exact answer when the gold answer and the completion's only box are plain numbers, or None
    when it is left to math-verify (and its extracted answer)."""
    g = plain_number(gold)
    if g is None:
        return None
    spans = boxed_spans(pred)
    if len(spans) != 1:
        return None
    p = plain_number(pred[spans[0][0]:spans[0][1]])
    if p is None:
        return None
    return p == g


def _gold_text(gold: str) -> str:
    gold = gold.strip()
    g = plain_number(gold)
    if g is not None and ("e" in gold or "E" in gold):  # math-verify reads that e as Euler's number
        try:
            return f"${g.numerator}$" if g.denominator == 1 else f"$\\frac{{{g.numerator}}}{{{g.denominator}}}$"
        except ValueError:  # more digits than Python writes out (4300): math-verify gets it as written
            pass
    if "\\boxed" in gold or gold.startswith("$"):
        return gold
    return f"${gold}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, limit: int | None) -> tuple:
    # GRPO scores 8-16 samples per prompt against the same gold answer and parsing it is about
    # half the cost of a math-verify call (6-12 ms of ~15 ms here), so each worker caches it.
    from math_verify import parse

    return tuple(parse(_gold_text(gold), parsing_timeout=limit))


def math_equal(pred: str, gold: str, *, time_limit_s: int = DEFAULT_TIME_LIMIT_S) -> bool:
    """Is the final answer in ``pred`` (a completion) equivalent to ``gold`` (an answer)?"""
    fast = fast_numeric_equal(pred, gold)
    if fast is not None:
        return fast
    from math_verify import parse, verify  # heavy (sympy, ~1 s): imported on first use

    # math-verify's time limits use SIGALRM, which only the main thread may set
    limit = time_limit_s if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = list(_parse_gold(gold, limit))
        if not gold_parsed:
            return False
        pred_parsed = parse(pred, parsing_timeout=limit)
        if not pred_parsed:
            return False
        g = plain_number(gold)
        if g is not None and isinstance(pred_parsed[-1], str):  # the answer as math-verify extracted it
            p = plain_number(pred_parsed[-1])
            if p is not None:
                return p == g  # plain numbers both: exact, never math-verify's 6-digit rounding
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=limit))
    except Exception:  # math-verify swallows most errors itself; sympy can still raise
        return False


def math_reward(task: dict, completion: str) -> RewardResult:
    """1.0 when the completion's final answer matches ``task["answer"]``, else 0.0."""
    if "answer" not in task:
        raise KeyError(f"math reward: task has no 'answer' key (keys: {sorted(task)})")
    gold = task["answer"]
    if not isinstance(gold, str):
        gold = str(gold)
    limit = int(task.get("time_limit_s", DEFAULT_TIME_LIMIT_S))
    ok = math_equal(completion, gold, time_limit_s=limit)
    return RewardResult(1.0 if ok else 0.0, "ok", "correct" if ok else "wrong answer")
