"""The rollout workflow API: one *episode* of a task, written by the user as an async function.

::

    async def my_workflow(row, engine) -> list[Trajectory]:
        traj = Trajectory(prompt_ids=engine.encode_prompt(row.text))
        gen = await engine.generate(traj.context_ids)      # a model turn (interruptible)
        traj.add_model(gen)                                 # loss mask 1, logprobs and versions kept
        traj.add_context(engine.encode("feedback"))         # tool or environment text: loss mask 0
        ...
        traj.reward = (await engine.reward(row.task, engine.decode(gen.output_ids))).value
        return [traj]

The controller admits a task, runs ``rollout.group_size`` episodes of it concurrently (each one
call of the workflow) and trains on every trajectory they return, with group advantages over the
episodes of that task. ``docs/workflows.md`` is the guide; this module holds the types.

A model turn goes through the rollout port, so it is interrupted and resumed across weight
updates like any generation: the tokens it returns are exactly those generated, each with the
version that generated it. Tools run in the reward service's worker processes (``tools.py``),
never in the controller's.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_WORKFLOW = "areal_fast.workflow.single_turn:single_turn"
CONTEXT_VERSION = -1  # version recorded for tokens the model did not generate


class EpisodeFailed(Exception):
    """Raise from a workflow to abandon one episode on purpose (a tool kept failing, the environment
    broke): the controller counts it (``episodes_failed``) and trains on the group's other episodes.
    Any other exception is a bug and stops the run with its traceback."""


@dataclass
class Trajectory:
    """Token ids of one trajectory and what the trainer needs about them.

    ``prompt_ids`` is the context before the first model turn (never trained on). ``output_ids``
    is everything after it: model turns (``loss_mask`` 1, with their behaviour log-probs and
    versions) and the text spliced in between turns (``loss_mask`` 0, log-prob 0.0, version -1).
    ``reward`` is what the trainer uses; ``turn_rewards`` and ``info`` (numbers) are logged only.
    """

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behav_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    """Finish reason of the last model turn ('stop', 'length')."""

    @property
    def context_ids(self) -> list[int]:
        """The whole sequence so far: what the next model turn continues."""
        return list(self.prompt_ids) + list(self.output_ids)

    @property
    def n_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def n_turns(self) -> int:
        """Model turns so far (runs of loss-mask 1 tokens)."""
        return sum(1 for i, m in enumerate(self.loss_mask) if m and (i == 0 or not self.loss_mask[i - 1]))

    def add_model(self, gen) -> None:
        """Append a model turn (a :class:`areal_fast.controller.Generation`)."""
        n = len(gen.output_ids)
        if len(gen.behav_logprobs) != n or len(gen.versions) != n:
            raise ValueError(f"model turn: {n} tokens but {len(gen.behav_logprobs)} log-probs and "
                             f"{len(gen.versions)} versions")
        self.output_ids += list(gen.output_ids)
        self.loss_mask += [1] * n
        self.behav_logprobs += [float(x) for x in gen.behav_logprobs]
        self.output_versions += [int(v) for v in gen.versions]
        self.finish_reason = gen.finish_reason

    def add_context(self, ids) -> None:
        """Append tokens the model did not generate (tool output, feedback): context, not trained."""
        ids = [int(i) for i in ids]
        self.output_ids += ids
        self.loss_mask += [0] * len(ids)
        self.behav_logprobs += [0.0] * len(ids)
        self.output_versions += [CONTEXT_VERSION] * len(ids)

    def model_versions(self) -> list[int]:
        """Versions of the model tokens (what staleness is measured on)."""
        return [v for v, m in zip(self.output_versions, self.loss_mask) if m]

    def check(self, where: str) -> None:
        """Raise ValueError naming ``where`` (the workflow) when the fields do not line up."""
        n = len(self.output_ids)
        lens = {"loss_mask": len(self.loss_mask), "behav_logprobs": len(self.behav_logprobs),
                "output_versions": len(self.output_versions)}
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise ValueError(f"{where}: trajectory has {n} output_ids but {bad}")
        if not self.prompt_ids:
            raise ValueError(f"{where}: trajectory has an empty prompt_ids (the first model turn needs context)")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
        if isinstance(self.reward, bool) or not isinstance(self.reward, int | float) or not math.isfinite(self.reward):
            raise ValueError(f"{where}: reward must be a finite number, got {self.reward!r}")

    def to_sample(self, group_id) -> dict:
        """The trainer's sample dict (``areal_fast.trainer.batch.Sample``)."""
        return dict(prompt_ids=list(self.prompt_ids), output_ids=list(self.output_ids),
                    behav_logprobs=list(self.behav_logprobs), output_versions=list(self.output_versions),
                    reward=float(self.reward), group_id=group_id, loss_mask=list(self.loss_mask))


@dataclass
class ToolResult:
    """What a tool call gave: ``status`` ok | timeout | error (as the reward service reports it),
    ``output`` the tool's text (or the reason it failed)."""

    status: str
    output: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


Workflow = Callable[..., Awaitable[list[Trajectory]]]


def load_workflow(name: str) -> Workflow:
    """Import ``'package.module:function'``; the function must be ``async def`` (or an object whose
    ``__call__`` is). ValueError says which part is wrong."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise ValueError(f"workflow {name!r}: expected 'package.module:function'")
    mod_name, fn_name = name.split(":")
    if not mod_name or not fn_name:
        raise ValueError(f"workflow {name!r}: expected 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"workflow {name!r}: cannot import module {mod_name!r}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise ValueError(f"workflow {name!r}: module {mod_name!r} has no attribute {fn_name!r}")
    call = fn if inspect.isfunction(fn) else getattr(fn, "__call__", None)  # noqa: B004 - objects too
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)):
        raise ValueError(f"workflow {name!r}: must be an async function (async def {fn_name}(row, engine)), "
                         f"got {type(fn).__name__}")
    return fn


def check_trajectories(out: Any, where: str) -> list[Trajectory]:
    """What a workflow returned, checked: a list of Trajectory (an empty list is allowed)."""
    if isinstance(out, Trajectory):
        out = [out]
    if not isinstance(out, list | tuple) or not all(isinstance(t, Trajectory) for t in out):
        raise TypeError(f"{where}: a workflow must return a list of Trajectory, got {type(out).__name__}")
    for t in out:
        t.check(where)
    return list(out)
