"""Import modules of a released SGLang wheel on a CPU-only machine, for contract tests.

SGLang needs CUDA to serve, but the code that judges our payloads (its request types, its
flattened-bucket unpacker, its argument parser) is plain Python. This helper (its cache, stubs and
version switching live in ``wheel_loader.py``, shared with ``vllm_wheel.py``):

1. installs ``sglang==VERSION`` with ``pip install --no-deps --target`` into
   ``~/.cache/areal_fast/sglang-VERSION`` (once; ``AREAL_FAST_SGLANG_CACHE`` moves the root),
   and a few pinned plain-CPU packages its request types need (:data:`CPU_DEPS`);
2. registers the package ``sglang`` without running its ``__init__.py`` (which imports the
   whole frontend and serving stack), so only the submodules a test asks for are loaded;
3. answers imports of GPU-only or uninstalled third-party packages with permissive stub
   modules (any attribute is a stub class), recording which ones were stubbed;
4. keeps one version active at a time: asking for another version moves the previous one's
   ``sglang.*`` entries out of ``sys.modules`` (and back in when it is asked for again).

API::

    mod = sglang_module("0.5.23", "sglang.srt.weight_sync.tensor_bucket")

returns the imported module, or calls ``pytest.skip`` with the reason when the wheel cannot be
downloaded. An import error *after* a successful install is a real failure and is raised.
Tests that use several versions should not interleave them inside one test: a module of the
inactive version may import lazily at call time and would then see the active version.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from wheel_loader import WheelPackage, cached_dir, run_pip, stubbed_modules

__all__ = ["sglang_module", "install_dir", "install_dir_or_skip", "deps_dir", "stubbed_modules", "CPU_DEPS"]

# Packages SGLang imports at module level that need a GPU (or are optional and heavy); they are
# stubbed even when installed, so a test never initialises a GPU runtime by accident.
GPU_ONLY = ("sgl_kernel", "flashinfer", "vllm", "deep_gemm", "deep_ep", "cuda", "pynvml", "nvidia",
            "flash_attn", "xgrammar", "llguidance", "outlines", "outlines_core", "decord", "torchao",
            "triton_kernels", "mooncake", "nixl", "aiter", "sgl_kernel_npu", "torch_npu", "habana_frameworks",
            "quack", "cutlass", "tilelang", "flashinfer_python", "mscclpp", "compressed_tensors", "gguf")

# Plain CPU packages SGLang's request types import at module level (``io_struct`` pulls in the
# scheduler's modules), pinned, installed once with ``--no-deps`` into a shared directory that is
# put at the *end* of sys.path: whatever the project's environment already has wins.
CPU_DEPS = ("dill==0.4.1", "orjson==3.13.0", "msgspec==0.22.0", "pybase64==1.5.1", "psutil==7.2.2",
            "pyzmq==27.3.0", "partial_json_parser==0.2.1.1.post7")

INSTALL_TIMEOUT_S = 600  # pip download of one wheel (40 MB) plus unpacking, on a slow link
_SGLANG = WheelPackage("sglang", "SGLang", GPU_ONLY)


def install_dir(version: str) -> Path:
    """The wheel's install directory (contains ``sglang/``), installing it on first use.

    Raises RuntimeError naming the version and pip's last lines when the install fails."""
    return _pip_target(f"sglang-{version}", [f"sglang=={version}"], must_have="sglang")


def deps_dir() -> Path:
    """The shared directory of :data:`CPU_DEPS`, installing them on first use."""
    import hashlib

    key = hashlib.sha1(" ".join(CPU_DEPS).encode()).hexdigest()[:8]
    return _pip_target(f"sglang-deps-{key}", list(CPU_DEPS), must_have="msgspec")


def _pip_target(name: str, requirements: list[str], must_have: str) -> Path:
    def fill(out: Path, _scratch: Path) -> str:
        run_pip(["install", "--no-deps", "--no-compile", "--target", str(out), *requirements],
                f"pip install --no-deps {' '.join(requirements)}", INSTALL_TIMEOUT_S)
        if not (out / must_have).is_dir():
            raise RuntimeError(f"pip install --no-deps {' '.join(requirements)} installed no {must_have}/")
        return " ".join(requirements) + "\n"

    return cached_dir(name, fill)


def install_dir_or_skip(version: str) -> Path:
    """:func:`install_dir`, or ``pytest.skip`` with the reason when the wheel cannot be installed
    (for tests that read the wheel's sources instead of importing them)."""
    try:
        return install_dir(version)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"SGLang {version} wheel not available: {e}")


def sglang_module(version: str, name: str) -> types.ModuleType:
    """Import ``name`` (e.g. ``"sglang.srt.managers.io_struct"``) from SGLang ``version``.

    Skips the calling test (``pytest.skip``) when the wheel cannot be installed; raises the
    import error (with the stubbed packages listed) when it is installed but does not import."""
    _SGLANG.check_name(name)
    try:
        root = install_dir(version)
        deps = str(deps_dir())
    except (RuntimeError, OSError) as e:
        pytest.skip(f"SGLang {version} wheel (or its CPU dependencies) not available: {e}")
    if deps not in sys.path:
        sys.path.append(deps)
    return _SGLANG.import_module(version, root, name)
