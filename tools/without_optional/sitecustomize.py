"""Make optional packages unimportable, as on the GPU image (no orjson, SGLang, flash-attn...).

Put this folder on ``PYTHONPATH`` and Python imports this file at start-up (``sitecustomize``):
every finder on ``sys.meta_path`` is wrapped so that ``NAME`` and ``NAME.sub`` are not found
(``import`` raises ``ModuleNotFoundError``, ``importlib.util.find_spec`` returns None, as for a
package that is not installed) for each name in ``AREAL_FAST_BLOCK_IMPORTS`` (comma-separated;
default :data:`DEFAULT_BLOCKED`), even where the package is installed. ``tools/gpu_suite.py --dry-run --deep``
and ``tests/tools/test_collect_without_optional.py`` collect the GPU tests this way, so a test module
that needs an optional package to be imported fails here, not on the GPU machine.
"""

import os
import sys

# optional extras the GPU image lacks (orjson, SGLang, flash-attn are known absent there)
DEFAULT_BLOCKED = "orjson,sglang,flash_attn,vllm,ray,liger_kernel,uvloop,math_verify"


def _blocked(fullname: str) -> bool:
    return fullname.partition(".")[0] in _NAMES


class _Hiding:
    """Wraps one finder of ``sys.meta_path``: blocked names are not found (``find_spec`` gives
    None, as for a package that is not installed), everything else goes to the wrapped finder."""

    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, fullname, path=None, target=None):
        if _blocked(fullname):
            return None
        find = getattr(self._inner, "find_spec", None)
        return None if find is None else find(fullname, path, target)

    def __getattr__(self, name):  # invalidate_caches, find_distributions, ...
        return getattr(self._inner, name)


_NAMES = frozenset(n.strip() for n in os.environ.get("AREAL_FAST_BLOCK_IMPORTS", DEFAULT_BLOCKED).split(",")
                   if n.strip())
for _n in list(sys.modules):
    if _blocked(_n):
        del sys.modules[_n]
sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
