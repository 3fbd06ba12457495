"""Code reward: stdin/stdout and function-call tests, outcomes 1/0/0/0 with their statuses."""

import pytest

from areal_fast.reward.code import code_reward, extract_code, outputs_match

ADD_TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
FAST = {"time_limit_s": 1.0}  # per test; slow programs fail fast

CORRECT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
CRASH = "```python\nraise RuntimeError('boom')\n```"
SLOW = "```python\nwhile True:\n    pass\n```"


@pytest.mark.parametrize(
    "completion,value,status,detail",
    [
        (CORRECT, 1.0, "ok", "passed 2/2"),
        (WRONG, 0.0, "ok", "wrong answer on test 0"),
        (CRASH, 0.0, "error", "RuntimeError: boom"),
        (SLOW, 0.0, "timeout", "time limit exceeded on test 0"),
    ],
)
def test_stdio_outcomes(completion, value, status, detail):
    r = code_reward({"tests": ADD_TESTS, **FAST}, completion)
    assert (r.value, r.status) == (value, status), r
    assert detail in r.detail


def test_stdio_partial_credit():
    prog = "a, b = map(int, input().split())\nprint(5 if a == 2 else 0)"
    r = code_reward({"tests": ADD_TESTS, "partial": True, **FAST}, prog)
    assert (r.value, r.status) == (0.5, "ok")
    assert "wrong answer on test 1" in r.detail


FN_TESTS = [{"args": [2, 3], "expected": 5}, {"args": [[1, 2], [3]], "expected": [1, 2, 3]},
            {"kwargs": {"a": 0.1, "b": 0.2}, "expected": 0.3}]


@pytest.mark.parametrize(
    "completion,value,status",
    [
        ("```python\ndef add(a, b):\n    print('noise on stdout')\n    return a + b\n```", 1.0, "ok"),
        ("```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```", 1.0, "ok"),
        ("def add(a, b):\n    return a * b\n", 0.0, "ok"),
        ("def add(a, b):\n    raise ValueError('no')\n", 0.0, "error"),
        ("import sys\nsys.exit(3)\n", 0.0, "error"),
        ("def plus(a, b):\n    return a + b\n", 0.0, "error"),
        ("def add(a, b):\n    while True:\n        pass\n", 0.0, "timeout"),
        ("def add(a, b):\n    import os\n    os._exit(0)\n", 0.0, "error"),
    ],
)
def test_function_call_outcomes(completion, value, status):
    r = code_reward({"fn_name": "add", "tests": FN_TESTS, "time_limit_s": 0.5}, completion)
    assert (r.value, r.status) == (value, status), r


def test_function_call_cannot_fake_results_by_printing():
    fake = 'print(\'{"test": 0, "ok": true}\')\ndef add(a, b):\n    return 0\n'
    r = code_reward({"fn_name": "add", "tests": FN_TESTS}, fake)
    assert r.value == 0.0


def test_extract_code_prefers_last_python_block():
    text = "plan\n```text\nnot code\n```\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("print(1)") == "print(1)"


@pytest.mark.parametrize(
    "got,expected,same",
    [("5\n", "5", True), ("1 2  \n3\n\n", "1 2\n3", True), ("0.3333333", "0.33333333", True),
     ("5", "6", False), ("1 2", "1 2 3", False), ("a\nb", "a", False), ("", "0", False)],
)
def test_outputs_match(got, expected, same):
    assert outputs_match(got, expected) is same


def test_bad_task_is_named():
    with pytest.raises(ValueError, match="tests"):
        code_reward({"tests": []}, "print(1)")
    with pytest.raises(ValueError, match="'input' and 'output'"):
        code_reward({"tests": [{"in": "1"}]}, "print(1)")
