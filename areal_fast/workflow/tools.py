"""Tools a workflow can call through ``engine.tool(name, call)``.

A tool is a plain function ``fn(fields: dict, call: str) -> RewardResult`` (its text in
``detail``), importable by name. It runs in a worker process of the reward service, so a tool
that hangs is killed at its time limit and one that crashes takes down only its worker: the
episode gets a ToolResult with status 'timeout' or 'error' and the controller goes on. A tool
that runs code the model wrote must not run it in the worker either: :func:`python` hands it to
the reward sandbox (resource limits, no network, a fresh temporary directory).

This module is imported by the reward workers: keep it free of torch and the config tree.
"""

from __future__ import annotations

import ast
import operator

from areal_fast.reward.result import RewardResult

CALCULATOR = "areal_fast.workflow.tools:calculator"
PYTHON = "areal_fast.workflow.tools:python"
_MAX_ABS = 10**12  # keeps every intermediate result small: 9**9**9 would run for minutes
_MAX_EXPR_CHARS = 200

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (b < 0 or b > 64 or abs(a) > 2**20):
            raise ValueError("exponent out of range")
        out = _BINOPS[type(node.op)](a, b)
        if abs(out) > _MAX_ABS:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expr: str) -> int:
    """Integer arithmetic (+ - * // % ** and parentheses) without executing anything: the
    expression is parsed and each node evaluated here. ValueError/ZeroDivisionError on bad input."""
    if len(expr) > _MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    return _eval(tree.body)


def calculator(fields: dict, call: str) -> RewardResult:
    """Tool: evaluate the integer expression ``call``; the result's text is the number."""
    try:
        return RewardResult(1.0, "ok", str(calculate(call)))
    except (ValueError, ZeroDivisionError) as e:
        return RewardResult(0.0, "error", f"calculator: {e}")


def python(fields: dict, call: str) -> RewardResult:
    """Tool: run the Python program ``call`` in the reward sandbox; the result's text is its
    standard output (stderr's tail when it fails). ``fields['timeout_s']`` bounds the program."""
    from areal_fast.reward.sandbox import SandboxLimits, run_sandboxed

    limit = max(0.5, float(fields.get("timeout_s", 10.0)) * 0.8)  # leave the worker time to answer
    run = run_sandboxed(["python", "main.py"], files={"main.py": call},
                        limits=SandboxLimits(timeout_s=limit, memory_bytes=512 << 20))
    if run.ok:
        return RewardResult(1.0, "ok", run.stdout.decode(errors="replace"))
    status = "timeout" if run.status == "timeout" else "error"
    tail = run.stderr.decode(errors="replace")[-500:]
    return RewardResult(0.0, status, f"python: {run.status} (exit {run.returncode}): {tail}")
