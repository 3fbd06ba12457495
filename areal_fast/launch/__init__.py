"""Launching a run: local subprocess launcher, adapters to the real parts, metric sinks, ``train``."""

from areal_fast.launch.local import LocalLauncher, ProcessDied

__all__ = ["LocalLauncher", "ProcessDied"]
