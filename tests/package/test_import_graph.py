"""The package's import graph, read statically: no import circle among areal_fast's modules, and no
upward import from the rollout layer.

Every import statement counts, wherever it is: at module level, inside a function (a lazy import
still ties the two modules together: it only moves the failure to the first call), and under
``if TYPE_CHECKING:`` (the annotation still names the other module). Relative imports are resolved;
``importlib.import_module("literal")`` counts as an import of that module. A circle says a shared
piece lives on the wrong side of a boundary: move it to a module below both.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "areal_fast"

# Circles still allowed, each as the set of module-name prefixes every member of the circle must
# match. Only until it is removed: the test below fails once an entry matches no circle any more.
# None is left: a circle, even through a lazy or an ``if TYPE_CHECKING:`` import, shows a boundary
# in the wrong place.
ALLOWED_CYCLES: dict[str, tuple[str, ...]] = {}

# The rollout layer (client, engine, servers, sharded workers) sits below the controller, the
# launchers and the trainer: they use it, it never imports them.
ROLLOUT = "areal_fast.rollout"
ABOVE_ROLLOUT = ("areal_fast.controller", "areal_fast.launch", "areal_fast.trainer")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(pkg: Path = PKG) -> dict[str, Path]:
    """Every module of the package by dotted name ('areal_fast.rollout' for its __init__.py)."""
    return {module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py"))}


def import_targets(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> set[str]:
    """The dotted modules one import statement of a module in ``package`` names (relative imports
    resolved). ``from pkg import sub`` is an import of ``pkg.sub`` when that is in ``known``."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return {f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names}


def imported_modules(tree: ast.Module, name: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The modules in ``known`` that module ``name`` imports anywhere in its source (any depth,
    any branch). ``from pkg import sub`` is an import of ``pkg.sub`` when that is a module."""
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.update(import_targets(node, package, known))
        elif (isinstance(node, ast.Call) and _called_name(node.func) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
    return {m for m in out if m in known and m != name}


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


@functools.cache
def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = package_modules(pkg)
    known = set(mods)
    return {name: imported_modules(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def allowed_by(cycle: set[str]) -> str | None:
    """The ALLOWED_CYCLES entry whose prefixes cover every member of ``cycle``, if any."""
    for label, prefixes in ALLOWED_CYCLES.items():
        if all(_under(m, prefixes) for m in cycle):
            return label
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in graph.items() if _under(m, (ROLLOUT,))
                  for d in deps if _under(d, ABOVE_ROLLOUT))


# ----------------------------------------------------------------------------- the tools themselves


def test_the_import_reader_sees_every_kind_of_import():
    src = ("from . import x, name\n"
           "from .y import z\n"
           "if TYPE_CHECKING:\n    import p.t\n"
           "def f():\n    import p.r\n    importlib.import_module('p.u')\n"
           "class C:\n    def g(self):\n        from p.v import thing\n")
    known = {"p", "p.x", "p.y", "p.q", "p.r", "p.s", "p.t", "p.u", "p.v", "p.sub", "p.sub.m"}
    assert imported_modules(ast.parse(src), "p.s", False, known) == {"p.x", "p", "p.y", "p.t", "p.r", "p.u", "p.v"}
    # relative imports from a package's __init__ and from a module one level down
    init = ast.parse("from . import m\nfrom .. import q\n")
    assert imported_modules(init, "p.sub", True, known) == {"p.sub.m", "p.q"}
    assert imported_modules(ast.parse("from .. import q\n"), "p.sub.m", False, known) == {"p.q"}
    assert imported_modules(ast.parse("import os\nfrom numpy import array\n"), "p.s", False, known) == set()


def test_the_cycle_finder_finds_planted_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set()}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert sorted(map(sorted, cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}))) == [["a", "b"], ["c", "d"]]


def test_the_checks_catch_a_planted_circle_and_upward_import(tmp_path):
    """A lazy circle and a lazy upward import in a small package are both found."""
    pkg = tmp_path / "areal_fast"
    (pkg / "rollout").mkdir(parents=True)
    (pkg / "launch").mkdir()
    for init in (pkg, pkg / "rollout", pkg / "launch"):
        (init / "__init__.py").write_text("")
    (pkg / "rollout" / "a.py").write_text("from areal_fast.rollout.b import X\n")
    (pkg / "rollout" / "b.py").write_text("def f():\n    from .a import Y\n    from ..launch.run import Z\n")
    (pkg / "launch" / "run.py").write_text("Z = 1\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [{"areal_fast.rollout.a", "areal_fast.rollout.b"}]
    assert upward_imports(graph) == ["areal_fast.rollout.b imports areal_fast.launch.run"]


# ----------------------------------------------------------------------------- the package


def test_no_import_circle_among_the_package_modules():
    graph = import_graph()
    assert "areal_fast.controller" in graph and len(graph) > 40
    found = cycles(graph)
    unexpected = [sorted(c) for c in found if allowed_by(c) is None]
    assert unexpected == [], "modules that import each other (move the shared piece below both)"


def test_every_allowed_circle_still_exists():
    """An allow-list entry outlives its circle by mistake only: remove it when the circle is gone."""
    found = cycles(import_graph())
    stale = [label for label in ALLOWED_CYCLES if not any(allowed_by(c) == label for c in found)]
    assert stale == [], f"remove these entries of ALLOWED_CYCLES, their circle is gone: {stale}"


def test_the_rollout_layer_imports_nothing_above_it():
    graph = import_graph()
    assert any(_under(m, (ROLLOUT,)) for m in graph)
    assert upward_imports(graph) == []
