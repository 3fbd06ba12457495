"""Rollout workflows: episodes of one or more model turns, tools and rewards (``docs/workflows.md``)."""

from areal_fast.workflow.api import (
    DEFAULT_WORKFLOW,
    EpisodeFailed,
    ToolResult,
    Trajectory,
    check_trajectories,
    load_workflow,
)
from areal_fast.workflow.engine import EpisodeEngine
from areal_fast.workflow.single_turn import single_turn

__all__ = ["DEFAULT_WORKFLOW", "EpisodeEngine", "EpisodeFailed", "ToolResult", "Trajectory",
           "check_trajectories", "load_workflow", "single_turn"]
