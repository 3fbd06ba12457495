"""The one place that decides which implementation runs each op.

Backends (``BACKENDS``, in the order automatic choice tries them):
  * ``cuda``      - CUDA kernels in the native extension ``areal_fast._C`` (built with nvcc);
  * ``triton``    - Triton kernels (``areal_fast.kernels``) compiled for a CUDA device;
  * ``native``    - C++ CPU code in ``areal_fast._C`` (planners, CPU interval copy);
  * ``interpret`` - the Triton kernels run by Triton's CPU interpreter (``TRITON_INTERPRET=1``);
  * ``reference`` - the pure-Python/PyTorch reference beside every fast path; always runs.

Automatic choice never picks ``interpret``: the interpreter exists to test kernels on machines
without a GPU and is about 1000x slower than the reference, so it runs only when asked for.

Every op and the backends it has, fastest first (``OPS``; docs/architecture.md has the table):

  ================================  =====================================  =======================
  op                                backends                               where
  ================================  =====================================  =======================
  ``ppo_loss``                      triton, interpret, reference           ops/ppo_loss.py,
                                                                           ops/fused_linear.py
  ``packing.pack`` / ``.unpack``    triton, interpret, reference           packing/segments.py
  ``packing.gather_segments`` /     triton, interpret, reference           packing/segments.py
  ``packing.scatter_segments``
  ``packing.plan``                  native, reference                      packing/planner.py
  ``weights.plan``                  native, reference                      weights/plan.py
  ``weights.interval_copy``         cuda, native, reference                weights/interval_copy.py
  ``weights.delta_encode`` /        triton, native, interpret, reference   weights/delta_codec.py
  ``weights.delta_apply``
  ================================  =====================================  =======================

Each public op takes ``backend=`` (None or ``"auto"``: choose) and calls :func:`select`.
``AREAL_FAST_BACKEND`` overrides the choice for ops called without ``backend=``:

  * ``AREAL_FAST_BACKEND=reference`` - every op that has the named backend must use it (every op
    has ``reference``); an op that does not have it at all chooses automatically, so
    ``AREAL_FAST_BACKEND=triton`` forces the loss and packing kernels and leaves the C++ planner;
  * ``AREAL_FAST_BACKEND=packing.plan=reference,ppo_loss=interpret`` - per op; a key also matches
    every op below it (``packing=reference`` covers ``packing.pack`` and ``packing.plan``);
    both forms mix: ``triton,packing.plan=reference``.

The variable keeps the word *backend* on purpose: in this package the word names an op's
implementation (the ops' ``backend=`` argument, ``BACKENDS`` here) and nothing else; the module is
called ``dispatch`` for what it does, the inference servers live in ``areal_fast/backends/`` (a
package, never a config key), and the config keys that once said "backend" were renamed
(``rollout.api``, ``weights.collective``, ``train.loss_impl``: ``areal_fast.config.RENAMED``).

A backend that is requested (argument, or the environment for an op that has it) and cannot run
raises :class:`BackendUnavailable` naming the op and the reason; automatic choice falls back down
the list, and warns once with the reason when the native core is missing (a broken install).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

BACKENDS = ("cuda", "triton", "native", "interpret", "reference")
ENV_VAR = "AREAL_FAST_BACKEND"

_KERNEL_BACKENDS = ("triton", "interpret", "reference")
OPS: dict[str, tuple[str, ...]] = {
    "ppo_loss": _KERNEL_BACKENDS,
    "packing.pack": _KERNEL_BACKENDS,
    "packing.unpack": _KERNEL_BACKENDS,
    "packing.gather_segments": _KERNEL_BACKENDS,
    "packing.scatter_segments": _KERNEL_BACKENDS,
    "packing.plan": ("native", "reference"),
    "weights.plan": ("native", "reference"),
    "weights.interval_copy": ("cuda", "native", "reference"),
    "weights.delta_encode": ("triton", "native", "interpret", "reference"),
    "weights.delta_apply": ("triton", "native", "interpret", "reference"),
}


# Native functions an op needs beyond the module itself: a core built from an older source lacks
# them, and the op then falls back (or, forced, says to rebuild) instead of an AttributeError.
NATIVE_SYMBOLS: dict[str, str] = {"weights.delta_encode": "delta_encode_cpu", "weights.delta_apply": "delta_apply_cpu"}


def _native_symbol_missing(op: str) -> str | None:
    sym = NATIVE_SYMBOLS.get(op)
    if sym is None or _native_import_error() is not None or hasattr(native(), sym):
        return None
    return f"areal_fast._C was built from an older source (no {sym}); rebuild the package"


class BackendUnavailable(RuntimeError):
    """A requested backend cannot run here (the message names the op and the reason)."""


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


def _native_import_error() -> str | None:
    try:
        native()
    except ImportError as e:
        return str(e)
    return None


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


def _check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or auto")


def why_unavailable(backend: str, device) -> str | None:
    """None if ``backend`` can run on ``device`` (a torch.device, 'cpu', 'cuda:0' or None = CPU),
    else the reason it cannot."""
    _check_backend_name(backend)
    dev = _device_type(device)
    if backend == "reference":
        return None
    if backend == "native":
        err = _native_import_error()
        if err is not None:
            return err
        if dev != "cpu":
            return f"tensors are on {dev!r}, the native C++ backend runs on CPU data"
        return None
    if backend == "cuda":
        if not native_has_cuda():
            return "areal_fast._C was built without CUDA (no nvcc at build time, or AREAL_FAST_CUDA=OFF)"
        if dev != "cuda":
            return f"tensors are on {dev!r}, the CUDA backend needs CUDA tensors"
        return None
    err = _triton_import_error()  # triton / interpret
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


def _parse_env(value: str) -> tuple[str, dict[str, str]]:
    """``AREAL_FAST_BACKEND`` -> (default backend or 'auto', {op prefix: backend})."""
    default, per_op = "auto", {}
    for part in value.split(","):
        part = part.strip().lower()
        if not part:
            continue
        key, sep, name = part.rpartition("=")
        key = key.strip()
        name = name.strip()
        if name != "auto" and name not in BACKENDS:
            raise BackendUnavailable(
                f"{ENV_VAR}={value!r}: {name!r} is not a backend; choose one of {', '.join(BACKENDS)} or auto"
            )
        if sep and not key:
            raise BackendUnavailable(f"{ENV_VAR}={value!r}: an entry {part!r} has no op name before '='")
        if sep:
            per_op[key] = name
        else:
            default = name
    return default, per_op


def requested(op: str | None = None) -> tuple[str, bool]:
    """What ``AREAL_FAST_BACKEND`` asks for ``op``: (backend or 'auto', whether it names this op).

    The longest matching per-op key wins (``packing.plan=`` over ``packing=``), else the bare value.
    """
    default, per_op = _parse_env(os.environ.get(ENV_VAR, ""))
    if op is not None:
        keys = [k for k in per_op if op == k or op.startswith(k + ".")]
        if keys:
            return per_op[max(keys, key=len)], True
    return default, False


@functools.cache
def _warn_fallback(op: str, backend: str, reason: str) -> None:
    warnings.warn(f"{op}: falling back from {backend!r} to a slower backend: {reason}", RuntimeWarning, stacklevel=3)


def select(op: str, device=None, available: tuple[str, ...] | None = None, backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device`` (a torch.device, 'cuda:0', or None for host data).

    ``available`` defaults to ``OPS[op]``. ``backend`` is the op's own ``backend=`` argument
    (None or 'auto': ``AREAL_FAST_BACKEND``, then automatic choice).
    """
    if available is None:
        if op not in OPS:
            raise ValueError(f"select: unknown op {op!r}; known ops: {', '.join(OPS)} (or pass available=)")
        available = OPS[op]
    for b in available:
        _check_backend_name(b)
    want = (backend or "auto").lower()
    source = "the backend= argument"
    if want == "auto":
        want, named = requested(op)
        source = f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}"
        if want != "auto" and want not in available and not named:
            want = "auto"  # a global override for a backend this op does not have
    if want != "auto":
        if want not in BACKENDS:
            raise BackendUnavailable(f"{op}: unknown backend {want!r}; choose one of {', '.join(BACKENDS)} or auto")
        if want not in available:
            raise BackendUnavailable(
                f"{op}: backend {want!r} was requested ({source}) but {op} has only {', '.join(available)}"
            )
        reason = why_unavailable(want, device) or (_native_symbol_missing(op) if want == "native" else None)
        if reason is not None:
            raise BackendUnavailable(f"{op}: backend {want!r} was requested ({source}) but cannot run: {reason}")
        return want
    reasons = []
    for b in BACKENDS:
        if b not in available or b == "interpret":
            continue
        reason = why_unavailable(b, device) or (_native_symbol_missing(op) if b == "native" else None)
        if reason is None:
            return b
        reasons.append(f"{b}: {reason}")
        if b == "native" and _native_import_error() is not None:
            _warn_fallback(op, b, reason)
    why = "; ".join(reasons) or "it has only 'interpret', which is never chosen automatically"
    raise BackendUnavailable(f"{op}: no backend can run here ({why})")


def describe() -> dict[str, str]:
    """What each backend would do on this machine, and what each op would run (``op:NAME``), for
    `areal-fast info` and bug reports."""
    dev = "cuda" if cuda_available() else "cpu"
    out = {b: (why_unavailable(b, dev) or "available") for b in BACKENDS}
    out["native"] = why_unavailable("native", "cpu") or "available"  # the C++ CPU code runs on host data
    for op, names in OPS.items():
        host_only = set(names) <= {"native", "reference"}  # planners: host data whatever the device
        try:
            out[f"op:{op}"] = select(op, None if host_only else dev)
        except BackendUnavailable as e:
            out[f"op:{op}"] = f"error: {e}"
    return out | {"device": dev}
