"""The default workflow: one completion of the prompt, one reward (the classic RL rollout)."""

from __future__ import annotations

from areal_fast.workflow.api import Trajectory


async def single_turn(row, engine) -> list[Trajectory]:
    """``row.text`` -> one generation -> ``engine.reward(row.task, text)``."""
    traj = Trajectory(prompt_ids=engine.encode_prompt(row.text))
    gen = await engine.generate(traj.prompt_ids)
    traj.add_model(gen)  # copies the turn's columns: the answer's own go before the reward's wait
    text = engine.decode(gen.output_ids)
    del gen
    res = await engine.reward(row.task, text)
    traj.reward = float(res.value)
    return [traj]
