"""W&B and MLflow beside metrics.jsonl and TensorBoard (``areal_fast.metrics.services``), with the
real packages in their local modes (W&B offline, MLflow on a sqlite store in the run directory), no
network. What is read back is read with each tool's own reader where it has one: TensorBoard's event
accumulator, ``MlflowClient.get_metric_history``; W&B 0.31 ships no Python reader of its offline
``run-<id>.wandb`` file, so :func:`read_wandb_history` reads its record log (LevelDB's log format
behind a 7-byte ``:W&B`` header) and parses each record with wandb's own protobuf classes.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
from tolerances import FP32_FEW_ROUNDINGS_RTOL

from areal_fast.config import ConfigError, load_config

WANDB_HEADER = struct.Struct("<4sHB")  # ':W&B', magic 0xBEE1, version
LOG_BLOCK = 32768
LOG_RECORD = struct.Struct("<IHB")  # crc32, length, type (1 full, 2 first, 3 middle, 4 last)


def read_wandb_history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history record in an offline ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _ = WANDB_HEADER.unpack_from(data)
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B record log"
    out, pos, pending = [], WANDB_HEADER.size, b""
    while pos + LOG_RECORD.size <= len(data):
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < LOG_RECORD.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = LOG_RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        pending += data[pos + LOG_RECORD.size:pos + LOG_RECORD.size + length]
        pos += LOG_RECORD.size + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                out.append((rec.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return out


def wandb_values(out: Path) -> dict[str, dict[int, float]]:
    """{name: {step: value}} over every offline run file of the run; a step sent twice fails."""
    seen: dict[str, dict[int, float]] = {}
    files = sorted((out / "tracking" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, "W&B wrote no offline run file"
    for f in files:
        for step, items in read_wandb_history(f):
            for k, v in items.items():
                assert step not in seen.setdefault(k, {}), f"W&B got step {step} of {k} twice"
                seen[k][step] = v
    return seen


def mlflow_values(out: Path) -> dict[str, dict[int, float]]:
    """{name: {step: value}} of the run's MLflow run; a step logged twice fails."""
    from mlflow.tracking import MlflowClient

    state = json.loads((out / "tracking" / "state.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    seen: dict[str, dict[int, float]] = {}
    for key in run.data.metrics:
        hist = client.get_metric_history(state["run_id"], key)
        steps = [m.step for m in hist]
        assert len(steps) == len(set(steps)), f"MLflow got a step of {key} twice: {sorted(steps)}"
        seen[key] = {m.step: m.value for m in hist}
    return seen


def tensorboard_values(out: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    seen = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), f"TensorBoard shows a step of {tag} twice"
        seen[tag] = {e.step: e.value for e in events}
    return seen


def jsonl_values(out: Path) -> dict[str, dict[int, float]]:
    from areal_fast.metrics.sinks import read_jsonl, scalars

    seen: dict[str, dict[int, float]] = {}
    for rec in read_jsonl(out / "metrics.jsonl"):
        for k, v in scalars(rec).items():
            seen.setdefault(k, {})[rec["step"]] = v
    return seen


def assert_same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert sorted(a[k]) == sorted(b[k]), f"{what}: {k} has steps {sorted(a[k])} vs {sorted(b[k])}"
        for s in a[k]:
            assert a[k][s] == pytest.approx(b[k][s], rel=FP32_FEW_ROUNDINGS_RTOL), f"{what}: {k} at step {s}"


def skip_without_services() -> None:
    for mod in ("wandb", "mlflow", "sqlalchemy", "alembic", "tensorboard"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install 'areal_fast[metrics]')")


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> str:
    """One sqlite store for the tests of this file: creating one runs MLflow's migrations (~10 s on 2
    busy cores). Runs write their own default store in the e2e test (test_prometheus.py)."""
    skip_without_services()
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


@pytest.fixture
def services(monkeypatch, mlflow_store) -> str:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "")  # offline needs none; never one from this machine
    return mlflow_store


def _cfg(out: Path):
    return load_config(None, [f"experiment.output_dir={out}", "experiment.total_steps=6", "log.tensorboard=true",
                              "metrics.wandb.enabled=true", "metrics.wandb.mode=offline",
                              "metrics.mlflow.enabled=true"])


def _train(step: int, base: float) -> dict:
    return {"kind": "train", "step": step, "time": 0.1 * step, "reward": base + step / 10, "tokens": 40 + step,
            "staleness_mean": 0.5, "staleness": [0, 1], "positions": [step], "train/loss": -base * step,
            "sync/servers": 1, "tool/ok": step, "sync_s": 0.01 * step, "flag": True}


def _feed(cfg, start_step: int, records: list[dict]) -> dict:
    from areal_fast.metrics.services import open_sinks

    closers, where = [], {}
    sinks = open_sinks(cfg, start_step, False, closers, where)
    try:
        for r in records:
            for s in sinks:
                s(r)
    finally:
        for c in closers:
            c.close()
    return where


def test_wandb_offline_and_mlflow_get_the_names_and_values_tensorboard_gets(tmp_path, services):
    out = tmp_path / "run"
    cfg = _cfg(out)
    records = [{"kind": "eval", "step": 0, "eval_reward": 0.25, "eval_n": 8}]
    records += [_train(s, 1.0) for s in (1, 2, 3)]
    records += [{"kind": "eval", "step": 3, "eval_reward": 0.5, "eval_n": 8},
                {"kind": "checkpoint", "step": 3, "path": "x"}]
    where = _feed(cfg, 0, records)
    tb = tensorboard_values(out)
    assert "train/reward" in tb and "train/loss" in tb and "sync/servers" in tb and "eval/eval_reward" in tb
    assert "train/flag" not in tb and "train/staleness" not in tb  # booleans and lists are no scalars
    assert_same(jsonl_values(out), tb, "metrics.jsonl vs TensorBoard")
    assert_same(wandb_values(out), tb, "W&B vs TensorBoard")
    assert_same(mlflow_values(out), tb, "MLflow vs TensorBoard")
    assert set(where) == {"jsonl", "tensorboard", "wandb", "mlflow"}
    assert "wandb sync" in where["wandb"] and services in where["mlflow"]


def test_a_resume_sends_each_step_once_to_every_sink(tmp_path, services):
    """A run that made steps 1-4, crashed and resumed from its checkpoint at step 2: the steps 3-5 of
    the resumed run reach metrics.jsonl and TensorBoard (which purges the crashed run's 3-4); W&B and
    MLflow, which cannot forget a step, keep the crashed run's 3-4 and get 5, in the same W&B and
    MLflow run, no step twice."""
    out = tmp_path / "run"
    cfg = _cfg(out)
    _feed(cfg, 0, [_train(s, 1.0) for s in (1, 2, 3, 4)])
    state = json.loads((out / "tracking" / "state.json").read_text())
    _feed(cfg, 2, [_train(s, 2.0) for s in (3, 4, 5)])
    assert json.loads((out / "tracking" / "state.json").read_text())["mlflow"]["run_id"] == state["mlflow"]["run_id"]
    ids = {f.stem for f in (out / "tracking" / "wandb").glob("offline-run-*/run-*.wandb")}
    assert ids == {f"run-{state['wandb']['id']}"}  # two incarnations, one W&B run
    new = {3: 2.3, 4: 2.4, 5: 2.5}
    for name, values in (("metrics.jsonl", jsonl_values(out)), ("TensorBoard", tensorboard_values(out))):
        assert values["train/reward"] == pytest.approx({1: 1.1, 2: 1.2, **new}), name
    for name, values in (("W&B", wandb_values(out)), ("MLflow", mlflow_values(out))):
        assert values["train/reward"] == pytest.approx({1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4, 5: 2.5}), name


def test_a_fresh_start_opens_new_runs(tmp_path, services):
    """experiment.resume=false moves tracking/ aside with the run: the next run gets a new W&B id and
    MLflow run and sends every step again."""
    from areal_fast.config import save_config
    from areal_fast.launch.run_dir import move_previous_run_aside

    out = tmp_path / "run"
    cfg = _cfg(out)
    out.mkdir(parents=True)
    save_config(cfg, out / "config.yaml")
    _feed(cfg, 0, [_train(1, 1.0)])
    first = json.loads((out / "tracking" / "state.json").read_text())
    move_previous_run_aside(out, say=lambda m: None)
    _feed(cfg, 0, [_train(1, 3.0)])
    second = json.loads((out / "tracking" / "state.json").read_text())
    assert second["wandb"]["id"] != first["wandb"]["id"] and second["mlflow"]["run_id"] != first["mlflow"]["run_id"]
    assert mlflow_values(out)["train/reward"] == pytest.approx({1: 3.1})


@pytest.mark.parametrize("override, package, pip", [
    ("metrics.wandb.enabled=true", "wandb", "pip install wandb"),
    ("metrics.mlflow.enabled=true", "mlflow", "pip install mlflow"),
    ("metrics.prometheus.enabled=true", "prometheus_client", "pip install prometheus-client"),
    ("metrics.mlflow.enabled=true", "sqlalchemy", "pip install sqlalchemy alembic"),
])
def test_a_missing_package_is_named_at_config_load_with_its_pip_command(monkeypatch, override, package, pip):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert override.rsplit("=", 1)[0] in str(e.value) and pip in str(e.value) and "areal_fast[metrics]" in str(e.value)


def test_an_mlflow_server_needs_no_database_packages(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("sqlalchemy", "alembic") else real(name, *a))
    if real("mlflow") is None:
        pytest.skip("mlflow is not installed")
    cfg = load_config(None, ["metrics.mlflow.enabled=true", "metrics.mlflow.tracking_uri=http://127.0.0.1:5000"])
    assert cfg.metrics.mlflow.tracking_uri == "http://127.0.0.1:5000"


@pytest.mark.parametrize("override, needle", [
    ("metrics.wandb.mode=online-ish", "metrics.wandb.mode"),
    ("metrics.wandb.project=", "metrics.wandb.project"),
    ("metrics.mlflow.experiment=", "metrics.mlflow.experiment"),
    ("metrics.prometheus.port=70000", "metrics.prometheus.port"),
    ("metrics.wandb.projekt=x", "unknown key 'metrics.wandb.projekt'"),
])
def test_bad_metrics_values_are_refused_at_config_load(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_the_metrics_section_survives_save_and_load(tmp_path):
    from areal_fast.config import save_config

    cfg = load_config(None, ["metrics.wandb.tags=[a, b]", "metrics.mlflow.tracking_uri=http://h:5000",
                             "metrics.prometheus.port=0"])
    assert load_config(save_config(cfg, tmp_path / "c.yaml")) == cfg
