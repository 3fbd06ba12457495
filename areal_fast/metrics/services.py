"""The metric services of a run: Weights & Biases and MLflow, beside metrics.jsonl and TensorBoard
(``metrics.sinks``), and the one place that opens every sink of a run (:func:`open_sinks`).

Both services get what TensorBoard gets, under the same names (``metrics.scalars``: ``train/reward``,
``train/sync_s``, ``eval/eval_reward``, ``sync/...``), at the record's trainer step.

**Resume.** metrics.jsonl is cut back to the resumed step and TensorBoard purges the later steps
(``TensorBoardSink(purge_step=)``): both keep the lineage that produced the final model. W&B and MLflow
cannot forget a step they were sent, so each is sent a step at most once: the run's W&B id and MLflow
run id, and the last step of each kind sent to each, are kept in ``<output_dir>/tracking/state.json``
(:class:`SinkState`). A resume reopens the same W&B run (``resume="allow"``) and MLflow run, and
skips the records of steps already sent; those steps keep the values of the incarnation that
crashed, the steps after them get the new lineage's. A fresh start (``experiment.resume=false``)
moves ``tracking/`` aside with the rest of the run and opens new runs.

**Failures.** W&B retries in its own service process. An MLflow call that fails (a tracking server
down) is logged and counted, and the run goes on: metrics.jsonl holds every record.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path

from areal_fast.diskutil import open_private, open_private_temp
from areal_fast.metrics.sinks import JsonlSink, ProgressBar, TensorBoardSink, scalars, truncate_jsonl

log = logging.getLogger(__name__)

TRACKING_DIR = "tracking"
STATE_FILE = "state.json"
_KINDS = ("train", "eval", "autoscale")  # the records that carry scalars (checkpoint and samples records carry none)


class SinkState:
    """``<output_dir>/tracking/state.json``: per service its run id and the last step of each kind sent."""

    def __init__(self, out: Path):
        self.dir = Path(out) / TRACKING_DIR
        self.path = self.dir / STATE_FILE
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data: dict = {}
        if self.path.is_file():
            try:
                with os.fdopen(open_private(self.path, os.O_RDONLY), "r") as f:
                    self.data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:  # a half-written file cannot happen (rename), a
                log.warning("%s unreadable (%s): new W&B/MLflow runs", self.path, e)  # foreign one can

    def get(self, service: str) -> dict:
        return self.data.setdefault(service, {"marks": {}})

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        with os.fdopen(open_private_temp(tmp), "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


class _ServiceSink:
    """What W&B and MLflow share: the names (``scalars``) and sending each step at most once."""

    service = ""

    def __init__(self, state: SinkState):
        self.state = state
        self.entry = state.get(self.service)
        self.marks: dict = self.entry.setdefault("marks", {})

    def __call__(self, m: dict) -> None:
        kind = m.get("kind", "train")
        if kind not in _KINDS or "step" not in m:
            return
        step = int(m["step"])
        if step <= self.marks.get(kind, -1):  # sent before a crash: the service keeps that value
            return
        values = scalars(m)
        if values:
            self.send(values, step)
        self.marks[kind] = step
        self.state.save()

    def send(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError


class WandbSink(_ServiceSink):
    """One W&B run per run directory (its id kept in state.json); ``cfg``: ``metrics.wandb``."""

    service = "wandb"

    def __init__(self, cfg, state: SinkState, run_name: str, config: dict | None = None):
        super().__init__(state)
        import wandb

        run_id = self.entry.get("id") or secrets.token_hex(6)  # W&B ids: lowercase letters and digits
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or run_name, id=run_id,
                              resume="allow", mode=cfg.mode, dir=cfg.dir or str(state.dir), tags=list(cfg.tags),
                              config=config, settings=wandb.Settings(console="off", silent=True))
        self.entry["id"] = self.run.id
        self.offline = bool(getattr(self.run, "offline", False)) or self.run.settings.mode == "offline"
        self.files = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id> (or run-<time>-<id>)
        self.state.save()

    def send(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def where(self) -> str:
        if self.offline:
            return f"W&B offline run {self.run.id} in {self.files} (upload: wandb sync {self.files})"
        return f"W&B run {self.run.id}: {self.run.url or self.files}"

    def close(self) -> None:
        self.run.finish()


class MlflowSink(_ServiceSink):
    """One MLflow run per run directory (its id kept in state.json); ``cfg``: ``metrics.mlflow``."""

    service = "mlflow"

    def __init__(self, cfg, state: SinkState, run_name: str, params: dict | None = None):
        super().__init__(state)
        from mlflow.tracking import MlflowClient

        self.uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state.dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.failures = 0
        run_id = self.entry.get("run_id")
        if run_id is None or self.entry.get("tracking_uri") != self.uri:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                cfg.experiment, artifact_location=_artifacts_beside(self.uri))
            run_id = self.client.create_run(exp_id, run_name=cfg.run_name or run_name).info.run_id
            self.marks.clear()
            self.entry.update(run_id=run_id, tracking_uri=self.uri)
            for chunk in _params(params or {}):
                self._quietly(self.client.log_batch, run_id, params=chunk)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.state.save()

    def _quietly(self, fn, *args, **kwargs) -> bool:
        try:
            fn(*args, **kwargs)
            return True
        except Exception as e:  # noqa: BLE001 - a tracking server down must not stop training
            self.failures += 1
            log.warning("MLflow (%s): %s failed (%d so far; metrics.jsonl has every record): %s", self.uri,
                        getattr(fn, "__name__", "call"), self.failures, e)
            return False

    def send(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._quietly(self.client.log_batch, self.run_id,
                      metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def where(self) -> str:
        return f"MLflow run {self.run_id} at {self.uri}"

    def close(self) -> None:
        self._quietly(self.client.set_terminated, self.run_id)


def _artifacts_beside(uri: str) -> str | None:
    """A sqlite store's artifacts go beside its file (MLflow's default is ./mlruns of the working
    directory); None (the server's choice) for any other store."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def _params(flat: dict) -> list:
    """The run config as MLflow params, in batches of 100 (log_batch's limit), values cut to MLflow's
    6,000 characters."""
    from mlflow.entities import Param

    params = [Param(k, str(v)[:6000]) for k, v in flat.items()]
    return [params[i:i + 100] for i in range(0, len(params), 100)]


def flat_config(cfg) -> dict:
    """The run config as dotted keys (``train.optim.lr``: 2e-4), the API key left out."""
    from areal_fast.config import to_dict

    out: dict = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                walk(v, key + ".")
            elif key != "api_key":
                out[key] = v

    walk(to_dict(cfg), "")
    return out


# ----------------------------------------------------------------------------- every sink of a run


class RecordFilter:
    """Passes the controller's records of one ``kind`` to ``sink`` (``keep=True``), or every other
    record (``keep=False``): samples.jsonl takes the "samples" records, metrics.jsonl the rest."""

    def __init__(self, sink, kind: str, keep: bool):
        self.sink, self.kind, self.keep = sink, kind, keep

    def __call__(self, record: dict) -> None:
        if (record.get("kind") == self.kind) == self.keep:
            self.sink(record)


def open_sinks(cfg, start_step: int, progress: bool, closers: list, where: dict) -> list:
    """The controller's callbacks of a run resumed at ``start_step``: metrics.jsonl (cut back to it),
    samples.jsonl, TensorBoard (later steps purged), W&B, MLflow, the progress bar. Each opened sink
    is appended to ``closers``; ``where`` gets one line per sink that writes somewhere."""
    out = cfg.experiment.out
    truncate_jsonl(out / "metrics.jsonl", start_step)
    metrics_sink = JsonlSink(out / "metrics.jsonl")
    sinks: list = [RecordFilter(metrics_sink, "samples", keep=False)]
    closers.append(metrics_sink)
    where["jsonl"] = str(out / "metrics.jsonl")
    if cfg.log.samples:
        truncate_jsonl(out / "samples.jsonl", start_step)
        samples_sink = JsonlSink(out / "samples.jsonl")
        sinks.append(RecordFilter(samples_sink, "samples", keep=True))
        closers.append(samples_sink)
        where["samples"] = str(out / "samples.jsonl")
    if cfg.log.tensorboard:
        tb = TensorBoardSink(out / "tensorboard", purge_step=start_step + 1 if start_step > 0 else None)
        closers.append(tb)
        sinks.append(tb)
        if tb.w is not None:
            where["tensorboard"] = str(out / "tensorboard")
    m = cfg.metrics
    if m.wandb.enabled or m.mlflow.enabled:
        state = SinkState(out)
        flat = flat_config(cfg)
        for on, build in ((m.wandb.enabled, lambda: WandbSink(m.wandb, state, cfg.experiment.name, flat)),
                          (m.mlflow.enabled, lambda: MlflowSink(m.mlflow, state, cfg.experiment.name, flat))):
            if on:
                sink = build()
                closers.append(sink)
                sinks.append(sink)
                where[sink.service] = sink.where()
    bar = ProgressBar(cfg.experiment.total_steps, start_step, enabled=progress)
    sinks.append(bar)
    closers.append(bar)
    return sinks
