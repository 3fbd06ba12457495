"""Rollout layer: SGLang HTTP client with interruptible generation, staleness manager, embedded engine.

- ``areal_fast.rollout.client``: ``RolloutClient`` (server pool, interruptible ``generate``, weight-sync
  orchestration calls).
- ``areal_fast.rollout.staleness``: ``StalenessManager`` (admission bound of decoupled PPO).
- ``areal_fast.rollout.engine``: the embedded SGLang-compatible engine and its launchers.
- ``areal_fast.rollout.sglang_launch``: launcher for real SGLang servers.

Importing this package does not import torch or transformers.
"""
