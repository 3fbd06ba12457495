"""Tool-use task: multiply numbers with a calculator the tiny model must learn to call.

A first turn that contains the operator '*' is a call: the calculator reads it right to left
(the reversal task's order, so a model warm-started on reversal writes calls naturally) and its
result, appended as tool output (loss mask 0), is the episode's answer. A turn without '*' is a
direct answer. The model cannot multiply in its head; it gets the product by calling the tool
with the right expression::

    <bos> 7*34=  43*7<eos>  238        reward 1 (the calculator read 7*34)
    prompt       turn: call tool

    <bos> 7*34=  432<eos>              reward: partial credit of "432" against "238"
    prompt       turn: answer

The warm-started model writes a call about half the time and gets the expression right rarely
at first; RL makes it call more often and more exactly, which is what raises the reward. Logged
per episode: ``called``, ``call_right`` (the calculator returned the product), ``exact``.

The calculator runs in the reward service's workers (``areal_fast.workflow.tools``), never in
the controller. Problems come from the synthetic reversal stream (which also provides the warm
start): each row's text seeds its problem, so the held-out rows give held-out problems.
"""

from __future__ import annotations

import random

from areal_fast.data import tiny_task
from areal_fast.workflow import Trajectory
from areal_fast.workflow.tools import CALCULATOR

OPERATOR = "*"
ALPHABET = "0123456789*+"  # data.synthetic.alphabet of the example: digits and operators


def problem(row_text: str, digits: tuple[int, int] = (1, 2)) -> tuple[str, str]:
    """(prompt, answer) of the problem seeded by ``row_text``: 'a*b=' and the product."""
    rng = random.Random(row_text)
    a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
    return f"{a}*{b}{tiny_task.SEPARATOR}", str(a * b)


async def multiply_with_calculator(row, engine, digits: list[int] = (1, 2)) -> list[Trajectory]:
    """One episode (see the module docstring)."""
    if len(digits) != 2 or min(digits) < 1:
        raise ValueError(f"rollout.workflow_args.digits: expected two digit counts >= 1, got {digits!r}")
    prompt, answer = problem(row.text, tuple(digits))
    traj = Trajectory(prompt_ids=engine.encode_prompt(prompt))
    gen = await engine.generate(traj.context_ids)
    traj.add_model(gen)
    text = engine.decode(gen.output_ids)
    called = OPERATOR in text
    if called:
        res = await engine.tool(CALCULATOR, text[::-1])
        text = res.output.strip() if res.ok else ""  # a failed call answers nothing
        traj.add_context(engine.encode(text))
    task = {**row.task, "answer": answer}
    traj.reward = float((await engine.reward(task, text)).value)
    exact = tiny_task.reward(task, text)
    traj.info = {"called": float(called), "call_right": float(called and exact == 1.0), "exact": exact}
    return [traj]
