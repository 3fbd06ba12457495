"""Code reward: run the completion's program against test cases in the sandbox (`sandbox.py`).

Task keys::

    {"reward": "code",
     # stdin/stdout style: one sandboxed run per test, output compared line by line
     "tests": [{"input": "1 2\\n", "output": "3\\n"}, ...],
     # or function-call style: all tests in one sandboxed run of a small harness
     "fn_name": "add", "tests": [{"args": [1, 2], "kwargs": {}, "expected": 3}, ...],
     "time_limit_s": 2.0,     # per test (function-call style: per test, summed for the run)
     "memory_mb": 1024,       # memory of the whole run, all its processes together
     "partial": False}        # True: value = fraction of tests passed instead of all-or-nothing

The program is the last fenced code block of the completion (```python ... ```), or the whole
completion when it has none. Function-call style also finds ``Solution().fn_name`` (LeetCode).
Outcomes: all tests pass -> (1, ok); a wrong answer -> (0, ok); a crash, a resource limit or
too much output -> (0, error); too slow -> (0, timeout). Tests stop at the first failure unless
``partial``.

Function-call style: a small harness in the sandbox imports the solution, calls the function on
each test's arguments and writes back what it returned, serialised as JSON; the comparison with
the expected values happens here, outside the sandbox, and the expected values never enter it.
The harness shares its process with the solution, so the solution can reach everything the
harness holds (its frames, the result fd, ``json.dumps``, builtins): that is why the harness
decides nothing. The most a solution can do through the harness is claim return values, which
it could as well return; a return value that is not plain JSON data (an object whose ``__eq__``
always says True) is a failure; a result stream that is not exactly one record per test, in
order, is refused as tampered.
"""

from __future__ import annotations

import decimal
import json
import math
import re
import secrets

from .result import RewardResult, escape_controls
from .sandbox import SandboxLimits, SandboxResult, run_sandboxed

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MEMORY_MB = 1024
_FLOAT_REL_TOL = 1e-6  # outputs like 0.3333333 vs 0.333333333 are accepted (judges use 1e-6)
# Numbers in program output: plain ASCII decimals only. float() and Decimal() also read "1_000", "inf",
# "nan" and non-ASCII digits, none of which a judge takes for a number.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)  # one way to match each text: linear
_INTEGER = re.compile(r"[+-]?\d+", re.ASCII)
_FENCE_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_STDERR_TAIL = 400

_HARNESS = r'''
import json, os, sys
spec = json.loads(sys.stdin.read())
out = os.fdopen(os.dup(1), "w")
sys.stdout = open(os.devnull, "w")
def report(**kw):
    out.write(spec["nonce"] + json.dumps(kw) + "\n"); out.flush()
ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as e:
    report(test=-1, error="%s: %s" % (type(e).__name__, e)); sys.exit(0)
fn = ns.get(spec["fn"])
if fn is None and isinstance(ns.get("Solution"), type):
    fn = getattr(ns["Solution"](), spec["fn"], None)
if not callable(fn):
    report(test=-1, error="no function %r defined" % spec["fn"]); sys.exit(0)
for i, t in enumerate(spec["tests"]):
    try:
        got = fn(*t["args"], **t["kwargs"])
    except BaseException as e:
        report(test=i, error="%s: %s" % (type(e).__name__, e))
        continue
    try:
        report(test=i, value=json.loads(json.dumps(got)))
    except (TypeError, ValueError, RecursionError) as e:
        report(test=i, error="returned %s, not JSON data (%s)" % (type(got).__name__, e))
'''


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of ``text``, (language tag, body), in order: a fence ```` ``` ````, the
    tag after optional spaces (letters, digits, ``_+-``; the rest of the line ignored), the body up
    to the next fence. One scan with ``str.find``, linear in ``len(text)`` (the regex it replaces,
    ```` ```[ \\t]*([A-Za-z0-9_+-]*)[^\\n]*\\n(.*?)``` ````, went over a line once per fence on it)."""
    out = []
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return out
        nl = text.find("\n", start + 3)
        if nl < 0:
            return out  # a fence needs its line's end: no later fence has one either
        close = text.find("```", nl + 1)
        if close < 0:
            return out  # nor a body's end
        lang = _FENCE_LANG.match(text, start + 3, nl).group(1)
        out.append((lang, text[nl + 1:close]))
        pos = close + 3


