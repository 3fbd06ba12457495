"""The tiny tool task (``tool_task.py``) as an agent written only with the OpenAI SDK.

The agent offers the model one function, ``calculator``, through ``tools=[...]``, reads the call
from ``message.tool_calls`` and runs it, exactly as it would against any OpenAI-compatible
server; it never sees a token id. Trained with ``examples/tiny_openai_agent.yaml``
(``areal_fast.agent.workflow:openai_agent`` records every call and builds the trajectories).

The model is the tool task's: warm-started on reversal, it writes a call as text containing
``*`` (the chat template's tool format for this tokenizer, ``call_marker: "*"``), right to left,
so the agent reads the expression backwards before evaluating it. The calculator's result is
the answer; an answer without a call is taken as it is. The agent returns its answer with the
problem's product (``(text, {"answer": product})``): the configured reward scores it (partial
credit while training, exact match in evaluation).

Only ``openai`` (when the agent builds its own client), ``json`` and the task's pieces are used.
"""

from __future__ import annotations

import json

from areal_fast.recipes.tool_task import problem
from areal_fast.workflow.tools import calculate

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression (+ - * // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def run_calculator(arguments: str) -> str:
    """The tool: the expression in ``arguments`` (written right to left by the tiny model)."""
    try:
        expression = json.loads(arguments)["expression"]
        return str(calculate(expression[::-1]))
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return ""  # a call that does not compute answers nothing


async def solve(row, client, digits=(1, 2), model: str = "areal-fast", max_tokens: int = 12):
    """One episode: ``client`` is an ``openai.AsyncOpenAI`` (or the episode's in-process client)."""
    prompt, product = problem(row.text, tuple(digits))
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], tools=[CALCULATOR], max_tokens=max_tokens)
    message = response.choices[0].message
    if message.tool_calls:
        answer = run_calculator(message.tool_calls[0].function.arguments)
    else:
        answer = message.content or ""
    return answer, {"answer": product}
