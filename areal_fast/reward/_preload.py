"""Imported once by the forkserver that forks the reward workers, so each worker starts warm.

sympy + math-verify take ~1-2 s to import and their first parse ~0.3 s more (grammar setup);
the sandbox probe ~0.1-1 s. Done here once, every worker forked afterwards inherits it in ~10 ms.
The forkserver dies on any exception other than ImportError during preload, hence the guard.
"""

try:
    from .math import math_equal
    from .sandbox import isolation

    math_equal("\\boxed{\\frac{1}{2}}", "\\sqrt{1/4}")
    isolation()
except Exception:  # pragma: no cover - a worker then simply warms up on its first call
    pass
