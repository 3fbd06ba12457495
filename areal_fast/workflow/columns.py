"""Moved to :mod:`areal_fast.columns` (below the sample record, which the rollout client imports
without the workflow package); this name stays for workflows that import it."""

from areal_fast.columns import *  # noqa: F403
from areal_fast.columns import __all__  # noqa: F401
