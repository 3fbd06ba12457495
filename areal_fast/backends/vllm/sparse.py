"""Delta updates on vLLM's ``sparse_nccl`` wire (0.32.0 on; ``docs/vllm.md``, ``docs/weight_sync.md``).

vLLM's sparse weight transfer (``vllm/distributed/weight_transfer/sparse_nccl_engine.py``, read in 0.32.0
and 0.33.0) takes *patches in checkpoint coordinates*: per patch a checkpoint name, its full checkpoint
shape, and ``n`` (int32 flat index, value) pairs. Its worker receives, per patch in the order of the
``/update_weights`` body, a broadcast of the ``n`` indices and one of the ``n`` values from group rank 0,
then ``load_checkpoint_weight_patches`` (``model_loader/checkpoint_weight_patch.py``) builds each
patch's full checkpoint tensor filled with NaN, writes the values at the indices, and runs the model's
own ``load_weights`` with ``Tensor.copy_`` replaced by "keep the destination where the source is NaN".
So the model's loader does the TP slicing and the qkv / gate-up / expert stacking, and an element
stays as it was unless a patch names it. It refuses NaN values (NaN is its "unchanged" mark), indices
outside the tensor and repeated indices, before anything is loaded.

What our delta encoder (``weights/delta.py``) emits maps onto that directly, after the bucket was put
in the checkpoint layout (MoE experts per expert, ``weights/experts.py``), so the shadow and the flat
indices are the checkpoint tensors':

* a delta (``NAME#delta_idx:SHAPE`` + ``NAME#delta_val``): one patch of its changed elements, indices
  ascending (the codec's order), 6 bytes per change in bf16;
* a tensor sent whole (a whole update, or more than ``delta_max_changed`` of it changed): one patch of
  every element, indices ``0 .. n-1`` (the sparse backend has no dense form: 6 bytes per bf16 element
  instead of 2);
* nothing for an unchanged tensor.

A weight that became NaN cannot travel on this wire (vLLM would read it as "unchanged"): refused,
naming the tensor. Torch only; no vLLM import (the wire is the body and the broadcast order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_fast.backends.vllm.requests import sparse_update_body
from areal_fast.weights.delta_wire import split_entries
from areal_fast.weights.errors import WeightSyncError

__all__ = ["Patch", "bucket_patches", "patch_bytes", "patches_body"]

INT32_MAX = 2**31 - 1


@dataclass
class Patch:
    """One checkpoint-coordinate patch: ``values[k]`` goes to flat position ``indices[k]`` of ``name``."""

    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor  # int32, 1-D
    values: torch.Tensor  # the tensor's dtype, 1-D

    @property
    def nbytes(self) -> int:
        return int(self.indices.numel()) * 4 + int(self.values.numel()) * self.values.element_size()


class _Arange:
    """``0 .. n-1`` as int32 on a device, made once for the largest ``n`` asked and sliced after."""

    def __init__(self):
        self.t: torch.Tensor | None = None

    def __call__(self, n: int, device) -> torch.Tensor:
        if self.t is None or self.t.numel() < n or self.t.device != torch.device(device):
            self.t = torch.arange(n, dtype=torch.int32, device=device)
        return self.t[:n]


def bucket_patches(bucket, arange: _Arange | None = None) -> list[Patch]:
    """The patches of one (delta-encoded, checkpoint-layout) bucket, whole tensors first, in the
    bucket's order, then its deltas. WeightSyncError names a tensor vLLM's sparse path cannot take."""
    arange = arange or _Arange()
    named = [(n, bucket.tensor(i)) for i, n in enumerate(bucket.names)]
    whole, deltas = split_entries(named)
    out = []
    for name, t in whole:
        _check(name, t.dtype)
        if t.numel() > INT32_MAX:
            raise WeightSyncError(f"{name}: {t.numel()} elements, more than vLLM's int32 sparse indices address")
        flat = t.reshape(-1)
        out.append(Patch(name, tuple(t.shape), arange(flat.numel(), flat.device), flat))
    for name, (shape, idx, val) in deltas.items():
        _check(name, val.dtype)
        out.append(Patch(name, tuple(shape), idx, val))
    for p in out:
        if p.values.numel() and bool(torch.isnan(p.values).any()):
            raise WeightSyncError(f"{p.name}: a NaN weight cannot be sent to vLLM's sparse_nccl backend (NaN marks "
                                  f"an unchanged element there); the trainer's weights are broken")
    return out


def _check(name: str, dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise WeightSyncError(f"{name}: a {dtype} tensor; vLLM's sparse patches carry floating-point values only "
                              f"(NaN is their unchanged mark)")


def patches_body(patches: list[Patch]) -> dict:
    """The ``/update_weights`` body announcing ``patches`` (``requests.sparse_update_body``), in the order
    they are broadcast: per patch its indices, then its values."""
    return sparse_update_body([p.name for p in patches], [str(p.values.dtype).removeprefix("torch.") for p in patches],
                              [list(p.shape) for p in patches], [p.values.numel() for p in patches])


def patch_bytes(patches: list[Patch]) -> int:
    """The bytes the patches put on the wire (indices and values)."""
    return sum(p.nbytes for p in patches)
