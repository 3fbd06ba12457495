"""Import modules of a released SGLang wheel on a CPU-only machine, for contract tests.

SGLang needs CUDA to serve, but the code that judges our payloads (its request types, its
flattened-bucket unpacker, its argument parser) is plain Python. This helper:

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

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

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

_ACTIVE: str | None = None
_SAVED: dict[str, dict[str, types.ModuleType]] = {}  # version -> its sglang.* modules while inactive
_STUBBED: set[str] = set()
INSTALL_TIMEOUT_S = 600  # pip download of one wheel (40 MB) plus unpacking, on a slow link


def _cache_root() -> Path:
    return Path(os.environ.get("AREAL_FAST_SGLANG_CACHE", Path.home() / ".cache" / "areal_fast"))


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
    target = _cache_root() / name
    marker = target / ".installed"
    if marker.is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
           "--quiet", "--target", str(tmp), *requirements]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"pip install {' '.join(requirements)} took longer than {INSTALL_TIMEOUT_S}s") from None
    if r.returncode != 0 or not (tmp / must_have).is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"pip install --no-deps {' '.join(requirements)} failed (exit {r.returncode}): {tail}")
    (tmp / ".installed").write_text(" ".join(requirements) + "\n")
    try:
        tmp.rename(target)  # atomic; a concurrent installer that won the race is just as good
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.is_file():
            raise
    return target


def install_dir_or_skip(version: str) -> Path:
    """:func:`install_dir`, or ``pytest.skip`` with the reason when the wheel cannot be installed
    (for tests that read the wheel's sources instead of importing them)."""
    try:
        return install_dir(version)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"SGLang {version} wheel not available: {e}")


# ----------------------------------------------------------------------------- stubs


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__name__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __bool__(cls):
        return False


class _StubBase(metaclass=_StubMeta):
    """Stands for any class, function, decorator or constant of a stubbed package."""

    def __init__(self, *args, **kwargs):
        self._args = args

    def __init_subclass__(cls, **kwargs):  # e.g. ``class X(msgspec.Struct, kw_only=True)``
        super().__init_subclass__()

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # a field typed with a stub accepts anything
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __call__(self, *args, **kwargs):
        # used as a decorator (``@stub.jit``, ``@stub.jit(...)``): hand the function back
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _StubBase()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StubBase()

    def __getitem__(self, item):
        return _StubBase()

    def __bool__(self):
        return False


def _stub_class(name: str) -> type:
    return _StubMeta(name.rsplit(".", 1)[-1], (_StubBase,), {"__module__": name.rsplit(".", 1)[0]})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []  # a package, so ``import stub.sub`` works too
        mod.__version__ = "0.0.0"
        return mod

    def exec_module(self, module):
        _STUBBED.add(module.__name__)


class _StubFinder(importlib.abc.MetaPathFinder):
    """Stubs, for imports made by SGLang's own modules only: the GPU-only packages always, and
    any other top-level package that is not installed. Imports made by torch or anything else
    (optional probes such as ``try: import dill``) are never answered with a stub."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top == "sglang" or top.startswith("_"):
            return None
        if fullname != top:
            if isinstance(sys.modules.get(top), _StubModule):
                return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
            return None
        if not _imported_by_sglang():
            return None
        if top in GPU_ONLY or not _really_installed(top):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def _imported_by_sglang() -> bool:
    """Is the innermost frame outside the import machinery a module of the sglang package?"""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith("<frozen importlib")
                             or f.f_globals.get("__name__", "").startswith("importlib")):
        f = f.f_back
    return f is not None and str(f.f_globals.get("__name__", "")).startswith("sglang")


def _really_installed(top: str) -> bool:
    for finder in sys.meta_path:
        if isinstance(finder, _StubFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            if finder.find_spec(top, None) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


_FINDER = _StubFinder()


def stubbed_modules() -> set[str]:
    """Names of the modules answered with stubs so far (for messages and debugging)."""
    return set(_STUBBED)


# ----------------------------------------------------------------------------- versions


def _activate(version: str, root: Path) -> None:
    global _ACTIVE
    if _ACTIVE == version:
        return
    if _ACTIVE is not None:
        _SAVED[_ACTIVE] = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "sglang" or
                           k.startswith("sglang.")}
        old = str(_cache_root() / f"sglang-{_ACTIVE}")
        while old in sys.path:
            sys.path.remove(old)
    importlib.invalidate_caches()
    if version in _SAVED:
        sys.modules.update(_SAVED.pop(version))
    else:
        pkg = types.ModuleType("sglang")  # the package without its __init__ (frontend + server imports)
        pkg.__path__ = [str(root / "sglang")]
        pkg.__file__ = str(root / "sglang" / "__init__.py")
        pkg.__package__ = "sglang"
        pkg.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        pkg.__version__ = version
        sys.modules["sglang"] = pkg
    sys.path.insert(0, str(root))
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _ACTIVE = version


def sglang_module(version: str, name: str) -> types.ModuleType:
    """Import ``name`` (e.g. ``"sglang.srt.managers.io_struct"``) from SGLang ``version``.

    Skips the calling test (``pytest.skip``) when the wheel cannot be installed; raises the
    import error (with the stubbed packages listed) when it is installed but does not import."""
    if not name.startswith("sglang"):
        raise ValueError(f"sglang_module: {name!r} is not a module of the sglang package")
    try:
        root = install_dir(version)
        deps = str(deps_dir())
    except (RuntimeError, OSError) as e:
        pytest.skip(f"SGLang {version} wheel (or its CPU dependencies) not available: {e}")
    if deps not in sys.path:
        sys.path.append(deps)
    import torch  # noqa: F401 - loaded before any stub exists, so nothing of torch's is stubbed

    _activate(version, root)
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise ImportError(f"importing {name} from SGLang {version} ({root}) failed: {type(e).__name__}: {e}; "
                          f"stubbed so far: {sorted(_STUBBED)}") from e
