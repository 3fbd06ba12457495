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
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from areal_fast.workflow.columns import (
    LOGPROB_ARRAY,
    MASK_ARRAY,
    TOKEN_ARRAY,
    column,
    is_binary_mask,
    logprobs,
    mask,
    min_model_version,
    tokens,
)

DEFAULT_WORKFLOW = "areal_fast.workflow.single_turn:single_turn"
CONTEXT_VERSION = -1  # version recorded for tokens the model did not generate
_CONTEXT_VERSIONS = array(TOKEN_ARRAY, [CONTEXT_VERSION])


class EpisodeFailed(Exception):
    """Raise from a workflow to abandon one episode on purpose (a tool kept failing, the environment
    broke): the controller counts it (``episodes_failed``) and trains on the group's other episodes.
    Any other exception is a bug and stops the run with its traceback."""


_COLUMNS = {"prompt_ids": TOKEN_ARRAY, "output_ids": TOKEN_ARRAY, "loss_mask": MASK_ARRAY,
            "behav_logprobs": LOGPROB_ARRAY, "output_versions": TOKEN_ARRAY}


@dataclass
class Trajectory:
    """Token ids of one trajectory and what the trainer needs about them.

    ``prompt_ids`` is the context before the first model turn (never trained on). ``output_ids``
    is everything after it: model turns (``loss_mask`` 1, with their behaviour log-probs and
    versions) and the text spliced in between turns (``loss_mask`` 0, log-prob 0.0, version -1).
    ``reward`` is what the trainer uses; ``turn_rewards`` and ``info`` (numbers) are logged only.

    The per-token fields are compact ``array.array`` columns (``areal_fast.workflow.columns``):
    ``prompt_ids``, ``output_ids`` and ``output_versions`` ``array('i')``, ``behav_logprobs``
    ``array('f')``, ``loss_mask`` ``array('B')``. They index, slice, iterate and ``len`` like lists;
    compare them with ``list(x)`` (an array never equals a list). Lists, tuples or tensors given to
    the constructor or assigned later are converted on entry. Build a trajectory with
    :meth:`add_model` and :meth:`add_context`, which extend the columns in place (``+=`` with a list
    raises TypeError: arrays extend only with arrays).
    """

    prompt_ids: array
    output_ids: array = field(default_factory=tokens)
    loss_mask: array = field(default_factory=mask)
    behav_logprobs: array = field(default_factory=logprobs)
    output_versions: array = field(default_factory=tokens)
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    """Finish reason of the last model turn ('stop', 'length')."""

    def __setattr__(self, name: str, value) -> None:
        code = _COLUMNS.get(name)
        if code is not None:
            value = column(value, code, f"Trajectory.{name}")
            if name in ("loss_mask", "output_versions"):  # the running minimum is recomputed when asked
                object.__setattr__(self, "_min_known", False)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        if not self.output_versions:  # built turn by turn: add_model keeps the minimum as it goes
            object.__setattr__(self, "_min_version", None)
            object.__setattr__(self, "_min_known", True)

    @property
    def context_ids(self) -> array:
        """The whole sequence so far (a new ``array('i')``): what the next model turn continues."""
        return self.prompt_ids + self.output_ids

    @property
    def n_model_tokens(self) -> int:
        return len(self.loss_mask) - bytes(self.loss_mask).count(0)

    @property
    def n_turns(self) -> int:
        """Model turns so far (runs of loss-mask 1 tokens)."""
        b = bytes(self.loss_mask)
        return b.count(b"\x00\x01") + b.startswith(b"\x01")

    def add_model(self, gen) -> None:
        """Append a model turn (a :class:`areal_fast.controller.Generation`): its tokens, log-probs and
        versions are appended as they are (array copies, no per-token Python work), loss mask 1."""
        ids = tokens(gen.output_ids, "model turn output_ids")
        lps = logprobs(gen.behav_logprobs, "model turn behav_logprobs")
        vers = tokens(gen.versions, "model turn versions")
        n = len(ids)
        if len(lps) != n or len(vers) != n:
            raise ValueError(f"model turn: {n} tokens but {len(lps)} log-probs and {len(vers)} versions")
        self.output_ids.extend(ids)
        self.loss_mask.frombytes(b"\x01" * n)
        self.behav_logprobs.extend(lps)
        self.output_versions.extend(vers)
        if n and self._min_known:
            m = min_model_version(vers)
            if m is not None:
                object.__setattr__(self, "_min_version", m if self._min_version is None else min(m, self._min_version))
        self.finish_reason = gen.finish_reason

    def add_context(self, ids) -> None:
        """Append tokens the model did not generate (tool output, feedback): context, not trained."""
        ids = tokens(ids, "add_context ids")
        n = len(ids)
        self.output_ids.extend(ids)
        self.loss_mask.frombytes(bytes(n))
        self.behav_logprobs.frombytes(bytes(n * self.behav_logprobs.itemsize))  # 0.0 is all zero bits
        self.output_versions.extend(_CONTEXT_VERSIONS * n)

    def model_versions(self) -> list[int]:
        """Versions of the model tokens, as a list (one Python int a token: for inspection; staleness
        uses :meth:`min_model_version`)."""
        return [v for v, m in zip(self.output_versions, self.loss_mask) if m]

    def min_model_version(self) -> int | None:
        """The oldest version among the model tokens (None without any; what staleness is measured
        on): kept as turns are added, recomputed only when a column was assigned directly."""
        if not self._min_known:
            object.__setattr__(self, "_min_version", min_model_version(self.output_versions, self.loss_mask))
            object.__setattr__(self, "_min_known", True)
        return self._min_version

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
        if not is_binary_mask(self.loss_mask):
            raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
        if isinstance(self.reward, bool) or not isinstance(self.reward, int | float) or not math.isfinite(self.reward):
            raise ValueError(f"{where}: reward must be a finite number, got {self.reward!r}")

    def to_sample(self, group_id) -> dict:
        """The trainer's sample dict (``areal_fast.trainer.batch.Sample``), with copies of the columns
        (arrays, as above)."""
        return dict(prompt_ids=self.prompt_ids[:], output_ids=self.output_ids[:],
                    behav_logprobs=self.behav_logprobs[:], output_versions=self.output_versions[:],
                    reward=float(self.reward), group_id=group_id, loss_mask=self.loss_mask[:])


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
