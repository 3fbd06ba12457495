"""FSDP2 PPO trainer: packed micro-batches, varlen attention, proximal recompute, fused
decoupled-PPO loss (``docs/objective.md``), checkpoints.

Batch format (what the controller passes)
-----------------------------------------
A list of :class:`Sample` (``areal_fast.sample``: the one record the rollout client fills and the
controller buffers) or of dicts of its keyword arguments::

    Sample(prompt_ids=[...], output_ids=[...],
           output_logprobs=[...],   # behaviour log-probs of output_ids (sampling temperature)
           output_versions=[...],   # weight version that generated each output token
           reward=1.0,              # scalar reward of the sample
           group_id="prompt-17")    # samples of one prompt share it (groups may have lost members)

The actor does everything else: shifting, advantages (per group, then optional batch norm),
minibatch split, packing into micro-batches under ``max_tokens_per_mb``, balancing over ranks.

Public API
----------
``PPOActor(TrainerConfig(model_path=..., ppo=PPOConfig(loss=PPOLossConfig(...)), optim=OptimConfig(...)))``
    Builds (and joins or creates) the process group: under torchrun it uses the env://
    rendezvous; in a plain process it creates a world-size-1 group (gloo on CPU, nccl on GPU)
    on a free loopback port. Every method below is collective (all ranks call it).
``actor.train_batch(samples, version=None) -> dict[str, float]``
    One trainer version: the weights of ``version`` (the controller's; None: ``actor.version``)
    become ``version + 1`` (``ppo_n_minibatches`` optimizer steps). With ``broadcast_batch``
    (default) ranks other than 0 may pass None. Metrics: loss, the loss stats (ratio_mean,
    clip_fraction, approx_kl, behav_kl, entropy_mean, ...), grad_norm, lr, version,
    n_tokens, n_loss_tokens, staleness_mean/max (versions behind the pre-step weights),
    step_time_s, tokens_per_s and on GPU mfu.
``actor.version``  (int) the version of the actor's weights as it was last told (train_batch, load);
    the controller owns the version, the actor counts nothing itself.
``actor.compute_logprobs(samples) -> list[Tensor]`` recomputed log-probs of the output tokens.
``actor.iter_full_params(dtype=None)`` yields (HF name, full tensor) one at a time (for weight sync).
``actor.sharded_state_dict()`` HF name -> FSDP2 DTensor shard (no communication).
``actor.full_state_dict(dtype=None)`` HF-named unsharded CPU dict.
``save_checkpoint(actor, dir, version=None)`` / ``load_checkpoint(actor, dir)`` (any rank count on load; every
file is fsynced before save returns; a damaged file raises ``CheckpointError`` naming it;
``read_trainer_state(dir)`` checks a checkpoint cheaply without a model),
``export_hf(actor, dir, dtype=None)`` safetensors + config.json.

Command line (torchrun)::

    python -m torch.distributed.run --nproc-per-node N -m areal_fast.trainer \
        --config trainer.json --batches batches.jsonl [--resume DIR] [--save DIR] [--export-hf DIR]
"""

from __future__ import annotations

from areal_fast._lazy import lazy_exports

# name -> submodule, loaded on first use: ``areal_fast.trainer.config`` stays importable without
# torch (the run config loads and validates it before any process starts)
_EXPORTS = {
    "PPOActor": "actor",
    "approx_prox_logprobs": "advantages",
    "batch_normalize": "advantages",
    "group_advantages": "advantages",
    "Sample": "batch",
    "CheckpointError": "checkpoint",
    "export_hf": "checkpoint",
    "read_trainer_state": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "OptimConfig": "config",
    "PPOConfig": "config",
    "ParallelConfig": "config",
    "TrainerConfig": "config",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
