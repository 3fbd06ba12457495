"""docs/architecture.md's module table ("Which file does what") against the tree: every module of
``areal_fast/`` is listed, and every file the table names exists.

How the table names a file: a backticked path ending in ``.py`` under a ``### `areal_fast/<dir>/` ``
heading, relative to that directory (``client.py`` under ``areal_fast/rollout/``), to ``areal_fast/``
(``backends/vllm/disk.py`` from another section) or to the repository (``kernels/packing.py``),
whichever exists. A package's ``__init__.py`` is its heading's, not a row of its own. The layer
table of the same page is checked against the import graph by ``test_import_graph.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "areal_fast"
DOC = ROOT / "docs" / "architecture.md"
TABLE_HEADING = "## Which file does what"
_SECTION = re.compile(r"^### (.*)$", re.M)
_PKG_DIR = re.compile(r"`(areal_fast/[\w/]*)`")
_PY_PATH = re.compile(r"`([\w./-]+\.py)`")


def table_sections(text: str) -> list[tuple[list[Path], str]]:
    """The sections of the module table: (the ``areal_fast/`` directories its heading names, its text)."""
    start = text.index(TABLE_HEADING)
    end = text.find("\n## ", start + len(TABLE_HEADING))
    table = text[start:end if end >= 0 else len(text)]
    heads = list(_SECTION.finditer(table))
    out = []
    for i, h in enumerate(heads):
        body = table[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(table)]
        out.append(([ROOT / d for d in _PKG_DIR.findall(h.group(1))], body))
    return out


def listed_files(text: str, root: Path = ROOT) -> tuple[set[Path], list[str]]:
    """The files the table names (resolved) and the names that match no file."""
    found: set[Path] = set()
    missing: list[str] = []
    for dirs, body in table_sections(text):
        bases = [*(root / d.relative_to(ROOT) for d in dirs), root / "areal_fast", root]
        for name in _PY_PATH.findall(body):
            hit = next((b / name for b in bases if (b / name).is_file()), None)
            if hit is None:
                missing.append(name)
            else:
                found.add(hit.resolve())
    return found, missing


def modules(pkg: Path = PKG) -> set[Path]:
    """Every module of the package that needs a row (a package's ``__init__.py`` does not)."""
    return {p.resolve() for p in pkg.rglob("*.py") if p.name != "__init__.py"}


def unlisted(text: str, root: Path = ROOT) -> list[str]:
    found, _ = listed_files(text, root)
    return sorted(str(p.relative_to(root.resolve())) for p in modules(root / "areal_fast") - found)


def test_the_reader_resolves_names_per_section_and_finds_gaps(tmp_path):
    for rel in ("areal_fast/rollout/client.py", "areal_fast/rollout/engine/server.py", "areal_fast/cli.py",
                "areal_fast/backends/vllm/disk.py", "areal_fast/rollout/__init__.py", "kernels/packing.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    doc = ("# A\n## Which file does what\n### `areal_fast/`\n- `cli.py` - the command.\n"
           "### `areal_fast/rollout/`\n- `client.py`, `engine/server.py`; see `backends/vllm/disk.py`, "
           "`kernels/packing.py`, `gone.py`.\n## Next\n- `other.py` is outside the table.\n")
    found, missing = listed_files(doc, tmp_path)
    assert missing == ["gone.py"]
    assert unlisted(doc, tmp_path) == []
    without_server = doc.replace("`engine/server.py`", "the server")
    assert unlisted(without_server, tmp_path) == ["areal_fast/rollout/engine/server.py"]


def test_the_module_table_lists_every_module_and_only_modules_that_exist():
    text = DOC.read_text()
    _, missing = listed_files(text)
    assert missing == [], f"docs/architecture.md's module table names files that do not exist: {missing}"
    assert unlisted(text) == [], "modules missing from docs/architecture.md's module table"
