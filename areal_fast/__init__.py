"""areal_fast: a performance layer and asynchronous controller for RL on reasoning LLMs.

Importing this package never touches a GPU and never fails on a machine without one: the
native core (`areal_fast._C`) and Triton are loaded lazily by `areal_fast.dispatch`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
