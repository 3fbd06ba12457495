"""The controller's record of a finished group: the trajectories of the n episodes of one prompt,
scored, with their per-token columns (``areal_fast.workflow.columns``). The buffer
(``areal_fast.buffer``) keeps and spills it, a checkpoint (``areal_fast.checkpoint``) stores it,
the trainer reads it as sample dicts (:meth:`Group.samples`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from areal_fast.workflow import columns

_GROUP_COLUMNS = {"outputs": columns.TOKEN_ARRAY, "behav_logprobs": columns.LOGPROB_ARRAY,
                  "versions": columns.TOKEN_ARRAY, "prompts": columns.TOKEN_ARRAY, "loss_masks": columns.MASK_ARRAY}


@dataclass
class Group:
    """The trajectories of the n episodes of one prompt, finished and scored. ``prompts`` and
    ``loss_masks`` are per trajectory when the workflow made them (empty: every trajectory starts
    with ``prompt_ids`` and all its output tokens are model tokens).

    Per-token data are compact columns, one per trajectory (``areal_fast.workflow.columns``):
    ``prompt_ids``, ``prompts``, ``outputs``, ``versions`` ``array('i')``, ``behav_logprobs``
    ``array('f')``, ``loss_masks`` ``array('B')``; lists given to the constructor are converted.
    ``min_versions`` holds each trajectory's oldest model-token version (None: no model token),
    computed from the columns when not given. A buffered group is never changed: the checkpoint
    writer and the trainer read its arrays from their threads."""

    position: int
    row: int
    admitted_version: int
    prompt_ids: array
    outputs: list[array]
    behav_logprobs: list[array]
    versions: list[array]
    rewards: list[float]
    finish_reasons: list[str]
    gen_seconds: float = 0.0
    prompts: list[array] = field(default_factory=list)
    loss_masks: list[array] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    episodes_failed: int = 0
    min_versions: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = columns.tokens(self.prompt_ids, "Group.prompt_ids")
        for name, code in _GROUP_COLUMNS.items():
            cols = getattr(self, name)
            if any(type(c) is not array or c.typecode != code for c in cols):
                setattr(self, name, [columns.column(c, code, f"Group.{name}[{i}]") for i, c in enumerate(cols)])
        if len(self.min_versions) != len(self.versions):
            masks = self.loss_masks or [None] * len(self.versions)
            self.min_versions = [columns.min_model_version(v, m) for v, m in zip(self.versions, masks)]

    @classmethod
    def from_state(cls, g: dict) -> Group:
        """A group from its dict in the controller.json of checkpoints written before ``buffer.bin``:
        columns encoded compactly (``columns.encode_column``), or the lists (and the ``logprobs``
        name) of still older ones."""
        g = dict(g)
        if "logprobs" in g:  # checkpoints written before the behaviour log-probs got their one name
            g["behav_logprobs"] = g.pop("logprobs")
        pos = g.get("position")
        g["prompt_ids"] = columns.decode_column(g["prompt_ids"], columns.TOKEN_ARRAY, f"group {pos}: prompt_ids")
        for name, code in _GROUP_COLUMNS.items():
            if name in g:
                g[name] = [columns.decode_column(c, code, f"group {pos}: {name}[{i}]") for i, c in enumerate(g[name])]
        return cls(**g)

    @property
    def n_tokens(self) -> int:
        """Model tokens (the trained ones; tool and environment text excluded)."""
        return sum(self.model_token_counts())

    def model_token_counts(self) -> list[int]:
        """Model tokens of each trajectory."""
        if self.loss_masks:
            return [len(m) - bytes(m).count(0) for m in self.loss_masks]
        return [len(o) for o in self.outputs]

    def min_model_version(self) -> int | None:
        """The oldest version of any model token of the group (None: no model token)."""
        return min((v for v in self.min_versions if v is not None), default=None)

    def min_version(self) -> int:
        """The oldest model-token version; the admission version for a group without model tokens."""
        m = self.min_model_version()
        return self.admitted_version if m is None else m

    def samples(self) -> list[dict]:
        """The trainer's sample dicts. They share this group's arrays (no copy): the trainer reads them
        (``areal_fast.trainer.batch``), never changes them."""
        out = []
        for i, (o, lp, v, r) in enumerate(zip(self.outputs, self.behav_logprobs, self.versions, self.rewards)):
            s = dict(prompt_ids=self.prompts[i] if self.prompts else self.prompt_ids, output_ids=o,
                     behav_logprobs=lp, output_versions=v, reward=r, group_id=self.position)
            if self.loss_masks:
                s["loss_mask"] = self.loss_masks[i]
            out.append(s)
        return out


def group_of(pos: int, row: int, admitted_version: int, trajs: list, **fields) -> Group:
    """A group (or a part of one: some of its episodes) from trajectories, sharing their arrays;
    the oldest version of each was kept as its turns were added (no per-token work here)."""
    return Group(position=pos, row=row, admitted_version=admitted_version, prompt_ids=trajs[0].prompt_ids,
                 outputs=[tr.output_ids for tr in trajs], behav_logprobs=[tr.behav_logprobs for tr in trajs],
                 versions=[tr.output_versions for tr in trajs], rewards=[float(tr.reward) for tr in trajs],
                 finish_reasons=[tr.finish_reason for tr in trajs], prompts=[tr.prompt_ids for tr in trajs],
                 loss_masks=[tr.loss_mask for tr in trajs], infos=[numbers(tr.info) for tr in trajs],
                 min_versions=[tr.min_model_version() for tr in trajs], **fields)


_PART_LISTS = ("outputs", "behav_logprobs", "versions", "rewards", "finish_reasons", "prompts", "loss_masks",
               "infos", "min_versions")


def merge_parts(parts: list[Group], **fields) -> Group:
    """One group from its parts (each some of its episodes, in episode order), their arrays as they are."""
    first = parts[0]

    def cat(name: str) -> list:
        return [x for p in parts for x in getattr(p, name)]

    return Group(position=first.position, row=first.row, admitted_version=first.admitted_version,
                 prompt_ids=first.prompt_ids, **{n: cat(n) for n in _PART_LISTS}, **fields)


def numbers(info: dict) -> dict:
    """The numeric entries of a trajectory's info (what metrics can average)."""
    return {str(k): float(v) for k, v in (info or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)}
