"""The tree keeps two habits that a reader of a test or a doc relies on.

- Tolerances have names: a test compares with a constant of ``tests/tolerances.py`` (which says
  why it is that size), never with a number written into the call. An AST scan of every test file
  finds ``atol=``/``rtol=``/``abs=``/``rel=`` keywords (and the positional tolerances of
  ``pytest.approx``, ``allclose``, ``isclose``, ``assert_close``) given a numeric literal, and
  tolerance constants defined outside ``tests/tolerances.py``. A literal 0 switches a tolerance
  off (the comparison is exact in that respect) and names no size: it is allowed.
- The code and docs speak of the project, not of our tracker: no "issue" followed by a number of
  ours, no finding labels (a letter of M, L, H or C and a number), no review-round items. An
  outside project's issue may be cited, with its name before the number (as in docs/vllm.md) or as
  a link to its repository on GitHub.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# ---------------------------------------------------------------------------------------- tolerances
_TOL_KEYWORDS = {"atol", "rtol", "abs", "rel", "abs_tol", "rel_tol"}
_POSITIONAL_FROM = {"approx": 1, "allclose": 2, "isclose": 2, "assert_close": 2}  # args from here on
_TOL_NAME = re.compile(r"(^|_)(A|R)?TOL$")


def _literal_number(node: ast.AST) -> float | None:
    """The value of a numeric literal (``1e-5``, ``-1e-5``, ``2 * 1e-3``), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _literal_number(node.operand)
        return None if v is None else -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _literal_number(node.left), _literal_number(node.right)
        if a is not None and b is not None:
            return 1.0  # some number: its value does not matter here, only that it is written out
    return None


def _literal_tolerances(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                v = _literal_number(kw.value) if kw.arg in _TOL_KEYWORDS else None
                if v:
                    found.append(f"{node.lineno}: {kw.arg}={ast.unparse(kw.value)}")
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            for arg in node.args[_POSITIONAL_FROM.get(name, len(node.args)):]:
                if _literal_number(arg):
                    found.append(f"{node.lineno}: {name}(..., {ast.unparse(arg)})")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Name) and _TOL_NAME.search(target.id)
                        and _literal_number(node.value) is not None):
                    found.append(f"{node.lineno}: {target.id} = {ast.unparse(node.value)}")
    return found


def test_the_scan_finds_a_literal_tolerance(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import torch, pytest\n"
                 "torch.testing.assert_close(a, b, atol=1e-5, rtol=0)\n"
                 "assert x == pytest.approx(y, rel=-2e-3)\n"
                 "assert torch.allclose(a, b, 1e-4)\n"
                 "MY_ATOL = 1e-3\n"
                 "torch.testing.assert_close(a, b, atol=FP32_REORDER_ATOL, rtol=0)\n"
                 "FROM_THERE_ATOL = tolerances.FP32_REORDER_ATOL\n")
    assert sorted(int(x.split(":")[0]) for x in _literal_tolerances(f)) == [2, 3, 4, 5]


def test_no_test_writes_a_tolerance_as_a_number():
    bad = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "tolerances.py":
            continue
        found = _literal_tolerances(path)
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, (f"tolerances written as numbers (name them in tests/tolerances.py, with the reason for "
                     f"their size, and import the name): {bad}")


# ---------------------------------------------------------------------------------- tracker references
SCANNED = ("areal_fast", "tests", "bench", "tools", "docs", "examples", "README.md")
SKIPPED = ("bench/results",)  # result files the benchmarks write (commit stamps, device names)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini", ".rst"}

# "issue" starts a word or follows an underscore (a test named after an issue and its number)
_ISSUE = re.compile(r"(?:(?P<before>[\w.'-]+)\s+)?(?<![^\W_])issues?[\s_]+#?[0-9]+", re.IGNORECASE)
_LABEL = re.compile(r"\b[MLHC][0-9]{1,2}\b(?P<after>\s+\w+)?")
_ROUND = re.compile(r"\b(review\s+)?round\s+[0-9]+\s+(item|finding)s?\b", re.IGNORECASE)
# Words after a label that make it a thing, not a finding of ours: C0 controls, C1 controls, an L2 norm,
# an L1 loss, an L2 cache, a distance or a penalty.
_LABEL_THINGS = {"control", "controls", "norm", "norms", "loss", "cache", "caches", "distance", "penalty"}
# A word before "issue N" that is not a project's name (sentence words, our own references).
_NOT_A_PROJECT = {"the", "an", "a", "our", "this", "that", "see", "after", "before", "in", "of", "per", "since",
                  "from", "by", "for", "and", "or", "as", "its", "their"}
# Our own repository, in a link: never an outside project.
_OURS = re.compile(r"github\.com/[\w.-]+/areal[_-]fast\b", re.IGNORECASE)


def tracker_references(text: str) -> list[str]:
    """The places in ``text`` that cite our tracker (see the module docstring)."""
    found = []
    for line in text.splitlines():
        for m in _ISSUE.finditer(line):
            before = (m.group("before") or "").removesuffix("'s").removesuffix("'")
            outside = (before and before.lower() not in _NOT_A_PROJECT and any(c.isupper() for c in before)
                       and before.lower() != "areal_fast")
            if not outside:
                found.append(m.group(0).strip())
        for m in _LABEL.finditer(line):
            after = (m.group("after") or "").strip().lower()
            if after not in _LABEL_THINGS:
                found.append(m.group(0).strip())
        found += [m.group(0) for m in _ROUND.finditer(line)]
        found += [m.group(0) for m in _OURS.finditer(line) if "/issues/" in line or "/pull/" in line]
    return found


def test_the_scan_tells_our_tracker_from_an_outside_project():
    # "|" keeps each example of ours from being a reference in this file; it is removed before the scan
    ours = [t.replace("|", "") for t in (
        "fixed in issue| 25", "(issue| 32, M|4-M|7)", "as Issue| #7 asks", "# ---- L|4: leniencies",
        "H|1 / H|2: no hang", "review round| 4 item 2", "https://github.com/someone/areal|_fast/issues/3",
        "def test_lists_the_issue|_27_sweep():")]
    theirs = ["AReaL issue 1160", "vLLM's issue 4242", "SGLang issues 12", "C0 controls (below 0x20)",
              "the L2 norm", "an H100 and an H200", "M2PO", "https://github.com/vllm-project/vllm/issues/1"]
    assert [t for t in ours if not tracker_references(t)] == []
    assert {t: tracker_references(t) for t in theirs if tracker_references(t)} == {}


def test_code_tests_and_docs_cite_no_tracker_of_ours():
    bad = {}
    for top in SCANNED:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            rel = str(path.relative_to(ROOT))
            if path.suffix not in TEXT_SUFFIXES or rel.startswith(SKIPPED) or "__pycache__" in rel:
                continue
            found = tracker_references(path.read_text(errors="replace"))
            if found:
                bad[rel] = found
    assert not bad, f"references to our tracker (name the behaviour instead): {bad}"
