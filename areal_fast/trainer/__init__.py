"""FSDP2 PPO trainer (issue 7): packed micro-batches, varlen attention, proximal recompute,
fused decoupled-PPO loss, checkpoints.

Batch format (what the controller passes)
-----------------------------------------
A list of :class:`Sample` or of dicts with the same keys::

    Sample(prompt_ids=[...], output_ids=[...],
           output_logprobs=[...],   # behaviour log-probs of output_ids (sampling temperature)
           output_versions=[...],   # weight version that generated each output token
           reward=1.0,              # scalar reward of the sample
           group_id="prompt-17")    # samples of one prompt share it (groups may have lost members)

The actor does everything else: shifting, advantages (per group, then optional batch norm),
minibatch split, packing into micro-batches under ``max_tokens_per_mb``, balancing over ranks.

Public API
----------
``PPOActor(TrainerConfig(model_path=..., ppo=PPOConfig(...), optim=OptimConfig(...)))``
    Builds (and joins or creates) the process group: under torchrun it uses the env://
    rendezvous; in a plain process it creates a world-size-1 group (gloo on CPU, nccl on GPU)
    on a free loopback port. Every method below is collective (all ranks call it).
``actor.train_batch(samples) -> dict[str, float]``
    One trainer version (``ppo_n_minibatches`` optimizer steps). With ``broadcast_batch``
    (default) ranks other than 0 may pass None. Metrics: loss, the loss stats (ratio_mean,
    clip_fraction, approx_kl, behav_kl, entropy_mean, ...), grad_norm, lr, version,
    n_tokens, n_loss_tokens, staleness_mean/max (versions behind the pre-step weights),
    step_time_s, tokens_per_s and on GPU mfu.
``actor.version``  (int) trainer weight version; incremented by train_batch.
``actor.compute_logprobs(samples) -> list[Tensor]`` recomputed log-probs of the output tokens.
``actor.iter_full_params(dtype=None)`` yields (HF name, full tensor) one at a time (for weight sync).
``actor.sharded_state_dict()`` HF name -> FSDP2 DTensor shard (no communication).
``actor.full_state_dict(dtype=None)`` HF-named unsharded CPU dict.
``save_checkpoint(actor, dir)`` / ``load_checkpoint(actor, dir)`` (any rank count on load),
``export_hf(actor, dir, dtype=None)`` safetensors + config.json.

Command line (torchrun)::

    python -m torch.distributed.run --nproc-per-node N -m areal_fast.trainer \
        --config trainer.json --batches batches.jsonl [--resume DIR] [--save DIR] [--export-hf DIR]
"""

from areal_fast.trainer.actor import PPOActor
from areal_fast.trainer.advantages import approx_prox_logprobs, batch_normalize, group_advantages
from areal_fast.trainer.batch import Sample
from areal_fast.trainer.checkpoint import export_hf, load_checkpoint, save_checkpoint
from areal_fast.trainer.config import OptimConfig, PPOConfig, TrainerConfig

__all__ = [
    "OptimConfig",
    "PPOActor",
    "PPOConfig",
    "Sample",
    "TrainerConfig",
    "approx_prox_logprobs",
    "batch_normalize",
    "export_hf",
    "group_advantages",
    "load_checkpoint",
    "save_checkpoint",
]
