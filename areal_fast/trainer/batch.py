"""The batch format the controller hands the trainer, and packing into micro-batches.

A batch is a list of :class:`~areal_fast.sample.Sample`, the one sample record the rollout client
filled and the workflow extended (or dicts of its keyword arguments). The trainer reads
``prompt_ids``, ``output_ids``, ``output_logprobs``, ``output_versions``, ``loss_mask``, ``reward``
and ``group_id`` (samples of one prompt share it: GRPO/RLOO groups, which may have lost members).
The actor turns each into a shifted sequence (:class:`Seq`: inputs ``ids[:-1]``, labels
``ids[1:]``: position t predicts token t+1), so a sample of P prompt and G generated tokens
contributes ``P + G - 1`` tokens, the last G of which are in the loss; masked tokens (prompt, tool
output) get behaviour log-prob 0 and version -1 there.

:class:`Seq` and :class:`Packed` are the math layer: tensors over the whole shifted sequence, named
as the loss ops take them (``behav_logprobs``, ``versions``), not per-output-token columns.

The samples' ``array.array`` columns (``areal_fast.columns``) become tensors through
``torch.frombuffer`` and one dtype conversion each, without a Python loop over the tokens
(:func:`copy_column`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from areal_fast.sample import Sample

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


def as_sample(s, index: int = 0) -> Sample:
    """The sample ``s`` checked for training, naming it ``index`` in errors: a
    :class:`~areal_fast.sample.Sample` as it is (the controller's: no copy, no conversion), or a
    dict of its keyword arguments (tests, tools; lists and tensors become arrays, an absent or None
    ``loss_mask`` means every output token is a model token). Length and mask checks only: no
    per-token Python work."""
    if isinstance(s, dict):
        kw = {k: v for k, v in s.items() if k in _SAMPLE_FIELDS and not (k == "loss_mask" and v is None)}
        missing = [k for k in ("prompt_ids", "output_ids", "output_logprobs", "output_versions", "reward",
                                                  "group_id")
                   if k not in kw]
        if missing:
            raise ValueError(f"sample {index} lacks key {missing[0]!r}")
        s = Sample(**kw)
    elif not isinstance(s, Sample):
        raise TypeError(f"sample {index} must be a Sample or a dict, got {type(s).__name__}")
    if not s.prompt_ids:
        raise ValueError(f"sample {index} has an empty prompt")
    s.check(f"sample {index}")
    if len(s.prompt_ids) + len(s.output_ids) < 2:
        raise ValueError(f"sample {index} has fewer than 2 tokens in all")
    return s


_SAMPLE_FIELDS = frozenset(Sample.__dataclass_fields__)


@dataclass
class Seq:
    """A sample as shifted tensors (CPU), all of length ``n = P + G - 1``."""

    input_ids: torch.Tensor  # int64
    labels: torch.Tensor  # int64
    loss_mask: torch.Tensor  # bool
    behav_logprobs: torch.Tensor  # fp32, 0 where masked
    versions: torch.Tensor  # int64, -1 where masked
    n_gen: int
    routing: torch.Tensor | None = None  # int16 [n, layers x top_k] (routing replay), -1 unrecorded

    def __len__(self) -> int:
        return self.input_ids.numel()


def to_seq(s: Sample, routing: bool = False) -> Seq:
    """``s`` as shifted tensors; ``routing``: with its ``routed_experts`` rows (the inputs' positions,
    ``[n, layers x top_k]``), when it has any."""
    p, g = len(s.prompt_ids), len(s.output_ids)
    n = p + g - 1
    ids = torch.empty(p + g, dtype=torch.long)
    copy_column(ids[:p], s.prompt_ids)
    copy_column(ids[p:], s.output_ids)
    mask = torch.zeros(n, dtype=torch.bool)
    copy_column(mask[p - 1 :], s.loss_mask)
    behav_logprobs = torch.zeros(n, dtype=torch.float32)
    copy_column(behav_logprobs[p - 1 :], s.output_logprobs)
    ver = torch.full((n,), -1, dtype=torch.long)
    copy_column(ver[p - 1 :], s.output_versions)
    notmask = ~mask
    behav_logprobs.masked_fill_(notmask, 0.0)  # context tokens (prompt, tool output): no behaviour policy
    ver.masked_fill_(notmask, -1)
    rows = None
    width = s.routing_width() if routing else 0
    if width:
        rows = copy_column(torch.empty(n * width, dtype=torch.int16), s.routed_experts).view(n, width)
    return Seq(ids[:-1], ids[1:], mask, behav_logprobs, ver, int(mask.sum()), rows)


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
    routing: torch.Tensor | None = None  # int16 [T, layers x top_k] on the CPU: routing replay's rows
    # A context-parallel share (trainer/parallel/context.py): cu_seqlens are the pieces of sequences
    # this rank holds, attn_cu_seqlens the whole padded row's (what attention sees after the all-to-all)
    attn_cu_seqlens: torch.Tensor | None = None
    attn_max_seqlen: int | None = None
    n_pad: int = 0  # padding rows at the end (out of the loss)

    @property
    def n_tokens(self) -> int:
        """Real tokens (padding not counted)."""
        return self.input_ids.numel() - self.n_pad

    def model_args(self) -> tuple:
        """``(input_ids, position_ids, cu_seqlens, max_seqlen)`` as the policy's forward takes them:
        the attention's boundaries (the whole row's for a context-parallel share)."""
        if self.attn_cu_seqlens is None:
            return self.input_ids, self.position_ids, self.cu_seqlens, self.max_seqlen
        return self.input_ids, self.position_ids, self.attn_cu_seqlens, self.attn_max_seqlen

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """A packed [T] tensor back into per-sequence pieces."""
        if self.attn_cu_seqlens is not None:
            raise ValueError("Packed.split: a context-parallel share holds pieces of sequences; gather the row first")
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
        routing=_pack_routing(seqs),
    )


def _pack_routing(seqs: list[Seq]) -> torch.Tensor | None:
    """The sequences' routing rows end to end (-1 rows for a sequence without any); None when none has."""
    widths = {s.routing.shape[1] for s in seqs if s.routing is not None}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"routing replay: sequences of one micro-batch record {sorted(widths)} expert ids a position")
    (w,) = widths
    return torch.cat([s.routing if s.routing is not None else torch.full((len(s), w), -1, dtype=torch.int16)
                      for s in seqs])


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
