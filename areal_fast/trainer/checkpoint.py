"""Checkpoints: torch.distributed.checkpoint (DCP) for model + optimizer, resharded on load,
so a run saved on N ranks resumes on M; and an HF safetensors export.

Layout of a checkpoint directory: DCP files (``.metadata``, ``__<rank>_0.distcp``) holding
``model`` and ``optim`` under the HF-canonical FQNs (``lm.`` prefix), and ``trainer_state.pt``
(rank 0): version, scheduler state, and the RNG states (CPU and CUDA of rank 0, restored on
every rank; the trainer itself draws no random numbers during a step).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STATE_FILE = "trainer_state.pt"


def save_checkpoint(actor, path: str) -> None:
    """Save everything needed to resume ``actor`` (collective: every rank calls it)."""
    os.makedirs(path, exist_ok=True)
    state = {
        "model": get_model_state_dict(actor.model),
        "optim": get_optimizer_state_dict(actor.model, actor.optimizer),
    }
    dcp.save(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        extra = {
            "version": actor.version,
            "scheduler": actor.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "world_size": dist.get_world_size(),
        }
        torch.save(extra, os.path.join(path, _STATE_FILE))
    dist.barrier()


def load_checkpoint(actor, path: str) -> None:
    """Restore ``actor`` from ``path`` written by :func:`save_checkpoint` on any rank count."""
    if not os.path.isfile(os.path.join(path, _STATE_FILE)):
        raise FileNotFoundError(f"{path!r} is not a trainer checkpoint (no {_STATE_FILE})")
    state = {
        "model": get_model_state_dict(actor.model),
        "optim": get_optimizer_state_dict(actor.model, actor.optimizer),
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(actor.model, state["model"])
    set_optimizer_state_dict(actor.model, actor.optimizer, state["optim"])
    extra = torch.load(os.path.join(path, _STATE_FILE), weights_only=False)
    actor.version = int(extra["version"])
    actor.scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng_cpu"])
    if extra["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng_cuda"])


def export_hf(actor, path: str, dtype: torch.dtype | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write ``config.json`` and ``model*.safetensors`` (HF names, unsharded) to ``path`` from rank 0;
    loadable by ``AutoModelForCausalLM.from_pretrained`` and by :class:`PPOActor`. Collective."""
    from safetensors.torch import save_file

    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in actor.iter_full_params(dtype):
        if not rank0:
            continue
        t = t.detach().cpu().contiguous()
        if size and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if rank0:
        actor.hf_config.save_pretrained(path)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, sh in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(sh, os.path.join(path, fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(sh, fname))
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    dist.barrier()
