"""Import the request types of a released vLLM wheel on a CPU-only machine, for contract tests.

vLLM needs a GPU to serve, but what judges our request bodies (the pydantic request types of its
OpenAI-compatible server, its argument parser's flag names) is plain Python. This helper, the
sibling of ``sglang_wheel.py`` (both build on ``wheel_loader.py``: the cache, the stubs, the versions):

1. downloads ``vllm==VERSION`` once with ``pip download --no-deps`` and keeps only the wheel's
   ``vllm/**/*.py`` files in ``~/.cache/areal_fast/vllm-VERSION`` (``AREAL_FAST_SGLANG_CACHE`` moves
   the root, as for SGLang): no compiled extension is kept, so nothing of it can be loaded by accident;
2. registers the package ``vllm`` without running its ``__init__.py`` (which builds the engine
   API and imports torch's CUDA parts), so only the submodules a test asks for are loaded;
3. answers imports made by vLLM's own modules of packages that are not installed (and of GPU-only
   ones) with permissive stub modules, as ``sglang_wheel`` does;
4. keeps one version active at a time (the other's ``vllm.*`` modules are set aside).

API::

    mod = vllm_module("0.33.0", "vllm.entrypoints.openai.completion.protocol")

returns the module, or ``pytest.skip`` with the reason when the wheel cannot be downloaded. An
import error after a successful download is a real failure and is raised.
"""

from __future__ import annotations

import types
import zipfile
from pathlib import Path

import pytest
import sglang_wheel
from wheel_loader import WheelPackage, cached_dir, run_pip

__all__ = ["vllm_module", "vllm_source_module", "source_dir", "source_dir_or_skip", "unknown_vllm_flags"]

GPU_ONLY = sglang_wheel.GPU_ONLY + ("vllm_flash_attn", "flashinfer", "triton", "xformers", "ray", "cupy", "nixl",
                                    "deep_gemm", "lmcache", "mistral_common", "cbor2", "numba", "cv2", "soundfile",
                                    "librosa", "gguf", "blake3", "setproctitle", "prometheus_client",
                                    "prometheus_fastapi_instrumentator", "zmq", "uvloop", "watchfiles",
                                    "model_hosting_container_standards")
# vLLM's own GPU runtime, imported by its config modules at module level (custom ops registered
# with torch.library at import time): stubbed like a GPU-only package. Request types do not use it.
RUNTIME_SUBPACKAGES = ("vllm.model_executor", "vllm.distributed", "vllm.platforms", "vllm.config")
DOWNLOAD_TIMEOUT_S = 900  # one wheel is 300-450 MB

_VLLM = WheelPackage("vllm", "vLLM", GPU_ONLY, RUNTIME_SUBPACKAGES)


def source_dir(version: str) -> Path:
    """The directory holding the wheel's ``vllm/`` Python sources, downloading them on first use.
    Raises RuntimeError naming the version and pip's last lines when the download fails."""

    def fill(out: Path, scratch: Path) -> str:
        run_pip(["download", "--no-deps", "-d", str(scratch), f"vllm=={version}"],
                f"pip download --no-deps vllm=={version}", DOWNLOAD_TIMEOUT_S)
        wheels = list(scratch.glob("vllm-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download --no-deps vllm=={version} left no vllm-*.whl in {scratch}")
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, out)
        return f"vllm=={version} (Python sources only)\n"

    return cached_dir(f"vllm-{version}", fill)


def source_dir_or_skip(version: str) -> Path:
    """:func:`source_dir`, or ``pytest.skip`` with the reason."""
    try:
        return source_dir(version)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"vLLM {version} wheel not available: {e}")


def unknown_vllm_flags(version: str, cmd: list[str]) -> list[str]:
    """The ``--flags`` of ``cmd`` that vLLM ``version``'s argument parser does not define, read from its
    sources: a flag is known when its exact spelling is a string there (the explicit flags of its CLI
    modules) or its name with ``_`` for ``-`` is exactly a field of one of the dataclasses vLLM derives
    flags from (a 4-space indented ``name:`` in those modules). Not a word search: ``--load`` (a
    prefix of --load-format, which argparse would even accept) and SGLang's ``--model-path`` are
    unknown. ``--no-X`` is known where ``X`` is a boolean field (vLLM gives those argparse's
    ``BooleanOptionalAction``, which adds the negation). Skips when the wheel is not available."""
    import re

    root = source_dir_or_skip(version) / "vllm"
    text = "\n".join(p.read_text(encoding="utf-8") for p in
                     [*root.glob("engine/arg_utils.py"), *root.rglob("entrypoints/**/cli_args.py"),
                      *root.glob("utils/argparse_utils.py"), *root.glob("utils/__init__.py")])
    fields = set(re.findall(r"^    (\w+)\s*:", text, re.M))
    booleans = set(re.findall(r"^    (\w+)\s*:\s*(?:bool\b|Optional\[bool\])", text, re.M))
    flags = [c.split("=", 1)[0] for c in cmd if c.startswith("--")]
    return [f for f in flags if f'"{f}"' not in text and f[2:].replace("-", "_") not in fields
            and not (f.startswith("--no-") and f[5:].replace("-", "_") in booleans)]


def vllm_module(version: str, name: str) -> types.ModuleType:
    """Import ``name`` (e.g. ``"vllm.entrypoints.openai.protocol"``) from vLLM ``version``; skips the
    test when the wheel cannot be downloaded, raises (with the stubbed packages) when it does not import."""
    _VLLM.check_name(name)
    root = source_dir_or_skip(version)
    return _VLLM.import_module(version, root, name)


def vllm_source_module(version: str, name: str) -> types.ModuleType:
    """Run one module of vLLM ``version``'s runtime subpackages (``RUNTIME_SUBPACKAGES``, stubbed for
    imports) from its source file, and register it under its name, so the modules imported after it
    that import it get it and not a stub. For modules whose own imports are torch and the stdlib, or
    stubs where the code a test runs does not use them (the sparse weight-transfer engine's receive and
    ``checkpoint_weight_patch``); skips when the wheel cannot be downloaded."""
    import importlib.util
    import sys

    import torch  # noqa: F401 - loaded before any stub exists

    _VLLM.check_name(name)
    root = source_dir_or_skip(version)
    _VLLM.activate(version, root)
    path = root / (name.replace(".", "/") + ".py")
    if getattr(sys.modules.get(name), "__file__", None) == str(path):  # run already (stubs have no file)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules[name]
        raise ImportError(f"running {path} (vLLM {version}) failed: {type(e).__name__}: {e}") from e
    finally:
        _VLLM._unlist_stubs()
    return mod
