"""The batch format the controller hands the trainer, and packing into micro-batches.

A batch is a list of :class:`Sample` (or dicts with the same keys). The actor turns each
into a shifted sequence (inputs ``ids[:-1]``, labels ``ids[1:]``: position t predicts token
t+1), so a sample of P prompt and G generated tokens contributes ``P + G - 1`` tokens, the
last G of which are in the loss.

The controller's samples hold ``array.array`` columns (``areal_fast.workflow.columns``); they
become tensors through ``torch.frombuffer`` and one dtype conversion each, without a Python
loop over the tokens (:func:`copy_column`). Lists and tensors work too.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from areal_fast.workflow.columns import is_binary_mask

# array typecode and item size -> the tensor dtype of the same bytes ('l' is 8 bytes on Linux, 4 on Windows)
_ARRAY_DTYPES = {("b", 1): torch.int8, ("B", 1): torch.uint8, ("h", 2): torch.int16, ("i", 4): torch.int32,
                 ("l", 4): torch.int32, ("l", 8): torch.int64, ("q", 8): torch.int64, ("f", 4): torch.float32,
                 ("d", 8): torch.float64}


def copy_column(dst: torch.Tensor, x) -> torch.Tensor:
    """Copy the per-token column ``x`` into the 1-D CPU tensor ``dst`` (same length), converting to
    its dtype: an ``array.array`` is viewed with ``torch.frombuffer`` (no Python loop over the
    tokens), a tensor is copied, any other sequence goes through ``torch.tensor``. ``dst`` never
    shares memory with ``x`` (an array with a live buffer view cannot grow)."""
    if len(x) != dst.numel():
        raise ValueError(f"column of {len(x)} values into a tensor of {dst.numel()}")
    if not len(x):
        return dst
    if isinstance(x, array):
        src = _ARRAY_DTYPES.get((x.typecode, x.itemsize))
        if src is not None:
            return dst.copy_(torch.frombuffer(x, dtype=src))
    if isinstance(x, torch.Tensor):
        return dst.copy_(x.detach().reshape(-1))
    return dst.copy_(torch.tensor(list(x), dtype=dst.dtype))


@dataclass
class Sample:
    """One finished rollout.

    - ``prompt_ids``: the prompt tokens (>= 1).
    - ``output_ids``: the generated tokens (may be empty: the sample then has no loss tokens).
    - ``behav_logprobs``: behaviour log-probs of ``output_ids`` (same length), at the sampling
      temperature (the server's ``output_logprobs``, renamed once it becomes a training sample).
    - ``output_versions``: weight version that generated each output token (same length).
    - ``reward``: scalar reward of the whole sample.
    - ``group_id``: samples of the same prompt share it (GRPO/RLOO groups; may have lost members).
    - ``loss_mask``: optional, one 0/1 per output token (multi-turn episodes, ``docs/workflows.md``):
      1 for tokens the model generated, 0 for tool output and environment text spliced in between
      turns. Masked tokens are context only: their ``behav_logprobs`` and ``output_versions`` are
      ignored (0.0 and -1 by convention). None = every output token is a model token.

    The controller fills the per-token fields with ``array.array`` columns (ids and versions
    ``'i'``, log-probs ``'f'``, mask ``'B'``); any sequence of numbers, or a 1-D tensor, is accepted.
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    behav_logprobs: Sequence[float]
    output_versions: Sequence[int]
    reward: float
    group_id: Hashable
    loss_mask: Sequence[int] | None = None

    @classmethod
    def coerce(cls, s, index: int = 0) -> Sample:
        """A Sample from a Sample or a dict; validates lengths, naming the sample ``index``."""
        if isinstance(s, dict):
            try:
                s = cls(**{k: s[k] for k in cls.__dataclass_fields__ if k != "loss_mask"},
                        loss_mask=s.get("loss_mask"))
            except KeyError as e:
                raise ValueError(f"sample {index} lacks key {e.args[0]!r}") from None
        elif not isinstance(s, cls):
            raise TypeError(f"sample {index} must be a Sample or a dict, got {type(s).__name__}")
        g = len(s.output_ids)
        if len(s.prompt_ids) < 1:
            raise ValueError(f"sample {index} has an empty prompt")
        if len(s.behav_logprobs) != g or len(s.output_versions) != g:
            raise ValueError(
                f"sample {index}: output_ids ({g}), behav_logprobs ({len(s.behav_logprobs)}) and "
                f"output_versions ({len(s.output_versions)}) must have the same length"
            )
        if len(s.prompt_ids) + g < 2:
            raise ValueError(f"sample {index} has fewer than 2 tokens in all")
        if s.loss_mask is not None:
            if len(s.loss_mask) != g:
                raise ValueError(f"sample {index}: loss_mask ({len(s.loss_mask)}) must have one entry per output "
                                 f"token ({g})")
            if not _binary(s.loss_mask):
                raise ValueError(f"sample {index}: loss_mask entries must be 0 or 1")
        return s


@dataclass
class Seq:
    """A sample as shifted tensors (CPU), all of length ``n = P + G - 1``."""

    input_ids: torch.Tensor  # int64
    labels: torch.Tensor  # int64
    loss_mask: torch.Tensor  # bool
    behav_logprobs: torch.Tensor  # fp32, 0 where masked
    versions: torch.Tensor  # int64, -1 where masked
    n_gen: int

    def __len__(self) -> int:
        return self.input_ids.numel()


def _binary(m) -> bool:
    if isinstance(m, torch.Tensor):
        return bool(((m == 0) | (m == 1)).all())
    return is_binary_mask(m)


def to_seq(s: Sample) -> Seq:
    p, g = len(s.prompt_ids), len(s.output_ids)
    n = p + g - 1
    ids = torch.empty(p + g, dtype=torch.long)
    copy_column(ids[:p], s.prompt_ids)
    copy_column(ids[p:], s.output_ids)
    mask = torch.zeros(n, dtype=torch.bool)
    if s.loss_mask is None:
        mask[p - 1 :] = True
    else:
        copy_column(mask[p - 1 :], s.loss_mask)
    behav_logprobs = torch.zeros(n, dtype=torch.float32)
    copy_column(behav_logprobs[p - 1 :], s.behav_logprobs)
    ver = torch.full((n,), -1, dtype=torch.long)
    copy_column(ver[p - 1 :], s.output_versions)
    notmask = ~mask
    behav_logprobs.masked_fill_(notmask, 0.0)  # context tokens (prompt, tool output): no behaviour policy
    ver.masked_fill_(notmask, -1)
    return Seq(ids[:-1], ids[1:], mask, behav_logprobs, ver, int(mask.sum()))


def dummy_seq() -> Seq:
    """A one-token sequence with no loss tokens: fills a rank that would otherwise get no sample."""
    z = torch.zeros(1, dtype=torch.long)
    return Seq(z, z.clone(), torch.zeros(1, dtype=torch.bool), torch.zeros(1), torch.full((1,), -1), 0)


@dataclass
class Packed:
    """One packed micro-batch on the device. Per-token fields are [T]."""

    index: list[int]  # sample index per sequence (-1 = dummy)
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [S+1]
    max_seqlen: int
    labels: torch.Tensor
    loss_mask: torch.Tensor
    behav_logprobs: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    prox_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return self.input_ids.numel()

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """A packed [T] tensor back into per-sequence pieces."""
        return list(torch.split(x, (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()))


def pack(index: list[int], seqs: list[Seq], adv: torch.Tensor, device: torch.device,
         prox: dict | None = None, ref: dict | None = None) -> Packed:
    """Pack ``seqs`` (already picked, in ``index`` order) end to end; ``adv`` [len(index)] per sequence."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])

    def cat(name):
        return torch.cat([getattr(s, name) for s in seqs]).to(device, non_blocking=True)

    def per_seq(d):
        if d is None:
            return None
        return torch.cat([d[i] if i >= 0 else torch.zeros(len(s)) for i, s in zip(index, seqs)]).to(device)

    return Packed(
        index=list(index),
        input_ids=cat("input_ids"),
        position_ids=pos.to(device),
        cu_seqlens=cu.to(device),
        max_seqlen=int(lens.max()),
        labels=cat("labels"),
        loss_mask=cat("loss_mask"),
        behav_logprobs=cat("behav_logprobs"),
        versions=cat("versions"),
        advantages=torch.repeat_interleave(adv.float(), lens).to(device),
        prox_logprobs=per_seq(prox),
        ref_logprobs=per_seq(ref),
    )


def split_minibatches(lengths: list[int], n: int) -> list[list[int]]:
    """Token-balanced split into ``n`` minibatches (greedy longest-first to the lightest;
    deterministic, independent of the rank count). Each minibatch lists indices in ascending order."""
    if n > len(lengths):
        raise ValueError(f"ppo_n_minibatches={n} exceeds the {len(lengths)} samples of the batch")
    load = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = min(range(n), key=lambda j: (load[j], j))
        out[j].append(i)
        load[j] += lengths[i]
    return [sorted(m) for m in out]
