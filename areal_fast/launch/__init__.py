"""Launching a run: ``train.run_train`` (the one driver), the launchers (``local``, ``ray_launcher``
with its actor ``ray_host``, ``slurm``) behind the interface of ``base``, kept servers (``reuse``), one
trainer rank (``rank``), the adapters of the real parts to the controller's ports (``runtime``), the
output directory (``run_dir``), ``evaluate``. Elastic servers are ``areal_fast.elastic``'s, the metric
sinks ``areal_fast.metrics``'s: both below this package."""

from areal_fast.launch.base import LaunchedProcess, Launcher, ProcessDied
from areal_fast.launch.local import LocalLauncher

__all__ = ["LaunchedProcess", "Launcher", "LocalLauncher", "ProcessDied"]
