"""Reward names a config can use: "math", "code", or "package.module:function".

A reward function takes ``(task: dict, completion: str)`` and returns a float (or bool/int)
or a `RewardResult`. Raising is fine: the service turns it into (0, error) and counts it.
Names are resolved inside the pool workers, so a custom function must be importable there
(the service gives its workers the parent's ``sys.path``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from .result import RewardResult

RewardFn = Callable[[dict, str], "float | RewardResult"]
BUILTIN = {
    "math": "areal_fast.reward.math:math_reward",
    "code": "areal_fast.reward.code:code_reward",
}


@functools.cache
def get_reward_fn(name: str) -> RewardFn:
    """The reward function called ``name``; raises ValueError naming what could not be found."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    spec = BUILTIN.get(name, name)
    if ":" not in spec:
        raise ValueError(f"unknown reward {name!r}: use one of {sorted(BUILTIN)} or 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {e}") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {spec} is not callable")
    return fn
