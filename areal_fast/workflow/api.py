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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from areal_fast.sample import CONTEXT_VERSION, Sample  # noqa: F401 - CONTEXT_VERSION re-exported

DEFAULT_WORKFLOW = "areal_fast.workflow.single_turn:single_turn"

Trajectory = Sample
"""What a workflow returns: the one sample record (:class:`areal_fast.sample.Sample`), under the
name workflows use. A model turn (``engine.generate``) is a ``Sample`` too: return it as it is for
one turn, or extend one with :meth:`~areal_fast.sample.Sample.add_model` and
:meth:`~areal_fast.sample.Sample.add_context`."""


class EpisodeFailed(Exception):
    """Raise from a workflow to abandon one episode on purpose (a tool kept failing, the environment
    broke): the controller counts it (``episodes_failed``) and trains on the group's other episodes.
    Any other exception is a bug and stops the run with its traceback."""


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