def extract_code(completion: str) -> str:
    """The last fenced code block (preferring python-tagged ones), else the whole completion."""
    blocks = fenced_blocks(completion)
    if not blocks:
        return completion
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "")]
    return (py or [b for _, b in blocks])[-1]


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _token_equal(got: str, expected: str) -> bool:
    """Same text; or both numbers and: an expected integer equal exactly (as decimals: 5, +5, 05,
    5.0, 5e0 are 5; 1000000000 is not 1000000007), an expected float within 1e-6 (relative or absolute)."""
    if got == expected:
        return True
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return False
    if _INTEGER.fullmatch(expected):
        try:
            return decimal.Decimal(got) == decimal.Decimal(expected)  # exact, any length
        except decimal.InvalidOperation:  # an exponent beyond Decimal's range
            return False
    return math.isclose(float(got), float(expected), rel_tol=_FLOAT_REL_TOL, abs_tol=_FLOAT_REL_TOL)


def outputs_match(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace ignored; tokens equal, integers exactly, floats within 1e-6."""
    g, e = _lines(got), _lines(expected)
    if g == e:
        return True
    if len(g) != len(e):
        return False
    for gl, el in zip(g, e):
        gt, et = gl.split(), el.split()
        if len(gt) != len(et) or not all(_token_equal(x, y) for x, y in zip(gt, et)):
            return False
    return True


def _failure(run: SandboxResult, where: str) -> RewardResult:
    """Map a sandbox run that did not finish cleanly to a (0, timeout|error) result."""
    tail = escape_controls(run.stderr.decode("utf-8", "replace")[-_STDERR_TAIL:])  # the program's text
    if run.memory_exceeded:  # the run's processes together went over the cap: one of them was killed
        return RewardResult(0.0, "error", f"memory limit exceeded {where} (the run's processes together)")
    if run.status == "timeout" or run.returncode in (-24, 128 + 24):  # SIGXCPU: CPU rlimit
        return RewardResult(0.0, "timeout", f"time limit exceeded {where}")
    if run.status == "output_limit":
        return RewardResult(0.0, "error", f"output limit exceeded {where}")
    kind = "memory limit" if run.memory_exceeded or "MemoryError" in tail else "runtime error"
    return RewardResult(0.0, "error", f"{kind} {where} (exit {run.returncode}): {tail}")


def _limits(task: dict, n_runs_in_one: int = 1) -> SandboxLimits:
    t = float(task.get("time_limit_s", DEFAULT_TIME_LIMIT_S))
    mem = int(task.get("memory_mb", DEFAULT_MEMORY_MB)) << 20
    return SandboxLimits(timeout_s=t * n_runs_in_one, memory_bytes=mem)


def _stdio(task: dict, code: str, tests: list[dict]) -> RewardResult:
    limits = _limits(task)
    partial = bool(task.get("partial", False))
    passed = 0
    first_bad: RewardResult | None = None
    for i, t in enumerate(tests):
        if "input" not in t or "output" not in t:
            raise ValueError(f"code reward: test {i} needs 'input' and 'output' keys, got {sorted(t)}")
        run = run_sandboxed(["python", "-I", "solution.py"], stdin=str(t["input"]).encode(),
                            files={"solution.py": code}, limits=limits)
        clean = run.ok and not run.memory_exceeded
        if clean and outputs_match(run.stdout.decode("utf-8", "replace"), str(t["output"])):
            passed += 1
            continue
        bad = _failure(run, f"on test {i}") if not clean else RewardResult(0.0, "ok", f"wrong answer on test {i}")
        first_bad = first_bad or bad
        if not partial:
            return bad
    return _summary(passed, len(tests), partial, first_bad)


def _summary(passed: int, n: int, partial: bool, first_bad: RewardResult | None) -> RewardResult:
    if passed == n:
        return RewardResult(1.0, "ok", f"passed {n}/{n}")
    if partial and first_bad is not None and first_bad.status == "ok":
        return RewardResult(passed / n, "ok", f"passed {passed}/{n}; first failure: {first_bad.detail}")
    return first_bad or RewardResult(0.0, "ok", f"passed {passed}/{n}")


def values_equal(got: object, expected: object) -> bool:
    """JSON values equal, anywhere inside: an expected float within 1e-6, an expected integer exactly
    (a float return value too: 3.0 is 3, 1000000000.0 is not 1000000007); lists and tuples alike."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, float) or isinstance(expected, float):
        if not isinstance(got, (int, float)) or not isinstance(expected, (int, float)):
            return False
        if not isinstance(expected, float):
            return got == expected  # Python compares int and float exactly
        return math.isclose(got, expected, rel_tol=_FLOAT_REL_TOL, abs_tol=_FLOAT_REL_TOL)
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and got == expected


class _Tampered(ValueError):
    pass


def _read_reports(stdout: bytes, nonce: str, n_tests: int) -> list[dict]:
    """The harness's records, checked: test -1 alone, or tests 0, 1, ... once each, in order."""
    reports = []
    for line in stdout.decode("utf-8", "replace").splitlines():
        if not line.startswith(nonce):
            continue
        try:
            rec = json.loads(line[len(nonce):])
        except ValueError as e:
            raise _Tampered(f"unreadable result record: {e}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("test"), int) or ("value" in rec) == ("error" in rec):
            raise _Tampered(f"malformed result record {line[len(nonce):][:100]!r}")
        reports.append(rec)
    expected_ids = [-1] if reports and reports[0]["test"] == -1 else list(range(len(reports)))
    if [r["test"] for r in reports] != expected_ids or len(reports) > n_tests:
        raise _Tampered(f"result records for tests {[r['test'] for r in reports][:20]}")
    return reports


def _function_call(task: dict, code: str, tests: list[dict]) -> RewardResult:
    nonce = "@@" + secrets.token_hex(16) + "@@"
    partial = bool(task.get("partial", False))
    calls = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or "expected" not in t:
            raise ValueError(f"code reward: function-call test {i} needs an 'expected' key, got {t!r:.100}")
        args, kwargs = t.get("args", []), t.get("kwargs", {})
        if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
            raise ValueError(f"code reward: function-call test {i}: 'args' must be a list and 'kwargs' a dict, "
                             f"got {type(args).__name__} and {type(kwargs).__name__}")
        calls.append({"args": list(args), "kwargs": kwargs})
    # the sandbox gets the arguments only: what is expected stays here
    spec = {"fn": task["fn_name"], "tests": calls, "nonce": nonce}
    run = run_sandboxed(["python", "-I", "harness.py"], stdin=json.dumps(spec).encode(),
                        files={"solution.py": code, "harness.py": _HARNESS}, limits=_limits(task, len(tests)))
    try:
        reports = _read_reports(run.stdout, nonce, len(tests))
    except _Tampered as e:
        return RewardResult(0.0, "error", f"the solution tampered with the test harness: {e}")
    if reports and reports[0]["test"] == -1:
        return RewardResult(0.0, "error", f"runtime error loading solution: {escape_controls(reports[0]['error'])}")
    if run.memory_exceeded:
        return _failure(run, f"after {len(reports)} of {len(tests)} tests")
    passed = 0
    bad = None
    for r in reports:
        i = r["test"]
        if "error" in r:
            res = RewardResult(0.0, "error", f"runtime error on test {i}: {escape_controls(r['error'])}")
        elif values_equal(r["value"], tests[i]["expected"]):
            passed += 1
            continue
        else:
            res = RewardResult(0.0, "ok", f"wrong answer on test {i}: got {json.dumps(r['value'])[:200]}")
        bad = bad or res
        if not partial:
            return res
    if len(reports) < len(tests):
        where = f"after {len(reports)} of {len(tests)} tests"
        if not run.ok:
            res = _failure(run, where)
        else:  # e.g. os._exit() inside the function
            res = RewardResult(0.0, "error", f"program ended {where} (exit {run.returncode})")
        if not partial:
            return res
        bad = bad or res
    return _summary(passed, len(tests), partial, bad)


def code_reward(task: dict, completion: str) -> RewardResult:
    """Score a program against ``task["tests"]``; see the module docstring for the task format."""
    tests = task.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code reward: task needs a non-empty 'tests' list, got {type(tests).__name__}")
    code = extract_code(completion)
    if task.get("fn_name"):
        return _function_call(task, code, tests)
    return _stdio(task, code, tests)
