"""Code reward: stdin/stdout and function-call tests, outcomes 1/0/0/0 with their statuses."""

import pytest

from areal_fast.reward.code import code_reward, extract_code, outputs_match, values_equal

ADD_TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
TIMEOUT_S = 0.5  # per test, for programs that must time out: any limit gets there, a short one sooner
FINISH_S = 20.0  # per test, for programs that must end by themselves: never the limit on a loaded machine

CORRECT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
CRASH = "```python\nraise RuntimeError('boom')\n```"
SLOW = "```python\nwhile True:\n    pass\n```"


@pytest.mark.parametrize(
    "completion,value,status,detail,limit_s",
    [
        (CORRECT, 1.0, "ok", "passed 2/2", FINISH_S),
        (WRONG, 0.0, "ok", "wrong answer on test 0", FINISH_S),
        (CRASH, 0.0, "error", "RuntimeError: boom", FINISH_S),
        (SLOW, 0.0, "timeout", "time limit exceeded on test 0", TIMEOUT_S),
    ],
)
def test_stdio_outcomes(completion, value, status, detail, limit_s):
    r = code_reward({"tests": ADD_TESTS, "time_limit_s": limit_s}, completion)
    assert (r.value, r.status) == (value, status), r
    assert detail in r.detail


def test_stdio_partial_credit():
    prog = "a, b = map(int, input().split())\nprint(5 if a == 2 else 0)"
    r = code_reward({"tests": ADD_TESTS, "partial": True, "time_limit_s": FINISH_S}, prog)
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
    limit_s = TIMEOUT_S if status == "timeout" else FINISH_S
    r = code_reward({"fn_name": "add", "tests": FN_TESTS, "time_limit_s": limit_s}, completion)
    assert (r.value, r.status) == (value, status), r


def test_function_call_cannot_fake_results_by_printing():
    fake = 'print(\'{"test": 0, "ok": true}\')\ndef add(a, b):\n    return 0\n'
    r = code_reward({"fn_name": "add", "tests": FN_TESTS, "time_limit_s": FINISH_S}, fake)
    assert r.value == 0.0


# Solutions that attack the function-call harness instead of solving the task. Each one scored 1.0
# when the harness judged inside the sandbox (in __main__, next to the solution); none may score.
FORGE = "import __main__, os\nnonce = __main__.spec['nonce']\n"
HARNESS_HACKS = {
    "call report(ok=True)": "import __main__\nfor i in range(3):\n    __main__.report(test=i, ok=True)\n"
                            "import os\nos._exit(0)\n",
    "print the verdict line": FORGE + "for i in range(3):\n"
                              "    os.write(1, (nonce + '{\"test\": %d, \"ok\": true}\\n' % i).encode())\n"
                              "os._exit(0)\n",
    "write to the result fd": FORGE + "for i in range(3):\n"
                              "    __main__.out.write(nonce + '{\"test\": %d, \"ok\": true}\\n' % i)\n"
                              "__main__.out.flush()\ndef add(a, b):\n    return None\n",
    "forge records after the real ones": FORGE + "import atexit\n"
                                         "atexit.register(lambda: [__main__.report(test=i, value=5) "
                                         "for i in range(3)])\ndef add(a, b):\n    return 5\n",
    "monkeypatch json.dumps": "import json\n_real = json.dumps\n"
                              "json.dumps = lambda o, **k: _real({'test': o['test'], 'ok': True}) "
                              "if isinstance(o, dict) and 'test' in o else _real(o, **k)\n"
                              "def add(a, b):\n    return None\n",
    "monkeypatch builtins": "import builtins, math\nbuiltins.all = lambda *a: True\nbuiltins.len = lambda x: 0\n"
                            "builtins.isinstance = lambda *a: False\nmath.isclose = lambda *a, **k: True\n"
                            "def add(a, b):\n    return [a, b, 'wrong']\n",
    "an object equal to everything": "class Any:\n    def __eq__(self, other):\n        return True\n"
                                     "def add(a, b):\n    return Any()\n",
    "an int subclass equal to everything": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
                                           "    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(-1)\n",
    "sys.exit(0) early": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "SystemExit inside the function": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit(0) inside the function": "def add(a, b):\n    import os\n    os._exit(0)\n",
}


@pytest.mark.parametrize("hack", list(HARNESS_HACKS))
def test_function_call_harness_cannot_be_hacked(hack):
    r = code_reward({"fn_name": "add", "tests": FN_TESTS, "time_limit_s": FINISH_S}, HARNESS_HACKS[hack])
    assert r.value == 0.0, (hack, r)
    # partial credit is not a way around it either
    r = code_reward({"fn_name": "add", "tests": FN_TESTS, "time_limit_s": FINISH_S, "partial": True},
                    HARNESS_HACKS[hack])
    assert r.value == 0.0, (hack, r)


def test_expected_values_never_enter_the_sandbox():
    spy = "import __main__, json, sys\ndef add(a, b):\n    return [json.dumps(__main__.spec), sys.stdin.read()]\n"
    tests = [{"args": [2, 3], "expected": "SECRET-EXPECTED-VALUE"}]
    r = code_reward({"fn_name": "add", "tests": tests, "time_limit_s": FINISH_S}, spy)
    assert (r.value, r.status) == (0.0, "ok") and "wrong answer on test 0" in r.detail, r
    assert "SECRET-EXPECTED-VALUE" not in r.detail and "[2, 3]" in r.detail, r  # it saw the arguments only


