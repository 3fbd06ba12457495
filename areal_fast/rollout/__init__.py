"""Rollout layer: the generic client of inference servers (it names no backend).

- ``areal_fast.rollout.client``: ``RolloutClient``, the interface a backend's adapter implements
  (server pool, interruptible ``generate``, pause / continue / flush / abort, ``health`` for
  watchdogs); the adapters are ``areal_fast.backends.<name>.client``, chosen by name through
  ``areal_fast.backends.registry``. Weight updates live in ``areal_fast.weights``.
- ``areal_fast.rollout.calls``: every call to a server, the retry policy, the one health check.
- ``areal_fast.rollout.staleness``: ``StalenessManager`` (admission bound of decoupled PPO).
- ``areal_fast.rollout.sharded``: the client in worker processes.

Importing this package does not import torch or transformers.
"""
