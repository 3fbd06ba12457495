"""The controller's record of a finished group: the samples (``areal_fast.sample.Sample``) of the n
episodes of one prompt, scored. The buffer (``areal_fast.buffer``) keeps and spills it, a checkpoint
(``areal_fast.checkpoint``) stores it, the trainer reads its samples as they are (:attr:`Group.samples`).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_fast.sample import Sample


@dataclass
class Group:
    """The samples of the n episodes of one prompt, finished and scored, in episode order. Each
    sample's ``group_id`` is the group's ``position``. A buffered group is never changed: the
    checkpoint writer and the trainer read its samples' arrays from their threads."""

    position: int
    row: int
    admitted_version: int
    samples: list[Sample]
    gen_seconds: float = 0.0
    episodes_failed: int = 0

    def __post_init__(self) -> None:
        if not all(type(s) is Sample for s in self.samples):  # read back from a record: sample dicts
            self.samples = [_sample(s, self.position) for s in self.samples]

    @property
    def prompt_ids(self):
        """The prompt of the group's first sample (the task's prompt)."""
        return self.samples[0].prompt_ids

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def infos(self) -> list[dict]:
        return [s.info for s in self.samples]

    @property
    def n_tokens(self) -> int:
        """Model tokens (the trained ones; tool and environment text excluded)."""
        return sum(self.model_token_counts())

    def model_token_counts(self) -> list[int]:
        """Model tokens of each sample."""
        return [s.n_model_tokens for s in self.samples]

    def min_model_version(self) -> int | None:
        """The oldest version of any model token of the group (None: no model token)."""
        return min((v for v in (s.min_model_version() for s in self.samples) if v is not None), default=None)

    def min_version(self) -> int:
        """The oldest model-token version; the admission version for a group without model tokens."""
        m = self.min_model_version()
        return self.admitted_version if m is None else m


def _sample(s, position: int) -> Sample:
    """A sample of a group read back: a Sample as it is, or the keyword arguments of one (a record's
    columns and fields; ``min_version`` as stored, so that it is not recomputed)."""
    if isinstance(s, Sample):
        return s
    s = dict(s)
    known, m = "min_version" in s, s.pop("min_version", None)
    out = Sample(**s, group_id=position)
    return out.known_min_version(m) if known else out


def group_of(pos: int, row: int, admitted_version: int, samples: list[Sample], **fields) -> Group:
    """A group (or a part of one: some of its episodes) of the samples a workflow returned, as they
    are: each gets the group's ``group_id`` and numeric ``info`` (no per-token work here)."""
    for s in samples:
        s.group_id = pos
        s.info = numbers(s.info)
    return Group(position=pos, row=row, admitted_version=admitted_version, samples=list(samples), **fields)


def merge_parts(parts: list[Group], **fields) -> Group:
    """One group from its parts (each some of its episodes, in episode order), their samples as they are."""
    first = parts[0]
    return Group(position=first.position, row=first.row, admitted_version=first.admitted_version,
                 samples=[s for p in parts for s in p.samples], **fields)


def numbers(info: dict) -> dict:
    """The numeric entries of a trajectory's info (what metrics can average)."""
    return {str(k): float(v) for k, v in (info or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)}
