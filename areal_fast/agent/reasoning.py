"""Reasoning out of a model's text: ``<think>...</think>`` goes into ``reasoning_content``.

Models of the Qwen3 and DeepSeek-R1 kind write their reasoning between ``<think>`` and
``</think>`` before the answer; a chat template may open the ``<think>`` itself in the generation
prompt, so the output then starts inside the reasoning and only the close is written. The rule
(:func:`split_think`):

- the output holds ``</think>``: what comes before the first one (less a leading ``<think>``) is
  the reasoning, what comes after it the content (tool calls are parsed from the content only);
- it starts with ``<think>`` and never closes it (cut at ``max_tokens``): all of it is reasoning;
- otherwise it has no reasoning: the whole text is content.

Both parts are stripped of the white space around them. The recorded tokens are not touched:
only the answer the agent reads is split. :data:`REASONING_PARSERS` maps names to parsers;
``rollout.workflow_args.reasoning_parser`` (or ``engine.openai(reasoning_parser=...)``) picks one.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_think(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of ``text`` (see the module docstring)."""
    head = text.lstrip()
    close = text.find(THINK_CLOSE)
    if close >= 0:
        reasoning = text[:close].strip()
        reasoning = reasoning[len(THINK_OPEN):].strip() if reasoning.startswith(THINK_OPEN) else reasoning
        return reasoning, text[close + len(THINK_CLOSE):].strip()
    if head.startswith(THINK_OPEN):
        return head[len(THINK_OPEN):].strip(), ""
    return None, text


REASONING_PARSERS = {"think": split_think}


def reasoning_parser(name: str | None):
    """The parser called ``name`` (None: no reasoning parser; ValueError naming the known ones)."""
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"reasoning_parser: expected null or one of {sorted(REASONING_PARSERS)}, "
                         f"got {name!r}") from None
