"""No test module needs an optional package to be collected.

``pytest -m gpu tests`` imports every test module before it selects the ``gpu`` ones, so one module
that imports orjson (or SGLang, flash-attn...) at its top ends the run on the GPU image - which has
none of them - with "errors during collection" and no GPU test run. Two checks:

* quick, static: no module under ``tests/`` imports an optional package at module level (tests use
  ``pytest.importorskip`` inside the test, or a lazy import);
* slow, real: in an interpreter where the optional packages cannot be imported
  (``tools/without_optional/sitecustomize.py``, as the GPU suite's dry run uses it), ``pytest -m gpu
  --collect-only tests`` collects with no error exactly the GPU tests that an interpreter with them
  collects from the files that carry a ``gpu`` mark: checked on the GPU suite's own dry-run collection
  (``test_gpu_suite.py::test_deep_dry_run_of_the_whole_plan``, with :func:`_collect` below), one
  collection of the whole suite instead of two.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from tools import gpu_suite  # noqa: E402

OPTIONAL = ("orjson", "sglang", "vllm", "ray", "flash_attn", "liger_kernel", "uvloop", "math_verify")


def top_level_optional_imports(folder: Path) -> list[str]:
    """``file:line name`` for each optional package imported at module level (also inside a top-level
    ``if``/``with``, not inside ``try``: a ``try``/``except ImportError`` import is optional already)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        body = list(ast.parse(path.read_text(), str(path)).body)
        while body:
            node = body.pop(0)
            if isinstance(node, (ast.If, ast.With)):
                body.extend(node.body + getattr(node, "orelse", []))
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(folder)}:{node.lineno} {n}" for n in names if n.partition(".")[0] in OPTIONAL]
    return sorted(found)


def test_no_test_module_imports_an_optional_package_at_its_top():
    assert top_level_optional_imports(ROOT / "tests") == []


def test_the_static_check_sees_a_top_level_import(tmp_path):
    (tmp_path / "test_x.py").write_text("import os\nif True:\n    import orjson\nfrom sglang.srt import x\n"
                                        "try:\n    import ray\nexcept ImportError:\n    ray = None\n"
                                        "def f():\n    import flash_attn\n")
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "test_y.py").write_text("import vllm\n")  # a component folder is scanned too
    assert top_level_optional_imports(tmp_path) == ["rollout/test_y.py:1 vllm", "test_x.py:3 orjson",
                                                    "test_x.py:4 sglang.srt"]


def _blocked_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(gpu_suite.WITHOUT_OPTIONAL), env.get("PYTHONPATH")) if p)
    env.pop("AREAL_FAST_BLOCK_IMPORTS", None)  # the default list: what the image lacks
    return env


def test_the_blocker_hides_installed_packages():
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('orjson') is None and importlib.util.find_spec('sglang') is None\n"
            "for name in ('orjson', 'flash_attn', 'sglang.srt'):\n"
            "    try:\n        __import__(name)\n    except ModuleNotFoundError:\n        pass\n"
            "    else:\n        sys.exit(name + ' was imported')\n"
            "import json, torch, areal_fast\nprint('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], env=_blocked_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def _collect(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
