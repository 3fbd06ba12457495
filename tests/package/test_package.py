"""The package itself: the native core, the kernels subpackage, and backend selection."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import areal_fast
from areal_fast import backend


def test_import_has_no_gpu_requirement():
    # A fresh interpreter with no CUDA visible and no Triton interpreter must import everything.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    code = "import areal_fast, areal_fast.kernels, areal_fast.packing; print(areal_fast.__version__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == areal_fast.__version__


def test_kernels_are_a_subpackage_not_top_level():
    import areal_fast.kernels as k

    assert k.__name__ == "areal_fast.kernels"
    assert "kernels" not in sys.modules or sys.modules["kernels"] is not k


def test_native_core_reports_its_build():
    C = backend.native()
    assert isinstance(C.has_cuda(), bool)
    if shutil.which("nvcc") and os.environ.get("AREAL_FAST_CUDA", "AUTO") != "OFF":
        # This machine has nvcc, so the build must have compiled the CUDA sources.
        assert C.has_cuda(), "nvcc is on PATH but areal_fast._C was built without CUDA"


def test_native_core_counts_the_devices_torch_sees():
    C = backend.native()
    if not C.has_cuda():
        assert C.cuda_device_count() == 0, "a build without CUDA sources must report no devices"
    elif torch.version.cuda is not None:
        assert C.cuda_device_count() == torch.cuda.device_count()
    # With every device hidden, the CUDA runtime (and so the core) must see none.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    code = "from areal_fast.backend import native; print(native().cuda_device_count())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_reference_is_always_available():
    assert backend.select("demo", "cpu", available=("triton", "reference")) == "reference"
    assert backend.why_unavailable("reference", "cpu") is None


def test_env_override(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "reference")
    assert backend.select("demo", "cpu", available=backend.BACKENDS) == "reference"
    monkeypatch.setenv(backend.ENV_VAR, "warp")
    with pytest.raises(backend.BackendUnavailable, match="AREAL_FAST_BACKEND='warp': 'warp' is not a backend"):
        backend.select("demo", "cpu", available=backend.BACKENDS)


def test_explicit_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    with pytest.raises(backend.BackendUnavailable, match="backend 'triton' was requested .* but cannot run"):
        backend.select("demo", "cpu", available=backend.BACKENDS, backend="triton")
    with pytest.raises(backend.BackendUnavailable, match="has only reference"):
        backend.select("demo", "cpu", available=("reference",), backend="cuda")


def test_cuda_backend_needs_cuda_tensors():
    reason = backend.why_unavailable("cuda", "cpu")
    assert reason is not None and ("CUDA" in reason or "cuda" in reason)


def test_describe_lists_every_backend():
    d = backend.describe()
    assert set(backend.BACKENDS) <= set(d)
    assert d["reference"] == "available"


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("doc", ["architecture.md", "glossary.md"])
def test_every_file_a_doc_names_exists(doc):
    """Paths in backticks (``areal_fast/x.py``, ``trainer/batch.py``) and linked docs must exist:
    from the repository root, from ``docs/``, from ``areal_fast/`` (or its ``rollout/``), or
    from a directory named in backticks in the ``###`` heading above them."""
    roots = [os.path.join(REPO, *d) for d in ((), ("docs",), ("areal_fast",), ("areal_fast", "rollout"))]
    named, section = [], []
    for line in open(os.path.join(REPO, "docs", doc)):
        if line.startswith("#"):
            section = [os.path.join(REPO, d) for d in re.findall(r"`([\w./-]+/)`", line)]
            continue
        for p in re.findall(r"`([\w./-]+\.(?:py|cpp|cu|h|md|txt))`", line) + re.findall(r"\]\(([\w./-]+\.md)", line):
            named.append((p, roots + section))
    assert named, f"docs/{doc} names no file"
    missing = sorted({p for p, where in named if not any(os.path.exists(os.path.join(r, p)) for r in where)})
    assert missing == [], f"docs/{doc} names files that do not exist: {missing}"


def test_no_test_skips_on_an_import_error_of_our_own_code():
    """A broken import of areal_fast must fail the suite, not show up as a skip."""
    hidden = re.compile(r"importorskip\(\s*[\"']areal_fast|except\s*\(?\s*(ImportError|ModuleNotFoundError)[^\n]*:\s*\n"
                        r"\s*pytest\.skip")
    tests = os.path.join(REPO, "tests")
    files = [os.path.join(d, f) for d, _, names in os.walk(tests) for f in names if f.endswith(".py")]
    assert len(files) > 50, f"found only {len(files)} test modules under {tests}"
    offenders = sorted(os.path.relpath(f, tests) for f in files if hidden.search(open(f).read()))
    assert offenders == [], f"these tests turn an ImportError into a skip: {offenders}"


MAX_MODULE_LINES = 600  # a file past this mixes concerns: split it by what it owns


def test_no_module_of_the_package_is_over_600_lines():
    pkg = os.path.join(REPO, "areal_fast")
    long = {}
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    n = sum(1 for _ in f)
                if n > MAX_MODULE_LINES:
                    long[os.path.relpath(path, REPO)] = n
    assert long == {}, f"over {MAX_MODULE_LINES} lines: {long}"
