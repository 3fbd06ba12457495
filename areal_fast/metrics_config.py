"""The ``metrics`` section of a run config: the metric services a run reports to beside its own
files (``metrics.jsonl``, TensorBoard and the plots, which ``log`` turns on and off).

- ``metrics.wandb``: Weights & Biases (online, or offline into the run's directory);
- ``metrics.mlflow``: an MLflow tracking server, or a local sqlite store in the run's directory;
- ``metrics.prometheus``: an HTTP endpoint on the controller's process for Prometheus to scrape.

Each is off until ``enabled: true``. A missing package is refused here, at config load, naming the
pip command (``docs/observability.md``). Torch-free, and no package is imported, only looked up.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, option

__all__ = ["METRICS_EXTRA", "MetricsConfig", "MlflowConfig", "PrometheusConfig", "WandbConfig", "is_loopback"]

METRICS_EXTRA = "pip install 'areal_fast[metrics]'"
WANDB_MODES = ("online", "offline")


def _need(package: str, pip_name: str, what: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"enabled: {what} needs the {pip_name} package, which is not installed: "
                         f"pip install {pip_name} (or {METRICS_EXTRA})")


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


METRICS_KEY_ENV = "AREAL_FAST_METRICS_KEY"
"""The environment variable of the Prometheus endpoint's own scrape key (the user's, and how a rank process
gets it: ``launch.train``)."""


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases: every scalar of metrics.jsonl under TensorBoard's names."""

    enabled: bool = False
    """Report to W&B (needs the wandb package)."""
    project: str = option("areal-fast", nonempty=True)
    """W&B project."""
    entity: str | None = None
    """W&B team or user (None = the API key's default)."""
    name: str | None = None
    """Display name of the W&B run (None = experiment.name)."""
    mode: str | None = option(None, choices=WANDB_MODES)
    """'online' or 'offline' (files only, `wandb sync` them later). None = $WANDB_MODE, else online."""
    dir: str | None = None
    """Where W&B writes its files (None = <output_dir>/tracking)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""

    def __post_init__(self):
        check_rules(self)
        if self.enabled:
            _need("wandb", "wandb", "metrics.wandb")


@dataclass(kw_only=True, slots=True)
class MlflowConfig:
    """MLflow: every scalar of metrics.jsonl under TensorBoard's names, in one MLflow run."""

    enabled: bool = False
    """Report to MLflow (needs the mlflow package; mlflow-skinny is enough for an http(s) server)."""
    tracking_uri: str | None = option(None, nonempty=True)
    """Tracking server or store: 'http://HOST:5000', 'sqlite:///PATH', 'databricks'... None =
    $MLFLOW_TRACKING_URI, else a sqlite store at <output_dir>/tracking/mlflow.db."""
    experiment: str = option("areal-fast", nonempty=True)
    """MLflow experiment (created when missing)."""
    run_name: str | None = None
    """Name of the MLflow run (None = experiment.name)."""

    def __post_init__(self):
        check_rules(self)
        if self.enabled:
            _need("mlflow", "mlflow", "metrics.mlflow")
            uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
            missing = [p for p in ("sqlalchemy", "alembic") if importlib.util.find_spec(p) is None]
            if uri.startswith("sqlite:") and missing:
                where = "<output_dir>/tracking/mlflow.db, the default" if uri == "sqlite:" else uri
                raise ValueError(f"enabled: a sqlite store ({where}) needs {' and '.join(missing)}, which "
                                 f"mlflow-skinny does not install: pip install sqlalchemy alembic (or "
                                 f"{METRICS_EXTRA}), or set metrics.mlflow.tracking_uri to a tracking server")


@dataclass(kw_only=True, slots=True)
class PrometheusConfig:
    """An HTTP endpoint on the controller's process with what an operator alerts on."""

    enabled: bool = False
    """Serve /metrics in Prometheus's text format (needs prometheus-client)."""
    host: str = "127.0.0.1"
    """Address to bind. Any other than loopback (127.0.0.1, ::1, localhost) requires a bearer token on every
    scrape: $AREAL_FAST_METRICS_KEY when set, else (servers the run launches) the key of api_key or
    $AREAL_FAST_API_KEY; one of them must then be set (with servers started by hand, the first:
    docs/observability.md)."""
    port: int = option(9400, ge=0, le=65535)
    """Port to bind (0 = any free port; the run prints the URL)."""

    def __post_init__(self):
        check_rules(self)
        if not self.host or self.host.strip() != self.host:
            raise ValueError(f"host: must be an address or a host name without spaces, got {self.host!r}")
        if self.enabled:
            _need("prometheus_client", "prometheus-client", "metrics.prometheus")


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """Metric services beside the run's own files (docs/observability.md)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
