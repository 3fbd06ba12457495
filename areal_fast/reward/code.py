"""Code reward: run the completion's program against test cases in the sandbox (`sandbox.py`).

Task keys::

    {"reward": "code",
     # stdin/stdout style: one sandboxed run per test, output compared line by line
     "tests": [{"input": "1 2\\n", "output": "3\\n"}, ...],
     # or function-call style: all tests in one sandboxed run of a small harness
     "fn_name": "add", "tests": [{"args": [1, 2], "kwargs": {}, "expected": 3}, ...],
     "time_limit_s": 2.0,     # per test (function-call style: per test, summed for the run)
     "memory_mb": 1024,       # address-space limit of the program
     "partial": False}        # True: value = fraction of tests passed instead of all-or-nothing

The program is the last fenced code block of the completion (```python ... ```), or the whole
completion when it has none. Function-call style also finds ``Solution().fn_name`` (LeetCode).
Outcomes: all tests pass -> (1, ok); a wrong answer -> (0, ok); a crash, a resource limit or
too much output -> (0, error); too slow -> (0, timeout). Tests stop at the first failure unless
``partial``.

The harness runs in the same process as the solution and marks its result line with a random
nonce, which stops accidental output mixing; it is not a defence against a program that
deliberately inspects the harness's frames (run stdin/stdout tests for that).
"""

from __future__ import annotations

import json
import math
import re
import secrets

from .result import RewardResult
from .sandbox import SandboxLimits, SandboxResult, run_sandboxed

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MEMORY_MB = 1024
_FLOAT_REL_TOL = 1e-6  # outputs like 0.3333333 vs 0.333333333 are accepted (judges use 1e-6)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_STDERR_TAIL = 400

_HARNESS = r'''
import json, math, os, sys
spec = json.loads(sys.stdin.read())
out = os.fdopen(os.dup(1), "w")
sys.stdout = open(os.devnull, "w")
def eq(a, b):
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=spec["tol"], abs_tol=spec["tol"])
        except (TypeError, ValueError):
            return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
    return a == b
def report(**kw):
    out.write(spec["nonce"] + json.dumps(kw) + "\n"); out.flush()
ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as e:
    report(test=-1, ok=False, error="%s: %s" % (type(e).__name__, e)); sys.exit(0)
fn = ns.get(spec["fn"])
if fn is None and isinstance(ns.get("Solution"), type):
    fn = getattr(ns["Solution"](), spec["fn"], None)
if not callable(fn):
    report(test=-1, ok=False, error="no function %r defined" % spec["fn"]); sys.exit(0)
for i, t in enumerate(spec["tests"]):
    try:
        got = fn(*t.get("args", []), **t.get("kwargs", {}))
        try:
            got = json.loads(json.dumps(got))
        except (TypeError, ValueError):
            pass
        ok = eq(got, t["expected"])
        report(test=i, ok=ok, got=repr(got)[:200])
    except BaseException as e:
        report(test=i, ok=False, error="%s: %s" % (type(e).__name__, e))
        ok = False
    if not ok and not spec["partial"]:
        break
'''


def extract_code(completion: str) -> str:
    """The last fenced code block (preferring python-tagged ones), else the whole completion."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "")]
    return (py or [b for _, b in blocks])[-1]


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _token_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=_FLOAT_REL_TOL, abs_tol=_FLOAT_REL_TOL)
    except ValueError:
        return False


def outputs_match(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace ignored; tokens equal or floats within 1e-6."""
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
    tail = run.stderr.decode("utf-8", "replace")[-_STDERR_TAIL:]
    if run.status == "timeout" or run.returncode in (-24, 128 + 24):  # SIGXCPU: CPU rlimit
        return RewardResult(0.0, "timeout", f"time limit exceeded {where}")
    if run.status == "output_limit":
        return RewardResult(0.0, "error", f"output limit exceeded {where}")
    kind = "memory limit" if "MemoryError" in tail else "runtime error"
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
        if run.ok and outputs_match(run.stdout.decode("utf-8", "replace"), str(t["output"])):
            passed += 1
            continue
        bad = _failure(run, f"on test {i}") if not run.ok else RewardResult(0.0, "ok", f"wrong answer on test {i}")
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


def _function_call(task: dict, code: str, tests: list[dict]) -> RewardResult:
    nonce = "@@" + secrets.token_hex(16) + "@@"
    partial = bool(task.get("partial", False))
    spec = {"fn": task["fn_name"], "tests": tests, "nonce": nonce, "partial": partial, "tol": _FLOAT_REL_TOL}
    run = run_sandboxed(["python", "-I", "harness.py"], stdin=json.dumps(spec).encode(),
                        files={"solution.py": code, "harness.py": _HARNESS}, limits=_limits(task, len(tests)))
    reports = []
    for line in run.stdout.decode("utf-8", "replace").splitlines():
        if line.startswith(nonce):
            reports.append(json.loads(line[len(nonce):]))
    passed = sum(1 for r in reports if r["ok"])
    first = next((r for r in reports if not r["ok"]), None)
    if first is not None and first["test"] == -1:
        return RewardResult(0.0, "error", f"runtime error loading solution: {first['error']}")
    if not run.ok and passed < len(tests):
        return _failure(run, f"after {len(reports)} of {len(tests)} tests")
    if first is None and passed < len(tests):  # e.g. os._exit() inside the function
        return RewardResult(0.0, "error", f"program ended after {len(reports)} of {len(tests)} tests "
                                          f"(exit {run.returncode})")
    bad = None
    if first is not None:
        if "error" in first:
            bad = RewardResult(0.0, "error", f"runtime error on test {first['test']}: {first['error']}")
        else:
            bad = RewardResult(0.0, "ok", f"wrong answer on test {first['test']}: got {first['got']}")
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
