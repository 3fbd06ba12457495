"""A run's metric sinks (``docs/observability.md``): metrics.jsonl, TensorBoard, the progress bar and
the plots (``sinks``), W&B and MLflow (``services``), and the Prometheus endpoint (``prometheus``).
Their configuration is the ``metrics`` section, ``areal_fast.metrics_config``."""
