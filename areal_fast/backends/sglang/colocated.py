"""SGLang's colocated weight update (GPU only): per-TP-rank SGLang-layout shards through CUDA IPC
(the shards are built by ``areal_fast/weights/colocated.py``).

Setting: one SGLang server with ``tp == trainer world size`` shares the trainer's GPUs, TP rank
r on trainer rank r's GPU. Each trainer rank

1. allocates its TP rank's SGLang-layout buffer (``1/tp`` of the model in the sent dtype, plus the
   vocabulary padding) and plans it once (``plan_tp_shard``: qkv / gate_up stacking, TP splits,
   replicated kv heads, vocabulary padding, cast),
2. fills it **one bucket at a time** (:func:`build_tp_shard_streamed`): the HF tensors of a bucket
   of at most ``weights.bucket_bytes`` (a larger tensor alone) are materialised whole
   (``DTensor.full_tensor()``, one all-gather per tensor, cast to the sent dtype on the shard
   before the gather), copied into the buffer by one interval-copy launch, and freed before the
   next bucket; so the extra memory is one bucket, not the model (a 7B model gathered whole
   in fp32 is 30.5 GB on every GPU),
3. serialises ``[(sglang_name, view)]`` with CUDA IPC handles exactly like SGLang's
   ``MultiprocessingSerializer.serialize(..., output_str=True)`` (ForkingPickler + base64),

and rank 0 posts ``/update_weights_from_tensor`` with one payload per TP rank and
``load_format="direct"`` (the server copies each tensor into the parameter of that name).
Buffers stay alive until the next update, since the server reads them after we return.

Status: written against the protocol but not yet run on a GPU in CI (no device was lent); on a
CPU-only machine :meth:`ColocatedWeightSync.update` raises NotImplementedError (the gather and
build, :meth:`ColocatedWeightSync._send`, are tested on the CPU with the server stubbed).
"""

from __future__ import annotations

import base64
import io

import torch
import torch.distributed as dist

from areal_fast.backends.sglang.weight_sync import SGLangWeightSync
from areal_fast.weights.colocated import build_tp_shard_streamed
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.layout import ModelSpec, clean_name, sendable
from areal_fast.weights.plan import TPShardPlan


def serialize_for_sglang(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): CUDA tensors become IPC handles."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


class ColocatedWeightSync(SGLangWeightSync):
    """``/update_weights_from_tensor`` with per-TP-rank shards (see the module docstring)."""

    def __init__(self, server, spec: ModelSpec, config: WeightSyncConfig | None = None, group=None):
        super().__init__([server], config, group)
        self.spec = spec
        self._plan: TPShardPlan | None = None
        self._alive: torch.Tensor | None = None

    def update(self, model_or_state, version) -> None:
        if not torch.cuda.is_available():
            raise NotImplementedError("ColocatedWeightSync needs CUDA (CUDA IPC handles); on CPU use "
                                      "DistributedWeightSync (gloo) or DiskWeightSync")
        super().update(model_or_state, version)

    def _collect(self, model_or_state):
        return model_or_state  # the full tensors are materialised in _send, a bucket at a time

    def _send(self, model_or_state, version: str) -> None:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        rank = self.rank
        state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
        sources = sendable({clean_name(k): v for k, v in state.items()}, self.spec)
        layout_error = None
        if rank == 0:  # checked now, raised after the gathers below (the other ranks take part in them)
            try:
                facts = self.read_facts()[self.urls[0]]
                facts.check_layout(dp_attention_ok=False)  # it builds SGLang's TP layout itself
                if facts.tp_size != world:
                    raise ValueError(f"{self.urls[0]} has tp_size={facts.tp_size}, the trainer group "
                                     f"has {world} ranks; colocated sync needs one TP rank per trainer rank")
            except Exception as e:  # noqa: BLE001 - re-raised below
                layout_error = e
        self._alive = None  # last update's buffer: the server has loaded it (it answered), free it first
        buf, named, self._plan = build_tp_shard_streamed(
            sources, self.spec, world, rank, self.config.send_dtype("cuda") or torch.bfloat16, self._plan,
            self.config.bucket_bytes)
        if buf.is_cuda:
            torch.cuda.current_stream().synchronize()  # the server reads through IPC on its own streams
        self._alive = buf
        payload = serialize_for_sglang(named)
        payloads = [None] * world if rank == 0 else None
        if world > 1:
            dist.gather_object(payload, payloads, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                               group=self.group)
        else:
            payloads = [payload]
        if layout_error is not None:
            raise layout_error
        if rank == 0:
            with self.session():  # ended even when the update is refused: the next update can begin
                self.http.all(self.urls, "/update_weights_from_tensor", {
                    "serialized_named_tensors": payloads, "load_format": "direct",
                    "flush_cache": self.config.flushes, "abort_all_requests": False, "weight_version": version})
