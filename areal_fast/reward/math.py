"""Math answer reward: extract the final answer of a completion and compare it with the gold one.

Equivalence is `math-verify` (LaTeX/expression parsing into sympy: boxed answers, fractions,
sets, intervals, units and percentages normalised). It costs ~1-20 ms per pair and sympy can
blow up on adversarial input, so:
  * plain numbers take a fast path (~5 us): when the gold answer is a plain number (``42``,
    ``-0.5``, ``3/4``) and the completion has exactly one ``\\boxed{...}`` holding a plain
    number, they are compared as exact fractions. Equal -> 1. Far apart -> 0. Close but not
    equal (math-verify rounds to 6 digits) -> math-verify decides, so the fast path never
    disagrees with it.
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
_NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)(\s*/\s*\d+)?\s*$")
_CLOSE_REL = 1e-4  # numbers this close may still be equal after math-verify's 6-digit rounding


def _as_fraction(text: str) -> Fraction | None:
    text = text.strip().strip("$").strip()
    if not _NUMBER.match(text):
        return None
    try:
        return Fraction(text.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def last_boxed(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, in order."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def fast_numeric_equal(pred: str, gold: str) -> bool | None:
    """Exact answer for plain numbers, or None when math-verify must decide."""
    g = _as_fraction(gold)
    if g is None:
        return None
    boxed = last_boxed(pred)
    if len(boxed) != 1:
        return None
    p = _as_fraction(boxed[0])
    if p is None:
        return None
    if p == g:
        return True
    if abs(p - g) <= _CLOSE_REL * max(1, abs(g)):
        return None
    return False


def _gold_text(gold: str) -> str:
    gold = gold.strip()
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