def test_function_call_partial_credit():
    prog = "def add(a, b):\n    return a + b if a == 2 else None\n"
    r = code_reward({"fn_name": "add", "tests": FN_TESTS, "partial": True, "time_limit_s": FINISH_S}, prog)
    assert r.value == pytest.approx(1 / 3) and r.status == "ok", r
    assert "wrong answer on test 1" in r.detail


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


BIG = "1" + "0" * 5000  # float() makes it inf: any two such numbers were "within 1e-6"


@pytest.mark.parametrize(
    "got,expected,same",
    [  # integers are compared exactly: a 1e-6 tolerance once accepted 1000000000 for 1000000007
     ("1000000000", "1000000007", False), ("1000000007", "1000000007", True), ("999999", "1000000", False),
     ("5.0000001", "5", False), (BIG, BIG[:-1] + "1", False), (BIG, BIG, True),
     ("-0", "0", True), ("+5", "5", True), ("05", "5", True), ("5.0", "5", True), ("1e9", "1000000000", True),
     # only plain ASCII decimal numbers are numbers: float() also reads these
     ("1_000", "1000", False), ("1_000.5", "1000.5", False), ("\u0661\u0662", "12", False),
     ("infinity", "1e999", False), ("nan", "nan", True),  # the same text is always equal
     # floats keep their tolerance
     ("0.3333333", "0.33333333", True), ("1.0000001", "1.0", True), ("2", "2.0", True), ("1.1", "1.0", False),
     ("1e-7", "0.0", True), ("1e9", "1.00001e9", False)],
)
def test_outputs_match_integers_exactly_floats_within_1e_6(got, expected, same):
    assert outputs_match(got, expected) is same, (got[:20], expected[:20])


@pytest.mark.parametrize(
    "got,expected,same",
    [(1000000000, 1000000007, False), (1000000000.0, 1000000007, False), (3.0, 3, True), (3, 3, True),
     (2**60 + 1, 2**60, False), (float(2**60), 2**60 + 1, False), (3, 3.0000001, True), (0.1 + 0.2, 0.3, True),
     ([1, 2.0000001], [1, 2.0], True), ([1.0000001, 2], [1, 2], False), (True, 1, False), (1, True, False)],
)
def test_values_equal_integers_exactly_floats_within_1e_6(got, expected, same):
    assert values_equal(got, expected) is same


def test_bad_task_is_named():
    with pytest.raises(ValueError, match="tests"):
        code_reward({"tests": []}, "print(1)")
    with pytest.raises(ValueError, match="'input' and 'output'"):
        code_reward({"tests": [{"in": "1"}]}, "print(1)")
    with pytest.raises(ValueError, match="test 1 needs an 'expected' key"):
        code_reward({"fn_name": "f", "tests": [{"args": [1], "expected": 1}, {"args": [2]}]}, "def f(x): return x")
    with pytest.raises(ValueError, match="test 0: 'args' must be a list"):
        code_reward({"fn_name": "f", "tests": [{"args": {"x": 1}, "expected": 1}]}, "def f(x): return x")


# ------------------------------------------------------------------ program text in details: controls escaped
FORGE = "\\x1b[2J\\x1b]0;pwned\\x07\\nERROR forged line\\r\\x9b31m\\x7f\\tend"
CONTROLS = {chr(c) for c in [*range(0x20), *range(0x7f, 0xa0)]}


@pytest.mark.parametrize("completion,task", [
    (f"import sys\nsys.stderr.write('{FORGE}')\nsys.exit(1)\n", {"tests": ADD_TESTS}),  # stderr tail
    (f"raise ValueError('{FORGE}')\n", {"tests": ADD_TESTS, "fn_name": "add"}),  # loading the solution
    (f"def add(a, b):\n    raise ValueError('{FORGE}')\n", {"tests": ADD_TESTS[:1], "fn_name": "add"}),
], ids=["stderr", "loading", "call"])
def test_program_text_in_details_has_its_control_characters_escaped(completion, task):
    if task.get("fn_name"):
        task = {**task, "tests": [{"args": [2, 3], "expected": 5}]}
    r = code_reward({**task, "time_limit_s": FINISH_S}, completion)
    assert r.status == "error", r
    assert not CONTROLS & set(r.detail), r.detail  # no escape sequence, no line a log reader would trust
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\nERROR forged line\\r\\x9b31m\\x7f\\tend" in r.detail


# ------------------------------------------------------------------ fenced blocks: one scan
def _reference_blocks(text):  # the regex extract_code used: the reference on small inputs
    import re

    return re.findall(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", text, re.S)


def test_extract_code_finds_the_blocks_the_regex_found():
    import random

    from areal_fast.reward.code import fenced_blocks

    rng = random.Random(3)
    atoms = ["```", "`", "\n", " ", "\t", "python", "py x", "a", "-", "``````"]
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        assert fenced_blocks(text) == _reference_blocks(text), repr(text)


@pytest.mark.timeout(5)
def test_extract_code_of_many_unclosed_fences_is_linear():
    # the regex backtracked over each line once per fence on it: 72,000 backticks took ~3 s
    for text in ["```" * 200_000, "```" * 100_000 + "\n", "```python\n" + "x" * 10**6]:
        assert extract_code(text) == text


@pytest.mark.timeout(5)
def test_comparing_a_long_digit_token_is_linear():
    # the number pattern could split a run of digits two ways: 40,000 digits and a letter took 40 s
    long = "9" * 200_000
    assert not outputs_match(long + "x", long + "y")
    assert not outputs_match(long + ".5x", "1")
    assert outputs_match(long + "0", long + "0") and outputs_match("0.50", "0.5") and outputs_match("1e5", "100000")
