"""What ``sglang_wheel.py`` and ``vllm_wheel.py`` share: a cache of released wheels and a loader
that imports a package's submodules on a CPU-only machine.

- :func:`cached_dir` fills a directory under :func:`cache_root` once (in a scratch directory renamed
  into place, so a concurrent or interrupted fill never leaves half a cache); :func:`run_pip` runs
  pip and turns a failure into a RuntimeError with pip's last lines.
- :class:`WheelPackage` registers a package (``sglang``, ``vllm``) without running its ``__init__.py``,
  answers the imports its own modules make of GPU-only or uninstalled packages with permissive stub
  modules (any attribute is a stub class), and keeps one version active at a time: asking for another
  moves the previous one's modules out of ``sys.modules`` (and back in when it is asked for again).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

__all__ = ["cache_root", "cached_dir", "run_pip", "WheelPackage", "stubbed_modules"]

_STUBBED: set[str] = set()


def cache_root() -> Path:
    """Where the wheels are kept: ``~/.cache/areal_fast``, or ``AREAL_FAST_SGLANG_CACHE``."""
    return Path(os.environ.get("AREAL_FAST_SGLANG_CACHE", Path.home() / ".cache" / "areal_fast"))


def cached_dir(name: str, fill: Callable[[Path, Path], str]) -> Path:
    """``cache_root() / name``, filled on first use by ``fill(out, scratch)``: it writes the directory's
    content into ``out`` (which it may create), may use ``scratch`` freely, and returns the text of the
    ``.installed`` marker. ``out`` is then renamed into place (atomic; a concurrent filler that won the
    race is just as good)."""
    target = cache_root() / name
    marker = target / ".installed"
    if marker.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=target.parent))
    try:
        out = tmp / "out"
        text = fill(out, tmp / "scratch")
        (out / ".installed").write_text(text)
        try:
            out.rename(target)
        except OSError:
            if not marker.is_file():
                raise
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_pip(args: list[str], what: str, timeout_s: float) -> None:
    """``python -m pip ARGS --quiet``; raises RuntimeError naming ``what`` (the command, without its
    scratch paths) and pip's last lines."""
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--quiet"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} took longer than {timeout_s}s") from None
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{what} failed (exit {r.returncode}): {tail}")


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


def _stub_spec(fullname: str) -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


class _StubFinder(importlib.abc.MetaPathFinder):
    """Stubs, for imports made by ``package``'s own modules only: the ``gpu_only`` packages always, and
    any other top-level package that is not installed. Imports made by torch or anything else (optional
    probes such as ``try: import dill``) are never answered with a stub. ``runtime_subpackages`` (parts
    of the package itself that need a GPU at import time) are stubbed for every importer."""

    def __init__(self, package: str, gpu_only: tuple[str, ...], runtime_subpackages: tuple[str, ...]):
        self.package = package
        self.gpu_only = gpu_only
        self.runtime_subpackages = runtime_subpackages

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if any(fullname == p or fullname.startswith(p + ".") for p in self.runtime_subpackages):
            return _stub_spec(fullname)
        if top == self.package or top.startswith("_"):
            return None
        if fullname != top:
            return _stub_spec(fullname) if isinstance(sys.modules.get(top), _StubModule) else None
        if not _imported_by(self.package):
            return None
        if top in self.gpu_only or not _really_installed(top):
            return _stub_spec(fullname)
        return None


def _imported_by(package: str) -> bool:
    """Is the innermost frame outside the import machinery a module of ``package``? (Called from
    ``find_spec``: frame 2 is the import machinery's.)"""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith("<frozen importlib")
                             or f.f_globals.get("__name__", "").startswith("importlib")):
        f = f.f_back
    return f is not None and str(f.f_globals.get("__name__", "")).startswith(package)


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


def stubbed_modules() -> set[str]:
    """Names of the modules answered with stubs so far (for messages and debugging)."""
    return set(_STUBBED)


# ----------------------------------------------------------------------------- versions


_PACKAGES: list[WheelPackage] = []  # every package loaded so far; at most one is active


