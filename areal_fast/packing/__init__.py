"""Dynamic sequence packing: the micro-batch planner and the varlen pack/unpack ops."""

from areal_fast.packing.context_split import ContextSplit, context_split
from areal_fast.packing.plan import DEFAULT_ATTN_COEF, Plan, lower_bound_mbs
from areal_fast.packing.planner import plan_microbatches
from areal_fast.packing.planner_ref import (
    first_fit_decreasing_ref,
    karmarkar_karp_ref,
    plan_microbatches_ref,
)
from areal_fast.packing.segments import (
    gather_segments,
    gather_segments_ref,
    pack,
    pack_ref,
    scatter_segments,
    scatter_segments_ref,
    unpack,
    unpack_ref,
)

__all__ = [
    "DEFAULT_ATTN_COEF",
    "ContextSplit",
    "context_split",
    "Plan",
    "gather_segments",
    "gather_segments_ref",
    "pack",
    "pack_ref",
    "scatter_segments",
    "scatter_segments_ref",
    "unpack",
    "unpack_ref",
    "first_fit_decreasing_ref",
    "karmarkar_karp_ref",
    "lower_bound_mbs",
    "plan_microbatches",
    "plan_microbatches_ref",
]
