"""Lazy package exports: a name is imported from its submodule on first use, so that a package's
torch-free parts (its config) can be imported without importing torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``exports`` map public names to submodules.
    A loaded name is stored in ``namespace`` (the package's globals) so it is looked up only once."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
