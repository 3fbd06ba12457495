"""Import the request types of a released vLLM wheel on a CPU-only machine, for contract tests.

vLLM needs a GPU to serve, but what judges our request bodies (the pydantic request types of its
OpenAI-compatible server, its argument parser's flag names) is plain Python. This helper, the
sibling of ``sglang_wheel.py`` (whose stub machinery it shares):

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

import importlib
import importlib.abc
import importlib.machinery
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import pytest
import sglang_wheel as _sw

__all__ = ["vllm_module", "source_dir", "source_dir_or_skip", "unknown_vllm_flags"]

GPU_ONLY = _sw.GPU_ONLY + ("vllm_flash_attn", "flashinfer", "triton", "xformers", "ray", "cupy", "nixl",
                           "deep_gemm", "lmcache", "mistral_common", "cbor2", "numba", "cv2", "soundfile",
                           "librosa", "gguf", "blake3", "setproctitle", "prometheus_client",
                           "prometheus_fastapi_instrumentator", "zmq", "uvloop", "watchfiles",
                           "model_hosting_container_standards")
# vLLM's own GPU runtime, imported by its config modules at module level (custom ops registered
# with torch.library at import time): stubbed like a GPU-only package. Request types do not use it.
RUNTIME_SUBPACKAGES = ("vllm.model_executor", "vllm.distributed", "vllm.platforms", "vllm.config")
DOWNLOAD_TIMEOUT_S = 900  # one wheel is 300-450 MB

_ACTIVE: str | None = None
_SAVED: dict[str, dict[str, types.ModuleType]] = {}


def _root(version: str) -> Path:
    return _sw._cache_root() / f"vllm-{version}"


def source_dir(version: str) -> Path:
    """The directory holding the wheel's ``vllm/`` Python sources, downloading them on first use.
    Raises RuntimeError naming the version and pip's last lines when the download fails."""
    target = _root(version)
    if (target / ".installed").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-", dir=target.parent if target.parent.is_dir() else None))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
               "-d", str(tmp / "wheel"), f"vllm=={version}"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download vllm=={version} took longer than {DOWNLOAD_TIMEOUT_S}s") from None
        wheels = list((tmp / "wheel").glob("vllm-*.whl"))
        if r.returncode != 0 or not wheels:
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"pip download --no-deps vllm=={version} failed (exit {r.returncode}): {tail}")
        out = tmp / "src"
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, out)
        (out / ".installed").write_text(f"vllm=={version} (Python sources only)\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            out.rename(target)
        except OSError:
            if not (target / ".installed").is_file():
                raise
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_dir_or_skip(version: str) -> Path:
    """:func:`source_dir`, or ``pytest.skip`` with the reason."""
    try:
        return source_dir(version)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"vLLM {version} wheel not available: {e}")


def unknown_vllm_flags(version: str, cmd: list[str]) -> list[str]:
    """The ``--flags`` of ``cmd`` that vLLM ``version``'s argument parser does not define (read from its
    sources: the explicit flags of its CLI modules, and the flags it derives from the field names of its
    engine-args dataclass). Skips when the wheel is not available."""
    import re

    root = source_dir_or_skip(version) / "vllm"
    text = "\n".join(p.read_text(encoding="utf-8") for p in
                     [*root.glob("engine/arg_utils.py"), *root.rglob("entrypoints/**/cli_args.py"),
                      *root.glob("utils/argparse_utils.py"), *root.glob("utils/__init__.py")])
    flags = [c.split("=", 1)[0] for c in cmd if c.startswith("--")]
    return [f for f in flags if f'"{f}"' not in text and not re.search(rf"\b{f[2:].replace('-', '_')}\b", text)]


class _VllmStubFinder(importlib.abc.MetaPathFinder):
    """Stubs for imports made by vLLM's modules: GPU-only packages always, others when missing."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if any(fullname == p or fullname.startswith(p + ".") for p in RUNTIME_SUBPACKAGES):
            return importlib.machinery.ModuleSpec(fullname, _sw._StubLoader(), is_package=True)
        if top == "vllm" or top.startswith("_"):
            return None
        if fullname != top:
            if isinstance(sys.modules.get(top), _sw._StubModule):
                return importlib.machinery.ModuleSpec(fullname, _sw._StubLoader(), is_package=True)
            return None
        if not _imported_by_vllm():
            return None
        if top in GPU_ONLY or not _sw._really_installed(top):
            return importlib.machinery.ModuleSpec(fullname, _sw._StubLoader(), is_package=True)
        return None


def _imported_by_vllm() -> bool:
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith("<frozen importlib")
                             or f.f_globals.get("__name__", "").startswith("importlib")):
        f = f.f_back
    return f is not None and str(f.f_globals.get("__name__", "")).startswith("vllm")


_FINDER = _VllmStubFinder()


def _activate(version: str, root: Path) -> None:
    global _ACTIVE
    if _ACTIVE == version:
        return
    if _ACTIVE is not None:
        _SAVED[_ACTIVE] = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "vllm" or k.startswith("vllm.")}
        old = str(_root(_ACTIVE))
        while old in sys.path:
            sys.path.remove(old)
    importlib.invalidate_caches()
    if version in _SAVED:
        sys.modules.update(_SAVED.pop(version))
    else:
        pkg = types.ModuleType("vllm")  # the package without its __init__ (the engine API, CUDA probes)
        pkg.__path__ = [str(root / "vllm")]
        pkg.__file__ = str(root / "vllm" / "__init__.py")
        pkg.__package__ = "vllm"
        pkg.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        pkg.__version__ = version
        sys.modules["vllm"] = pkg
    sys.path.insert(0, str(root))
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _ACTIVE = version


def vllm_module(version: str, name: str) -> types.ModuleType:
    """Import ``name`` (e.g. ``"vllm.entrypoints.openai.protocol"``) from vLLM ``version``; skips the
    test when the wheel cannot be downloaded, raises (with the stubbed packages) when it does not import."""
    if not name.startswith("vllm"):
        raise ValueError(f"vllm_module: {name!r} is not a module of the vllm package")
    try:
        root = source_dir(version)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"vLLM {version} wheel not available: {e}")
    import torch  # noqa: F401 - loaded before any stub exists, so nothing of torch's is stubbed

    _activate(version, root)
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise ImportError(f"importing {name} from vLLM {version} ({root}) failed: {type(e).__name__}: {e}; "
                          f"stubbed so far: {sorted(_sw.stubbed_modules())}") from e
