"""Rollout layer: SGLang HTTP client with interruptible generation, staleness manager, embedded engine.

- ``areal_fast.rollout.client``: ``RolloutClient`` (server pool, interruptible ``generate``, pause /
  continue / flush / abort, ``health`` for watchdogs). Weight updates live in ``areal_fast.weights``.
- ``areal_fast.rollout.staleness``: ``StalenessManager`` (admission bound of decoupled PPO).
- ``areal_fast.embedded``: the embedded engine, a twin of a chosen SGLang release, and its launchers.
- ``areal_fast.rollout.server_command``: the one builder of server command lines (embedded or SGLang).

The SGLang contract (endpoints, version table) is in docs/sglang.md.
Importing this package does not import torch or transformers.
"""
