"""Triton kernels of areal_fast, installed as ``areal_fast.kernels``.

Importing this package does not import Triton; each kernel module does, and the backend
selector (``areal_fast.dispatch``) only imports them when Triton is usable.

Run from a checkout (the checkout's root on ``sys.path``: ``python -m pytest``, an editable
install), this folder is also importable as a top-level ``kernels``, the name of Hugging Face's
kernel hub package, which transformers imports when it is installed. Imported under that name,
it steps aside when there is a module of that name further along ``sys.path``, which takes its
place; with none, it stays (a package without a version, which transformers does not take for
Hugging Face's).
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _here]  # every spelling of the checkout
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import system returns what sys.modules holds at the end
        _spec.loader.exec_module(_module)
