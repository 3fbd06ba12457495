"""Multi-turn variant of the tiny reversal task: answer, get feedback, try again.

::

    <bos> cabjd=  djbxc<eos>  dj=ac <bos> cabjd=  djbac<eos>
    prompt        turn 1      feedback              turn 2      (feedback: loss mask 0)

The environment checks each answer exactly. A wrong answer gets feedback and another turn, up to
``max_turns``: with ``feedback='positions'`` the feedback is the answer with every wrong
position blanked ('='), then the prompt again after a BOS token (so the retry looks as much
like a first turn as the context allows); with ``feedback='retry'`` only the prompt again. The
character tokenizer knows only the alphabet and '=', so the hint is written in those.

Reward of the episode (what the trainer uses): the configured reward of the last answer (dense
partial credit while training, exact match in evaluation), times ``turn_discount`` per extra
turn, so a first-turn answer is worth the most. Logged per episode: ``turn1`` (first answer
exact), ``after_feedback`` (exact answer after feedback, only in episodes that got feedback),
the same two as fractions of right characters (``turn1_chars``, ``after_feedback_chars``), and
``turns``. A model warm-started on single turns has never seen a second one (after the second
BOS it rambles on without stopping), so what follows feedback is learned by RL from scratch:
``after_feedback`` (and its character fraction) rising over training is the sign of it.
"""

from __future__ import annotations

from areal_fast.data import tiny_task
from areal_fast.workflow import Trajectory

FEEDBACK_MODES = ("positions", "retry")


def feedback_text(answer: str, got: str, mode: str) -> str:
    """The hint the environment gives after the wrong answer ``got`` (the prompt follows it)."""
    if mode == "retry":
        return ""
    blanked = "".join(g if i < len(answer) and g == answer[i] else tiny_task.SEPARATOR
                      for i, g in enumerate(got[: len(answer)].ljust(len(answer), tiny_task.SEPARATOR)))
    return blanked


async def reverse_with_feedback(row, engine, max_turns: int = 2, feedback: str = "positions",
                                turn_discount: float = 0.5) -> list[Trajectory]:
    """One episode of the multi-turn reversal task (see the module docstring)."""
    if feedback not in FEEDBACK_MODES:
        raise ValueError(f"rollout.workflow_args.feedback: expected one of {FEEDBACK_MODES}, got {feedback!r}")
    if max_turns < 1:
        raise ValueError(f"rollout.workflow_args.max_turns: must be >= 1, got {max_turns!r}")
    answer = str(row.task["answer"])
    traj = Trajectory(prompt_ids=engine.encode_prompt(row.text))
    exact: list[float] = []
    text = ""
    for turn in range(max_turns):
        if turn > 0:
            if traj.output_ids and traj.output_ids[-1] != engine.eos_token_id and engine.eos_token_id is not None:
                traj.add_context([engine.eos_token_id])  # a turn cut at the length limit still ends
            # the prompt again, with its BOS: the retry reads like a first turn, after the hint
            traj.add_context(engine.encode(feedback_text(answer, text, feedback)) + engine.encode_prompt(row.text))
        gen = await engine.generate(traj.context_ids)
        traj.add_model(gen)
        text = engine.decode(gen.output_ids)
        exact.append(tiny_task.reward(row.task, text))
        if turn == 0:
            first_chars = tiny_task.char_accuracy(row.task, text)
        if exact[-1] == 1.0:
            break
    res = await engine.reward(row.task, text)
    traj.reward = float(res.value) * turn_discount ** (len(exact) - 1)
    traj.turn_rewards = exact
    traj.info = {"turn1": exact[0], "turns": float(len(exact)), "final": exact[-1],
                 "turn1_chars": first_chars}
    if len(exact) > 1:  # the turns after feedback: exact, and the fraction of right characters
        traj.info["after_feedback"] = exact[-1]
        traj.info["after_feedback_chars"] = tiny_task.char_accuracy(row.task, text)
    return [traj]
