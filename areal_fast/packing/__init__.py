"""Dynamic sequence packing: the micro-batch planner and the varlen pack/unpack ops."""

from areal_fast.packing.planner import DEFAULT_ATTN_COEF, Plan, lower_bound_mbs, plan_microbatches
from areal_fast.packing.planner_ref import (
    first_fit_decreasing_ref,
    karmarkar_karp_ref,
    plan_microbatches_ref,
)

__all__ = [
    "DEFAULT_ATTN_COEF",
    "Plan",
    "first_fit_decreasing_ref",
    "karmarkar_karp_ref",
    "lower_bound_mbs",
    "plan_microbatches",
    "plan_microbatches_ref",
]
