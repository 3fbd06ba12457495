"""A lookup agent written only with the OpenAI SDK: the answer is in a key-value store that only
the tool can read.

Each row hides a small store: ``n_keys`` distinct 3-digit keys, each with a 3-digit value, drawn
from a generator seeded by the row's text, so held-out rows hold held-out stores. The prompt asks
for one key's value, ``*372=``. The model cannot know the value; it must query the store with
the key, written exactly::

    user       <bos>*372=
    assistant  273*<eos>           a call of lookup (the tiny template's marker '*'); the key is read
                                   right to left, as the model warm-started on reversal writes it
    tool       581                 the store's value: the episode's answer

A key that is not in the store finds nothing (an empty tool result; with ``max_calls`` > 1 the
model may query again after the miss); an answer without a call is read as a guess. What is
learned is to query with the exact key: the warm-started model writes the call nearly always but
gets a 3-digit key right about one time in five. The agent returns ``(answer, {"answer": value})``
for the configured reward (``examples/tiny_lookup_agent.yaml`` uses the exact match: partial
credit would pay guesses of a random value, and the policy learned to stop calling).
"""

from __future__ import annotations

import json
import random

from areal_fast.data import tiny_task

MARKER = "*"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key of the store (empty when the key is not there).",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def store(row_text: str, n_keys: int = 4) -> tuple[dict[str, str], str]:
    """(the row's store, the key the prompt asks for): ``n_keys`` distinct 3-digit keys and values."""
    rng = random.Random(f"lookup:{row_text}")
    keys = rng.sample(range(100, 1000), n_keys)
    table = {str(k): str(rng.randint(100, 999)) for k in keys}
    return table, str(rng.choice(keys))


def read_right_to_left(text: str) -> str:
    """The digits of ``text`` in reading order (the tiny model writes them reversed)."""
    return "".join(c for c in text if c.isdigit())[::-1]


def lookup(table: dict[str, str], arguments: str) -> str:
    """The tool: the value under the key in ``arguments`` (JSON ``{"key": ...}``), or ""."""
    try:
        key = json.loads(arguments)["key"]
    except (ValueError, KeyError, TypeError):
        return ""
    return table.get(read_right_to_left(str(key)), "")


async def solve(row, client, model: str = "areal-fast", max_tokens: int = 8, max_calls: int = 1,
                n_keys: int = 4):
    """One episode: ``client`` is an ``openai.AsyncOpenAI`` (or the episode's in-process client)."""
    table, key = store(row.text, n_keys)
    messages: list = [{"role": "user", "content": f"{MARKER}{key}{tiny_task.SEPARATOR}"}]
    answer = ""
    for _ in range(max_calls):
        response = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP],
                                                        max_tokens=max_tokens)
        message = response.choices[0].message
        if not message.tool_calls:  # answered without looking: a guess
            answer = read_right_to_left(message.content or "")
            break
        messages.append(message)
        for call in message.tool_calls:
            answer = lookup(table, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        if answer:
            break
    return answer, {"answer": table[key]}
