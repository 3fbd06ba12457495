"""The record of one generated sample as a rollout port returns it (:class:`Generation`).

It sits low in the package (it needs only ``areal_fast.workflow.columns``) so that the rollout
ports in ``areal_fast.rollout`` can build it without importing the controller that consumes it;
``areal_fast.controller`` re-exports it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from areal_fast.workflow import columns


@dataclass
class Generation:
    """What a rollout port returns for one sample. The per-token fields are compact columns
    (``areal_fast.workflow.columns``): ``output_ids`` and ``versions`` ``array('i')``,
    ``behav_logprobs`` ``array('f')``; a port may give lists, converted here (arrays of the right
    type are kept as they are)."""

    output_ids: array
    behav_logprobs: array  # the server's output_logprobs: log-probs of the behaviour policy
    versions: array
    finish_reason: str  # "stop" | "length" | "abort"

    def __post_init__(self) -> None:
        self.output_ids = columns.tokens(self.output_ids, "Generation.output_ids")
        self.behav_logprobs = columns.logprobs(self.behav_logprobs, "Generation.behav_logprobs")
        self.versions = columns.tokens(self.versions, "Generation.versions")