class WheelPackage:
    """One package (``sglang``, ``vllm``) loaded from unpacked wheels, one version active at a time."""

    def __init__(self, package: str, label: str, gpu_only: tuple[str, ...],
                 runtime_subpackages: tuple[str, ...] = ()):
        self.package = package
        self.label = label  # for messages: "SGLang", "vLLM"
        self._finder = _StubFinder(package, gpu_only, runtime_subpackages)
        self._active: tuple[str, Path] | None = None  # (version, root)
        self._saved: dict[str, dict[str, types.ModuleType]] = {}  # version -> its modules while inactive

    def _owns(self, module_name: str) -> bool:
        return module_name == self.package or module_name.startswith(self.package + ".")

    def _set_aside(self) -> None:
        """Move the active version's modules (stubs of its runtime included) out of ``sys.modules``."""
        old_version, old_root = self._active
        # its stubs go with it (a stub made for one package's imports, e.g. msgspec's, must not be
        # the one another package's modules find: each gets fresh ones)
        self._saved[old_version] = {k: sys.modules.pop(k) for k in list(sys.modules)
                                    if self._owns(k) or isinstance(sys.modules[k], _StubModule)}
        while str(old_root) in sys.path:
            sys.path.remove(str(old_root))
        self._active = None

    def deactivate(self) -> None:
        """Set this package aside entirely (its modules and its stub finder), so that another
        package's modules importing it (SGLang probes ``vllm``) see it as not installed."""
        if self._active is not None:
            self._set_aside()
        while self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)

    def activate(self, version: str, root: Path) -> None:
        """Make ``root`` (which holds ``<package>/``) the source of ``import <package>.*``; any other
        wheel package is set aside first (two at once leak into each other's imports)."""
        for other in _PACKAGES:
            if other is not self:
                other.deactivate()
        if self not in _PACKAGES:
            _PACKAGES.append(self)
        if self._active is not None and self._active[0] == version:
            return
        if self._active is not None:
            self._set_aside()
        importlib.invalidate_caches()
        # inspect caches each module name's file: another version's file under the same name (a package
        # in one release, a namespace package without a file in the other) makes inspect.getmodule, which
        # torch calls when a wheel registers an op, raise "is a built-in module"
        import inspect

        for cache in (inspect._filesbymodname, inspect.modulesbyfile):
            for k, v in list(cache.items()):
                if self._owns(k if cache is inspect._filesbymodname else v):
                    del cache[k]
        if version in self._saved:
            sys.modules.update(self._saved.pop(version))
        else:
            sys.modules[self.package] = self._bare_package(version, root)
        sys.path.insert(0, str(root))
        if self._finder not in sys.meta_path:
            sys.meta_path.insert(0, self._finder)
        self._active = (version, root)

    def _bare_package(self, version: str, root: Path) -> types.ModuleType:
        """The package without its ``__init__`` (which imports the serving stack and probes CUDA)."""
        pkg = types.ModuleType(self.package)
        pkg.__path__ = [str(root / self.package)]
        pkg.__file__ = str(root / self.package / "__init__.py")
        pkg.__package__ = self.package
        pkg.__spec__ = importlib.machinery.ModuleSpec(self.package, None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        pkg.__version__ = version
        return pkg

    def check_name(self, name: str) -> None:
        if not name.startswith(self.package):
            raise ValueError(f"{self.package}_module: {name!r} is not a module of the {self.package} package")

    def import_module(self, version: str, root: Path, name: str) -> types.ModuleType:
        """Import ``name`` from the wheel unpacked at ``root``; raises ImportError (with the stubbed
        packages listed) when it does not import."""
        import torch  # noqa: F401 - loaded before any stub exists, so nothing of torch's is stubbed

        self.activate(version, root)
        try:
            with _first_custom_op_wins():
                return importlib.import_module(name)
        except Exception as e:
            raise ImportError(f"importing {name} from {self.label} {version} ({root}) failed: "
                              f"{type(e).__name__}: {e}; stubbed so far: {sorted(_STUBBED)}") from e
        finally:
            self._unlist_stubs()

    def _unlist_stubs(self) -> None:
        """Take the stubs of other packages out of ``sys.modules`` once an import is done: the wheel's
        modules keep the stubs they imported (and get new ones on a later import), while the rest of the
        process, which looks modules up by name (matplotlib reads ``sys.modules['IPython']``'s version),
        never meets a stub. The package's own runtime stubs stay: they answer every importer."""
        for k in [k for k, m in sys.modules.items() if isinstance(m, _StubModule) and not self._owns(k)]:
            del sys.modules[k]


@contextlib.contextmanager
def _first_custom_op_wins():
    """While a wheel's modules import: a torch custom op that another version of the package registered
    already in this process (SGLang 0.5.23 defines ``sglang::fp4_gemm`` with its own helper, 0.5.6 with
    ``torch.library.custom_op``) keeps the first definition instead of failing the import. The ops are
    GPU kernels the contract tests never run; what they judge is plain Python."""
    import torch

    real_custom_op, real_register_fake = torch.library.custom_op, torch.library.register_fake

    def defined(name) -> bool:
        if not isinstance(name, str) or "::" not in name:
            return False
        ns, _, op = name.partition("::")
        try:
            return hasattr(getattr(torch.ops, ns), op.split(".")[0])
        except (AttributeError, RuntimeError):
            return False

    def custom_op(name, fn=None, /, **kw):
        if defined(name):
            return fn if fn is not None else (lambda f: f)
        return real_custom_op(name, fn, **kw) if fn is not None else real_custom_op(name, **kw)

    def register_fake(op, fn=None, /, **kw):
        def register(f):
            try:
                return real_register_fake(op, f, **kw)
            except RuntimeError:  # the op's first definition has its fake already
                return f
        return register(fn) if fn is not None else register

    torch.library.custom_op, torch.library.register_fake = custom_op, register_fake
    try:
        yield
    finally:
        torch.library.custom_op, torch.library.register_fake = real_custom_op, real_register_fake

