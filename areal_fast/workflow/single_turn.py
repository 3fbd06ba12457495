"""The default workflow: one completion of the prompt, one reward (the classic RL rollout)."""

from __future__ import annotations

from areal_fast.workflow.api import Trajectory


async def single_turn(row, engine) -> list[Trajectory]:
    """``row.text`` -> one generation -> ``engine.reward(row.task, text)``. The sample the rollout
    client filled is the trajectory: it reaches the trainer as the same object."""
    sample = await engine.generate(engine.encode_prompt(row.text))
    res = await engine.reward(row.task, engine.decode(sample.output_ids))
    sample.reward = float(res.value)
    return [sample]
