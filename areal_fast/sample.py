"""The one record of a generated sample, from the rollout client to the trainer (:class:`Sample`).

::

    RolloutClient.generate  --> Sample (prompt_ids, output_* columns, loss_mask of ones, finish_reason)
      (or ShardedRollout)          |  the same object, never converted
    workflow (Trajectory)   --> add_model / add_context extend a sample turn by turn; reward is set
    controller              --> Group.samples (a buffered group holds its samples; spilled as records)
    trainer                 --> reads the columns (``areal_fast.trainer.batch.to_seq``)

As in slime, the rollout, the workflow, the buffer and the trainer read and write this one record;
nobody copies it into another. What stays private: the wire-level answer segments the client
stitches (``areal_fast.rollout.answer``) and the embedded engine's own request.

It sits low in the package (it needs only ``areal_fast.columns``) so that ``areal_fast.rollout``
can build it without importing the workflow, the controller or the trainer. ``Trajectory`` in
``areal_fast.workflow`` is this class under the name workflows have always used.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable
from dataclasses import dataclass, field

from areal_fast.columns import (
    LOGPROB_ARRAY,
    MASK_ARRAY,
    ROUTING_ARRAY,
    TOKEN_ARRAY,
    column,
    is_binary_mask,
    logprobs,
    mask,
    min_model_version,
    routing,
    routing_from_rows,
    tokens,
)

CONTEXT_VERSION = -1  # version recorded for tokens the model did not generate
_CONTEXT_VERSIONS = array(TOKEN_ARRAY, [CONTEXT_VERSION])
_COLUMNS = {"prompt_ids": TOKEN_ARRAY, "output_ids": TOKEN_ARRAY, "output_logprobs": LOGPROB_ARRAY,
            "output_versions": TOKEN_ARRAY, "loss_mask": MASK_ARRAY, "routed_experts": ROUTING_ARRAY}
COLUMN_NAMES = tuple(_COLUMNS)
"""The per-token columns of a sample, in the order a buffer record stores them."""
_MODEL = b"\x01"
_UNROUTED = array(ROUTING_ARRAY, [-1])


@dataclass
class Sample:
    """One sample: its token columns and what the trainer and the metrics need about them.

    One name per per-token column, from the client to the trainer:

    - ``prompt_ids``: the context before the first model turn (never trained on; >= 1 token).
    - ``output_ids``: everything after it: model turns and the text spliced in between turns (tool
      output, feedback), as SGLang's ``output_ids``.
    - ``output_logprobs``: the log-prob of each output token under the policy that sampled it (the
      *behaviour* policy; SGLang's ``output_token_logprobs``), 0.0 on spliced text. The loss ops
      (``areal_fast.ops``) take this column, shifted to the whole sequence, as their tensor argument
      ``behav_logprobs``: that name belongs to the math layer.
    - ``output_versions``: the weight version that generated each output token, -1 on spliced text.
    - ``loss_mask``: 1 for a token the model generated, 0 for spliced text. Empty with output tokens
      means every output token is a model token: it is filled with ones on construction.
    - ``routed_experts``: MoE routing replay's record (``docs/moe.md``): for each position of the
      forwarded sequence ``(prompt_ids + output_ids)[:-1]`` (the last token is never forwarded), the
      experts the server routed it to in every sparse block, ``layers x top_k`` int16 ids a position
      (flat; the width is the column's length over ``len(prompt_ids) + len(output_ids) - 1``), -1 for
      a position no server recorded. Empty: no routing (dense models, servers not asked).

    The columns are compact ``array.array`` (``areal_fast.columns``): ``prompt_ids``,
    ``output_ids`` and ``output_versions`` ``array('i')``, ``output_logprobs`` ``array('f')``,
    ``loss_mask`` ``array('B')``, ``routed_experts`` ``array('h')``. They index, slice, iterate
    and ``len`` like lists; compare them with ``list(x)`` (an array never equals a list). Lists,
    tuples or tensors given to the constructor or assigned later are converted on entry; an array
    of the right typecode is kept as the same object (the client's columns reach the trainer
    without a copy). Build a multi-turn sample with :meth:`add_model` and :meth:`add_context`,
    which extend the columns in place.

    ``reward`` is what the trainer uses; ``turn_rewards`` and ``info`` (numbers) are logged only.
    ``group_id`` is set by the controller (samples of one prompt share it: the advantage groups).
    ``rid`` to ``latency_s`` are what the rollout client reports about the generation.
    """

    prompt_ids: array
    output_ids: array = field(default_factory=tokens)
    output_logprobs: array = field(default_factory=logprobs)
    output_versions: array = field(default_factory=tokens)
    loss_mask: array = field(default_factory=mask)
    routed_experts: array = field(default_factory=routing)
    reward: float = 0.0
    finish_reason: str = ""
    """Finish reason of the last model turn: 'stop', 'length' (also for a sample ended by abort)."""
    turn_rewards: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    group_id: Hashable | None = None
    """Set by the controller: the position of the prompt (samples of one group share it)."""
    rid: str | None = None
    """The caller's request id of the (last) model turn."""
    matched: int | str | None = None
    """The stop token or string, for finish_reason 'stop'."""
    aborted: bool = False
    """Ended by an explicit abort (reported as 'length')."""
    num_segments: int = 0
    """HTTP answers the client stitched together (more than 1 across pauses and weight updates)."""
    servers: list[str] = field(default_factory=list)
    """The server of each segment."""
    latency_s: float = 0.0
    """Seconds the client took, all segments."""

    def __setattr__(self, name: str, value) -> None:
        code = _COLUMNS.get(name)
        if code is not None:
            value = column(value, code, f"{type(self).__name__}.{name}")
            if name in ("loss_mask", "output_versions"):  # the running minimum is recomputed when asked
                object.__setattr__(self, "_min_known", False)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        if self.output_ids and not self.loss_mask:  # the client's sample: every output token is the model's
            self.loss_mask = array(MASK_ARRAY, _MODEL * len(self.output_ids))
        if not self.output_versions:  # built turn by turn: add_model keeps the minimum as it goes
            object.__setattr__(self, "_min_version", None)
            object.__setattr__(self, "_min_known", True)

    # ------------------------------------------------------------------ views
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
        return b.count(b"\x00\x01") + b.startswith(_MODEL)

    # ------------------------------------------------------------------ building turn by turn
    def add_model(self, turn: Sample) -> None:
        """Append a model turn (the sample ``engine.generate`` returned): its output columns are
        appended as they are (array copies, no per-token Python work), loss mask 1."""
        ids = tokens(turn.output_ids, "model turn output_ids")
        lps = logprobs(turn.output_logprobs, "model turn output_logprobs")
        vers = tokens(turn.output_versions, "model turn output_versions")
        n = len(ids)
        if len(lps) != n or len(vers) != n:
            raise ValueError(f"model turn: {n} tokens but {len(lps)} log-probs and {len(vers)} versions")
        width_before = self.routing_width()
        self.output_ids.extend(ids)
        self.loss_mask.frombytes(_MODEL * n)
        self.output_logprobs.extend(lps)
        self.output_versions.extend(vers)
        self._add_turn_routing(turn, width_before)
        if n and self._min_known:
            m = min_model_version(vers)
            if m is not None:
                object.__setattr__(self, "_min_version", m if self._min_version is None else min(m, self._min_version))
        self.finish_reason = turn.finish_reason

    def _add_turn_routing(self, turn: Sample, width_before: int) -> None:
        """Merge a model turn's routing (after the columns were extended by the turn). The turn's
        column covers every forwarded position of its context and output; a position this sample
        recorded before keeps its row (the forward that produced its next token's log-prob), the
        others take the turn's. A turn without routing (or for another context) adds unrecorded rows."""
        rows = len(self.prompt_ids) + len(self.output_ids) - 1
        width = turn.routing_width()
        if width and width_before and width != width_before:
            raise ValueError(f"model turn: routed_experts of {width} ids a position after {width_before}")
        if not width or len(turn.routed_experts) != rows * width:
            if width_before:  # unrecorded rows for the new positions
                self.routed_experts.extend(_UNROUTED * (rows * width_before - len(self.routed_experts)))
            return
        if not width_before:
            self.routed_experts = array(ROUTING_ARRAY, turn.routed_experts)  # a copy: the turn keeps its own
            return
        import numpy as np  # a dependency of the package; only multi-turn routing needs it here

        merged = np.frombuffer(turn.routed_experts, dtype=np.int16).reshape(rows, width).copy()
        old = np.frombuffer(self.routed_experts, dtype=np.int16).reshape(-1, width)
        keep = (old >= 0).all(axis=1)
        merged[: len(old)][keep] = old[keep]
        self.routed_experts = routing_from_rows(merged)

    def routing_width(self) -> int:
        """Expert ids a position in ``routed_experts`` (``layers x top_k``); 0 when it is empty.
        ValueError when its length is not whole positions of the forwarded sequence."""
        n = len(self.routed_experts)
        if not n:
            return 0
        rows = len(self.prompt_ids) + len(self.output_ids) - 1
        if rows <= 0 or n % rows:
            raise ValueError(f"routed_experts: {n} ids are not whole rows of the {rows} forwarded positions")
        return n // rows

    def add_context(self, ids) -> None:
        """Append tokens the model did not generate (tool output, feedback): context, not trained."""
        ids = tokens(ids, "add_context ids")
        n = len(ids)
        width = self.routing_width()
        if width:  # n more forwarded positions, none recorded yet
            self.routed_experts.extend(_UNROUTED * (n * width))
        self.output_ids.extend(ids)
        self.loss_mask.frombytes(bytes(n))
        self.output_logprobs.frombytes(bytes(n * self.output_logprobs.itemsize))  # 0.0 is all zero bits
        self.output_versions.extend(_CONTEXT_VERSIONS * n)

    # ------------------------------------------------------------------ versions
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

    def known_min_version(self, m: int | None) -> Sample:
        """Record ``m`` as the oldest model-token version (read back with the columns from a buffer
        record, where it was stored), so that it is not recomputed; returns the sample."""
        object.__setattr__(self, "_min_version", m)
        object.__setattr__(self, "_min_known", True)
        return self

    # ------------------------------------------------------------------ checks
    def check(self, where: str) -> None:
        """ValueError naming ``where`` (the workflow, the sample's index) when the output columns do
        not line up, the prompt is empty, a loss-mask entry is not 0 or 1, or the reward is not a
        finite number. No per-token Python work (the mask check runs in C)."""
        n = len(self.output_ids)
        lens = {"output_logprobs": len(self.output_logprobs), "output_versions": len(self.output_versions),
                "loss_mask": len(self.loss_mask)}
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise ValueError(f"{where}: {n} output_ids but {bad}")
        if not self.prompt_ids:
            raise ValueError(f"{where}: empty prompt_ids (the first model turn needs context)")
        if not is_binary_mask(self.loss_mask):
            raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
        try:
            self.routing_width()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        r = self.reward
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise ValueError(f"{where}: reward must be a finite number, got {r!r}")
