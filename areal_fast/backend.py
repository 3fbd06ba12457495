"""One place that decides which implementation runs each op.

Backends, fastest first:
  * ``cuda``      - CUDA kernels in the native extension ``areal_fast._C`` (built with nvcc);
  * ``triton``    - Triton kernels (``areal_fast.kernels``) compiled for a CUDA device;
  * ``interpret`` - the same Triton kernels run by Triton's CPU interpreter
                    (``TRITON_INTERPRET=1``; slow, for tests on machines without a GPU);
  * ``reference`` - the pure-PyTorch reference beside every fast path.

``AREAL_FAST_BACKEND`` forces one backend for every op (``auto`` or unset: choose). A
backend that is requested explicitly and cannot run raises :class:`BackendUnavailable`
naming what is missing; automatic choice falls back silently down the list.

Ops declare which backends they have with ``select(op, device, available=...)``.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

BACKENDS = ("cuda", "triton", "interpret", "reference")
ENV_VAR = "AREAL_FAST_BACKEND"


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here."""


@functools.cache
def native() -> ModuleType:
    """The compiled core ``areal_fast._C``; raises ImportError with a fix if it is missing."""
    try:
        return importlib.import_module("areal_fast._C")
    except ImportError as e:  # pragma: no cover - depends on how the package was installed
        raise ImportError(
            "areal_fast._C (the native core) is not built. Install the package with "
            "`pip install .` or `pip install -e .` from the repository root; importing from a "
            f"source tree without building does not work. ({e})"
        ) from e


def native_has_cuda() -> bool:
    """True when the native core was compiled with its CUDA sources."""
    try:
        return bool(native().has_cuda())
    except ImportError:
        return False


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything
        return f"{type(e).__name__}: {e}"
    return None


def triton_available() -> bool:
    return _triton_import_error() is None


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (read at kernel definition time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _device_type(device) -> str:
    if device is None:
        return "cpu"
    return getattr(device, "type", None) or str(device).split(":")[0]


def why_unavailable(backend: str, device) -> str | None:
    """None if ``backend`` can run on ``device``, else the reason it cannot."""
    dev = _device_type(device)
    if backend == "reference":
        return None
    if backend == "cuda":
        if not native_has_cuda():
            return "areal_fast._C was built without CUDA (no nvcc at build time, or AREAL_FAST_CUDA=OFF)"
        if dev != "cuda":
            return f"tensors are on {dev!r}, the CUDA backend needs CUDA tensors"
        return None
    if backend in ("triton", "interpret"):
        err = _triton_import_error()
        if err is not None:
            return f"Triton is not importable ({err}); install with `pip install areal_fast[triton]`"
        if backend == "triton":
            if interpreter_enabled():
                return "TRITON_INTERPRET=1 is set, so Triton runs in the interpreter; use 'interpret'"
            if dev != "cuda":
                return f"tensors are on {dev!r}, compiled Triton kernels need a CUDA device"
            return None
        if not interpreter_enabled():
            return "set TRITON_INTERPRET=1 before importing triton to use the Triton interpreter"
        if dev != "cpu":
            return f"the Triton interpreter runs on CPU tensors, got {dev!r}"
        return None
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'")


def requested() -> str:
    """The backend forced by ``AREAL_FAST_BACKEND`` ('auto' when unset)."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value != "auto" and value not in BACKENDS:
        raise BackendUnavailable(
            f"{ENV_VAR}={value!r} is not a backend; choose one of {', '.join(BACKENDS)} or auto"
        )
    return value


def select(op: str, device=None, available: tuple[str, ...] = BACKENDS, override: str | None = None) -> str:
    """Pick the backend for ``op`` on ``device`` among the ones the op implements.

    ``override`` (an op's ``backend=`` argument) wins over ``AREAL_FAST_BACKEND``.
    """
    want = (override or requested()).lower()
    if want != "auto":
        if want not in available:
            raise BackendUnavailable(
                f"{op}: backend {want!r} was requested but {op} has only {', '.join(available)}"
            )
        reason = why_unavailable(want, device)
        if reason is not None:
            raise BackendUnavailable(f"{op}: backend {want!r} was requested but cannot run: {reason}")
        return want
    for b in BACKENDS:
        if b in available and why_unavailable(b, device) is None:
            return b
    return "reference"


def describe() -> dict[str, str]:
    """What each backend would do on this machine (for `areal-fast info` and bug reports)."""
    dev = "cuda" if cuda_available() else "cpu"
    return {b: (why_unavailable(b, dev) or "available") for b in BACKENDS} | {"device": dev}
