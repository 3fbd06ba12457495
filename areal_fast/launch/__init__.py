"""Launching a run: ``train.run_train`` (the one driver), the launchers (``local``, ``ray_launcher``)
behind the interface of ``base``, one trainer rank (``rank``), the adapters of the real parts to the
controller's ports (``runtime``), the output directory (``run_dir``), metric sinks, ``evaluate``."""

from areal_fast.launch.base import LaunchedProcess, Launcher, ProcessDied
from areal_fast.launch.local import LocalLauncher

__all__ = ["LaunchedProcess", "Launcher", "LocalLauncher", "ProcessDied"]
