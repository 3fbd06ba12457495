"""The package's import graph, read statically: the layers of docs/architecture.md ("Layers") hold.

Every import statement counts, wherever it is: at module level, inside a function (a lazy import
still ties the two modules together: it only moves the failure to the first call), and under
``if TYPE_CHECKING:`` (the annotation still names the other module). Relative imports are resolved;
``importlib.import_module("literal")`` counts as an import of that module.

Three rules, with no exception list:

- **layers**: every top-level module and subpackage of areal_fast is in exactly one layer of
  :data:`LAYERS` (a new one must be placed there, and in docs/architecture.md); an import goes to
  its own layer or one below, never up;
- **packages**: no two top-level packages import each other, through any chain (the package graph
  has no circle), so within a layer too one package sits above the other;
- **modules**: no import circle among the modules.

A circle or an upward import says a shared piece lives on the wrong side of a boundary: move it to
a module below both (or pass it in from above).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "areal_fast"

# The layers, bottom-up, as docs/architecture.md describes them: (name, top-level modules and
# subpackages of areal_fast). "areal_fast" is the package's own __init__.py.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple((name, frozenset(members)) for name, members in (
    ("0 base", {"areal_fast", "_lazy", "columns", "sample", "configutil", "netutil", "procutil", "diskutil", "heap",
                "moe_routing", "checkpoint", "dispatch", "lora_config", "http"}),
    ("1 compute", {"ops", "packing"}),
    ("2 rollout", {"rollout"}),
    ("3 components", {"weights", "reward", "data"}),
    ("4 backends", {"backends"}),
    ("5 embedded", {"embedded"}),
    ("6 trainer", {"trainer"}),
    ("7a workflow", {"workflow"}),
    ("7b agent", {"agent"}),
    ("7c recipes", {"recipes"}),
    ("8 config", {"config", "launch_config", "metrics_config", "preflight"}),
    ("9 controller", {"buffer", "group", "controller"}),
    ("10a run services", {"elastic", "metrics"}),
    ("10b launch", {"launch"}),
    ("10c cli", {"cli"}),
))


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


def package_of(module: str) -> str:
    """The top-level module or subpackage a module belongs to ('areal_fast.rollout.calls' -> 'rollout';
    the package's own __init__ is 'areal_fast')."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages its modules import."""
    out: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for m, deps in graph.items():
        out[package_of(m)].update(package_of(d) for d in deps if package_of(d) != package_of(m))
    return out


def layer_index(layers=LAYERS) -> dict[str, int]:
    """Package -> its position in ``layers`` (bottom-up); ValueError for a package in two layers."""
    out: dict[str, int] = {}
    for i, (name, members) in enumerate(layers):
        for p in members:
            if p in out:
                raise ValueError(f"{p!r} is in layer {layers[out[p]][0]!r} and in layer {name!r}")
            out[p] = i
    return out


def unlisted(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Top-level packages of the tree that no layer names."""
    index = layer_index(layers)
    return sorted({package_of(m) for m in graph} - set(index))


def listed_but_absent(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Layer entries that name no package of the tree (a moved or renamed one)."""
    return sorted(set(layer_index(layers)) - {package_of(m) for m in graph})


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a module in a higher layer, as 'a imports b (layer x below layer y)'."""
    index = layer_index(layers)
    out = []
    for m, deps in graph.items():
        lm = index.get(package_of(m))
        for d in deps:
            ld = index.get(package_of(d))
            if lm is not None and ld is not None and ld > lm:
                out.append(f"{m} imports {d} (layer {layers[lm][0]!r} below layer {layers[ld][0]!r})")
    return sorted(out)


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The top-level packages that import each other, through any chain, one sorted list per circle."""
    return sorted(sorted(c) for c in cycles(package_graph(graph)))


def edges_between(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    """The module imports from package ``a`` into package ``b`` (what a failure message names)."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if package_of(m) == a
                  for d in deps if package_of(d) == b)


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


def _planted(tmp_path, files: dict[str, str]) -> dict[str, set[str]]:
    """The import graph of a small areal_fast package in ``tmp_path`` made of ``files``."""
    pkg = tmp_path / "areal_fast"
    for rel, src in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    for d in {p.parent for p in pkg.rglob("*.py")}:
        (d / "__init__.py").touch()
    return import_graph(pkg)


SMALL_LAYERS = (("0 base", frozenset({"areal_fast", "columns"})), ("1 rollout", frozenset({"rollout"})),
                ("2 launch", frozenset({"launch", "elastic"})))


def test_the_checks_catch_a_planted_circle_and_upward_import(tmp_path):
    """A lazy circle and a lazy upward import in a small package are both found."""
    graph = _planted(tmp_path, {
        "rollout/a.py": "from areal_fast.rollout.b import X\n",
        "rollout/b.py": "def f():\n    from .a import Y\n    from ..launch.run import Z\n",
        "launch/run.py": "Z = 1\n",
        "columns.py": "if TYPE_CHECKING:\n    from areal_fast.rollout import a\n",
    })
    assert cycles(graph) == [{"areal_fast.rollout.a", "areal_fast.rollout.b"}]
    assert upward_imports(graph, SMALL_LAYERS) == [
        "areal_fast.columns imports areal_fast.rollout.a (layer '0 base' below layer '1 rollout')",
        "areal_fast.rollout.b imports areal_fast.launch.run (layer '1 rollout' below layer '2 launch')"]
    assert unlisted(graph, SMALL_LAYERS) == [] and listed_but_absent(graph, SMALL_LAYERS) == ["elastic"]


def test_the_checks_catch_two_packages_that_import_each_other(tmp_path):
    """Two packages of one layer importing each other through different modules: no module circle,
    no upward import, and still a package circle."""
    graph = _planted(tmp_path, {
        "launch/train.py": "from areal_fast.elastic.members import M\n",
        "elastic/members.py": "M = 1\n",
        "elastic/supervisor.py": "from areal_fast.launch import base\n",
        "launch/base.py": "B = 1\n",
    })
    assert cycles(graph) == [] and upward_imports(graph, SMALL_LAYERS) == []
    assert package_cycles(graph) == [["elastic", "launch"]]
    assert edges_between(graph, "elastic", "launch") == ["areal_fast.elastic.supervisor -> areal_fast.launch.base"]


def test_the_checks_catch_an_unlisted_package(tmp_path):
    graph = _planted(tmp_path, {"rollout/a.py": "", "newpkg/thing.py": "from areal_fast.rollout import a\n",
                                "stray.py": ""})
    assert unlisted(graph, SMALL_LAYERS) == ["newpkg", "stray"]
    assert upward_imports(graph, SMALL_LAYERS) == []  # an unplaced package has no layer to compare
    doubled = (*SMALL_LAYERS, ("3 top", frozenset({"rollout"})))
    try:
        layer_index(doubled)
    except ValueError as e:
        assert "'rollout' is in layer '1 rollout' and in layer '3 top'" in str(e)
    else:
        raise AssertionError("a package in two layers was accepted")


# ----------------------------------------------------------------------------- the package


def test_every_package_is_in_exactly_one_layer():
    graph = import_graph()
    assert "areal_fast.controller" in graph and len(graph) > 40
    layer_index()  # raises for a package in two layers
    assert unlisted(graph) == [], "place these in LAYERS and in docs/architecture.md's Layers"
    assert listed_but_absent(graph) == [], "LAYERS names packages the tree no longer has"


def test_no_import_goes_up_a_layer():
    assert upward_imports(import_graph()) == []


def test_no_two_packages_import_each_other():
    graph = import_graph()
    found = package_cycles(graph)
    detail = {f"{a} -> {b}": edges_between(graph, a, b) for c in found for a in c for b in c
              if a != b and edges_between(graph, a, b)}
    assert found == [], f"packages that import each other (through any chain): {detail}"


def test_no_import_circle_among_the_package_modules():
    found = [sorted(c) for c in cycles(import_graph())]
    assert found == [], "modules that import each other (move the shared piece below both)"
