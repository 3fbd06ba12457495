"""Delta updates on a real SGLang server, through SGLang's external model package.

SGLang (0.5.6 to 0.5.23, read in their sources) offers two places to run our code on a weight
update: ``--custom-weight-loader`` (named by ``load_format`` of ``/update_weights_from_tensor``
only: CUDA IPC handles or serialized tensors, so servers on the trainer's node) and
``SGLANG_EXTERNAL_MODEL_PACKAGE`` (a package whose modules' ``EntryClass`` replace the model
classes of the same architecture name). ``/update_weights_from_distributed`` ends, in every one of
these releases, in ``model.load_weights(named_tensors)`` (per tensor or ``flattened_bucket``), so a
model class whose ``load_weights`` understands delta entries receives deltas over the broadcast
group, across nodes. :mod:`areal_fast.backends.sglang.models` is that package::

    SGLANG_EXTERNAL_MODEL_PACKAGE=areal_fast.backends.sglang.models python -m sglang.launch_server ...

and the trainer's ``weights.delta: on``. Its classes subclass SGLang's own (Qwen2, Qwen3, Llama)
and change nothing but ``load_weights``: whole tensors go to SGLang's loader unchanged; a delta is
written into the parameter that holds the tensor on this TP rank.

Where an HF tensor lives in SGLang's parameters (fused qkv / gate_up, TP shards, padded vocab) is
decided by SGLang's own loaders, so we ask them once per tensor: the candidate parameters'
storage is swapped for int32 scratch filled with -1, SGLang's ``load_weights`` loads the tensor's
flat indices (``arange``) into it, and the written positions give runs
``(hf_start, param_start, length)``; the storage is put back. A delta then maps index ``i`` to
``param_start + i - hf_start`` of the run holding it (a binary search), and positions that no run
holds belong to another TP rank. The runs are cached per tensor (a few per tensor: one per shard,
or one per row for input-dim splits).

Indices outside the tensor (negative, or at least the product of the shape in the index entry's
name) are refused with a ValueError naming the tensor and the index, like the embedded engine's
receiver: a run-less position is another rank's only inside the tensor. The check comes before
anything is written: an update call (a list, as SGLang's ``/update_weights_from_*`` pass) is checked
whole before its whole tensors go to SGLang's loader; a streamed iterator (start-up's checkpoint,
where no delta occurs) cannot be, so there every delta is checked before the first is applied.
"""

from __future__ import annotations

import importlib
import math
import re

import torch

from areal_fast.weights.delta_codec import delta_apply
from areal_fast.weights.delta_wire import check_indices, parse_delta_name, split_entries

__all__ = ["delta_model_class", "load_weights_with_deltas", "trace_runs"]


def delta_model_class(module: str, name: str) -> type:
    """SGLang's model class ``module.name`` with a ``load_weights`` that applies delta entries."""
    base = getattr(importlib.import_module(module), name)

    def load_weights(self, weights):
        return load_weights_with_deltas(self, weights, super(cls, self).load_weights)

    cls = type(name, (base,), {"load_weights": load_weights, "__module__": __name__,
                               "__doc__": f"{module}.{name} that also applies delta weight updates."})
    return cls


def _candidates(params: dict, name: str) -> list[str]:
    """Parameters SGLang may load HF tensor ``name`` into: siblings of its module (``q_proj.weight``
    -> ``qkv_proj.weight``), with the same leaf name."""
    parent, _, leaf = name.rpartition(".")
    grand = parent.rpartition(".")[0]
    pat = re.compile(("" if not grand else re.escape(grand) + r"\.") + r"[^.]+\." + re.escape(leaf) + "$")
    return [p for p in params if pat.match(p)]


def trace_runs(model: torch.nn.Module, name: str, shape: tuple[int, ...], load) -> list[tuple]:
    """``[(param name, hf_start, param_start, length)]`` (int64 tensors, sorted by hf_start): where
    ``load([(name, tensor)])`` puts each element of ``name`` on this rank."""
    params = dict(model.named_parameters())
    cands = _candidates(params, name)
    saved = {}
    numel = math.prod(shape)
    try:
        for pn in cands:
            saved[pn] = params[pn].data
            params[pn].data = torch.full(tuple(params[pn].shape), -1, dtype=torch.int32)
        load([(name, torch.arange(numel, dtype=torch.int32).view(shape))])
        out = []
        for pn in cands:
            flat = params[pn].data.reshape(-1)
            pos = torch.nonzero(flat >= 0).reshape(-1)
            if pos.numel() == 0:
                continue
            hf = flat[pos].long()
            order = torch.argsort(hf)
            hf, pos = hf[order], pos[order]
            brk = torch.nonzero((hf.diff() != 1) | (pos.diff() != 1)).reshape(-1) + 1
            starts = torch.cat([torch.zeros(1, dtype=torch.long), brk])
            ends = torch.cat([brk, torch.tensor([hf.numel()])])
            out.append((pn, hf[starts], pos[starts], ends - starts))
        return out
    finally:
        for pn, d in saved.items():
            params[pn].data = d


def _apply_runs(param: torch.nn.Parameter, runs, idx: torch.Tensor, val: torch.Tensor) -> None:
    hf_start, p_start, length = (t.to(param.device) for t in runs)
    i = idx.to(param.device).long()
    r = torch.searchsorted(hf_start, i, right=True) - 1
    ok = r >= 0
    r = r.clamp(min=0)
    off = i - hf_start[r]
    ok &= off < length[r]
    pos = (p_start[r] + off)[ok]
    v = val.to(param.device)[ok]
    with torch.no_grad():
        if param.dtype == v.dtype and param.data.is_contiguous():
            delta_apply(param.data, pos.to(torch.int32), v, check=False)
        else:
            param.data.view(-1)[pos] = v.to(param.dtype)


def _check_deltas(deltas: dict) -> None:
    """Refuse any delta without a shape or with an index outside its tensor, before one is applied."""
    for name, (shape, idx, _val) in deltas.items():
        if shape is None:
            raise ValueError(f"delta for {name}: the index entry carries no shape")
        check_indices(name, math.prod(shape), idx)


def load_weights_with_deltas(model: torch.nn.Module, weights, load):
    """Whole tensors through ``load`` (SGLang's ``load_weights``), then every delta entry in place.
    A delta that does not fit its tensor raises ValueError before anything is written (see above)."""
    marked = []
    if isinstance(weights, (list, tuple)):  # an update call: check its deltas before the whole tensors load
        _check_deltas(split_entries([(n, t) for n, t in weights if parse_delta_name(n) is not None])[1])

    def whole_only():  # streamed: at start-up SGLang hands the checkpoint's iterator to load_weights
        for name, t in weights:
            if parse_delta_name(name) is None:
                yield name, t
            else:
                marked.append((name, t))

    result = load(whole_only())
    _, deltas = split_entries(marked)
    if deltas:
        _check_deltas(deltas)
        cache = model.__dict__.setdefault("_areal_delta_runs", {})
        params = dict(model.named_parameters())
        for name, (shape, idx, val) in deltas.items():
            key = (name, tuple(shape))
            if key not in cache:
                cache[key] = trace_runs(model, name, tuple(shape), load)
            for pn, *runs in cache[key]:
                _apply_runs(params[pn], runs, idx, val)
    return result
