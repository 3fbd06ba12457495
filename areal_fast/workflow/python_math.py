"""Multi-turn math with a Python tool (the GPU example, ``examples/gpu_qwen_math_tool.yaml``).

The model reasons in text; to compute, it writes a program between ``<python>`` and ``</python>``
(generation stops there), the program runs in the reward sandbox, and its output comes back as
``<output>...</output>`` (loss mask 0); the model goes on until it gives a final answer in
``\\boxed{}`` or the turn budget is spent. The reward is the configured one (``math``) on the
whole answer text; ``info`` logs the number of tool calls and their failures.
"""

from __future__ import annotations

import re

from areal_fast.workflow.api import Trajectory
from areal_fast.workflow.tools import PYTHON

OPEN, CLOSE = "<python>", "</python>"
_CODE = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)
_MAX_OUTPUT_CHARS = 1000  # tool output shown to the model (the rest is cut, said so)


def last_program(text: str) -> str | None:
    """The program of the last ``<python>`` block of ``text`` (closed or cut by the stop), or None."""
    found = _CODE.findall(text)
    return found[-1].strip() if found else None


async def solve_with_python(row, engine, max_turns: int = 4) -> list[Trajectory]:
    """One episode (see the module docstring)."""
    traj = Trajectory(prompt_ids=engine.encode_prompt(row.text))
    answer_text, calls, failures = "", 0, 0
    for _ in range(max_turns):
        gen = await engine.generate(traj.context_ids, stop=[CLOSE])
        traj.add_model(gen)
        text = engine.decode(gen.output_ids)
        answer_text += text
        program = last_program(text)
        if gen.finish_reason != "stop" or program is None or "\\boxed" in text:
            break  # a final answer, the length limit, or no call: the episode ends
        calls += 1
        res = await engine.tool(PYTHON, program)
        failures += not res.ok
        shown = res.output if len(res.output) <= _MAX_OUTPUT_CHARS else res.output[:_MAX_OUTPUT_CHARS] + "...(cut)"
        closing = "" if text.rstrip().endswith(CLOSE) else CLOSE
        ctx = f"{closing}\n<output>\n{shown}\n</output>\n"
        traj.add_context(engine.encode(ctx))
        answer_text += ctx
    traj.reward = float((await engine.reward(row.task, answer_text)).value)
    traj.info = {"tool_calls": float(calls), "tool_failures": float(failures), "turns": float(traj.n_turns)}
    return [traj]
