"""Tool-use task: multiply two numbers with a calculator the tiny model must learn to use.

Numbers in answers are written least-significant digit first (the reversal task's order), and
so are tool calls: a first turn that contains the operator '*' is a call, and the calculator
reads it right to left. The model cannot multiply in its head; it gets the answer by calling the
tool with the right expression, then copying the result back in its own order::

    <bos> 12*34=  43*21<eos>  <bos>408=  804<eos>        reward 1 (12 * 34 = 408, answered "804")
    prompt        turn 1:call tool         turn 2          (tool output: loss mask 0)

    <bos> 12*34=  4821<eos>                         reward ~0 (no call: an answer, and wrong)

A model warm-started on reversal (over the alphabet of digits, '*' and '+') writes something
close to a call from the start but gets the expression exactly right only part of the time, and
has never seen a tool result; RL has to make the call right and learn to answer from the result.
Logged per episode: ``called`` (turn 1 was a call), ``call_right`` (the calculator returned the
product), ``exact`` (the final answer is exactly right).

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
ALPHABET = "0123456789*+"  # data.synthetic.alphabet of the example: digits, the operator, the call mark


def problem(row_text: str, digits: int = 2) -> tuple[str, str]:
    """(prompt, answer) of the problem seeded by ``row_text``: 'a*b=' and the product reversed."""
    rng = random.Random(row_text)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return f"{a}*{b}{tiny_task.SEPARATOR}", str(a * b)[::-1]


async def multiply_with_calculator(row, engine, digits: int = 2) -> list[Trajectory]:
    """One episode (see the module docstring)."""
    prompt, answer = problem(row.text, digits)
    traj = Trajectory(prompt_ids=engine.encode_prompt(prompt))
    gen = await engine.generate(traj.context_ids)
    traj.add_model(gen)
    text = engine.decode(gen.output_ids)
    called = OPERATOR in text
    call_right = 0.0
    if called:
        res = await engine.tool(CALCULATOR, text[::-1])
        call_right = float(res.ok and res.output.strip() == answer[::-1])
        if gen.output_ids[-1] != engine.eos_token_id:
            traj.add_context([engine.eos_token_id])
        shown = res.output.strip() if res.ok else ""  # a failed call shows nothing: the model answers blind
        traj.add_context(engine.encode_prompt(shown + tiny_task.SEPARATOR))  # after a BOS, as a prompt
        gen = await engine.generate(traj.context_ids)
        traj.add_model(gen)
        text = engine.decode(gen.output_ids)
    task = {**row.task, "answer": answer}
    traj.reward = float((await engine.reward(task, text)).value)
    exact = tiny_task.reward(task, text)
    traj.turn_rewards = [exact]
    traj.info = {"called": float(called), "call_right": call_right, "exact": exact}
    return [traj]
