"""The Prometheus endpoint on the controller's process (``areal_fast.metrics.prometheus``): scraped over
HTTP and parsed with prometheus_client's own parser; key-free on loopback, the key required when
exposed; and scraped during a real run of the tiny recipe, which also feeds W&B (offline) and MLflow
(its default sqlite store in the run directory) the names and values TensorBoard gets.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from _shared import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "tiny_reverse.yaml")

# what docs/observability.md promises an operator (and docs/grafana_dashboard.json plots)
OPERATOR_NAMES = ["areal_fast_step", "areal_fast_servers_live", "areal_fast_servers_dropped_total",
                  "areal_fast_requests_in_flight", "areal_fast_buffer_groups", "areal_fast_staleness_mean",
                  "areal_fast_staleness_max", "areal_fast_generated_tokens_total", "areal_fast_trained_tokens_total",
                  "areal_fast_generated_tokens_per_second", "areal_fast_trained_tokens_per_second",
                  "areal_fast_weight_sync_seconds", "areal_fast_reward"]


@pytest.fixture(autouse=True)
def _needs_prometheus_client():
    if importlib.util.find_spec("prometheus_client") is None:
        pytest.skip("prometheus-client is not installed (pip install 'areal_fast[metrics]')")


def scrape(url: str, key: str | None = None) -> dict[str, float]:
    """{sample name: value} of one scrape, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class _Buffer(list):
    spilled = 1


def _controller(version=3, trained=100):
    return SimpleNamespace(version=version, running={7: None, 8: None}, buffer=_Buffer([1, 2]),
                           counters=SimpleNamespace(trained_tokens=trained, dropped_stale=0))


class _Port:
    def __init__(self):
        self.release = asyncio.Event()
        self.urls = ["http://a:1", "http://b:2"]
        self.waiting = 0  # requests held at the port until release

    async def generate(self, input_ids, sampling, rid):
        self.waiting += 1
        await self.release.wait()
        return SimpleNamespace(output_ids=[1, 2, 3, 4, 5])


def test_the_endpoint_serves_what_an_operator_alerts_on_and_follows_the_pool():
    from areal_fast.metrics.prometheus import ControllerExporter

    ex = ControllerExporter("127.0.0.1", 0, total_steps=10, max_staleness=2)
    try:
        pool = SimpleNamespace(urls=["http://a:1", "http://b:2"])
        ctl = _controller()
        ex.sample(ctl, pool)
        ex.observe({"kind": "train", "step": 3, "reward": 0.75, "staleness_mean": 0.5, "staleness_max": 1,
                    "sync_s": 0.25, "train_s": 1.5})
        ex.observe({"kind": "eval", "step": 3, "eval_reward": 0.5})
        got = scrape(ex.url)
        assert got["areal_fast_step"] == 3 and got["areal_fast_total_steps"] == 10
        assert got["areal_fast_servers_live"] == 2 and got["areal_fast_servers_dropped_total"] == 0
        assert got["areal_fast_buffer_groups"] == 2 and got["areal_fast_buffer_spilled_groups"] == 1
        assert got["areal_fast_groups_running"] == 2 and got["areal_fast_max_staleness"] == 2
        assert got["areal_fast_reward"] == 0.75 and got["areal_fast_eval_reward"] == 0.5
        assert got["areal_fast_weight_sync_seconds"] == 0.25 and got["areal_fast_staleness_max"] == 1
        assert got["areal_fast_trained_tokens_total"] == 100
        pool.urls = ["http://b:2"]  # a dies
        ctl.counters.trained_tokens = 160
        ex.sample(ctl, pool)
        pool.urls = ["http://b:2", "http://c:3"]  # a replacement joins: live again, the drop stays counted
        ex.sample(ctl, pool)
        got = scrape(ex.url)
        assert got["areal_fast_servers_live"] == 2 and got["areal_fast_servers_dropped_total"] == 1
        assert got["areal_fast_trained_tokens_total"] == 160 and got["areal_fast_trained_tokens_per_second"] > 0
        assert status(ex.url.replace("/metrics", "/other")) == 404
    finally:
        ex.close()


def test_requests_in_flight_and_generated_tokens_are_counted_at_the_port():
    from areal_fast.metrics.prometheus import ControllerExporter

    async def run(ex):
        port = _Port()
        metered = ex.metered(port)
        assert metered.urls == port.urls  # every other attribute is the port's
        tasks = [asyncio.create_task(metered.generate([1], {}, f"r{i}")) for i in range(3)]
        await wait_until(lambda: port.waiting == 3, "the three requests at the port")
        ex.sample(_controller(), port)
        during = scrape(ex.url)
        port.release.set()
        await asyncio.gather(*tasks)
        ex.sample(_controller(), port)
        return during, scrape(ex.url)

    ex = ControllerExporter("127.0.0.1", 0)
    try:
        during, after = asyncio.run(run(ex))
    finally:
        ex.close()
    assert during["areal_fast_requests_in_flight"] == 3 and during["areal_fast_generated_tokens_total"] == 0
    assert after["areal_fast_requests_in_flight"] == 0 and after["areal_fast_generated_tokens_total"] == 15


def test_an_exposed_endpoint_answers_only_the_runs_key():
    from areal_fast.metrics.prometheus import ControllerExporter

    with pytest.raises(ValueError, match="not a loopback address"):
        ControllerExporter("0.0.0.0", 0, key=None)
    ex = ControllerExporter("0.0.0.0", 0, key="s3cret")
    try:
        url = f"http://127.0.0.1:{ex.port}/metrics"
        assert status(url) == 401
        assert status(url, {"Authorization": "Bearer wrong"}) == 401
        assert status(url, {"Authorization": "s3cret"}) == 401
        assert "areal_fast_step" in scrape(url, key="s3cret")
        assert "bearer key required" in ex.where()
    finally:
        ex.close()
    ex = ControllerExporter("127.0.0.1", 0, key="s3cret")  # loopback: key-free, whatever the run's key
    try:
        assert status(ex.url) == 200
    finally:
        ex.close()


def test_an_idle_connection_without_a_request_head_is_closed():
    """The endpoint is on the listeners' one stack (``http.conn_guard``): a connection that sends no
    request head, one whose head stops, and one whose head drips a line at a time (each line well
    within any per-read timeout) are closed after the head timeout; the endpoint still serves."""
    from _shared import CLOSE_WITHIN_S, closed_by_server, connect, request

    from areal_fast.http.conn_guard import ConnLimits
    from areal_fast.metrics.prometheus import ControllerExporter

    ex = ControllerExporter("127.0.0.1", 0, conn_limits=ConnLimits(head_timeout_s=0.5, keepalive_s=120))
    url = f"http://127.0.0.1:{ex.port}"
    idle, partial = connect(url), connect(url)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    try:
        for s in (idle, partial):
            assert closed_by_server(s, CLOSE_WITHIN_S), "a connection without a request head outlived the timeout"
        with connect(url) as drip:
            drip.sendall(b"GET /metrics HTTP/1.1\r\n")
            deadline, closed = time.monotonic() + CLOSE_WITHIN_S, False
            while not closed and time.monotonic() < deadline:
                try:
                    drip.sendall(b"X-Drip: 1\r\n")
                except OSError:
                    closed = True
                closed = closed or closed_by_server(drip, 0.1)
            assert closed, "a head that never ends, sent a line at a time, outlived the head timeout"
        with connect(url) as s:
            assert request(s, "/metrics") == 200
    finally:
        idle.close()
        partial.close()
        ex.close()


def test_connections_without_the_key_are_capped_and_a_keyed_scrape_is_served():
    """Over the cap the oldest connections that have not proved the key are closed; a scrape with
    the key is served at the cap, and its connection is never closed for it. ``/metrics`` proves the
    key here (it is what the key guards): a scrape refused its key stays counted."""
    from _shared import CLOSE_WITHIN_S, closed_by_server, connect, request

    from areal_fast.http.conn_guard import ConnLimits
    from areal_fast.metrics.prometheus import ControllerExporter

    cap = 4
    ex = ControllerExporter("0.0.0.0", 0, key="s3cret", conn_limits=ConnLimits(
        head_timeout_s=120, keepalive_s=120, max_unauthenticated=cap))
    url = f"http://127.0.0.1:{ex.port}"
    kept = connect(url)
    idle: list = []
    try:
        assert request(kept, "/metrics", "s3cret") == 200
        idle = [connect(url) for _ in range(cap + 3)]
        for s in idle[:3]:
            assert closed_by_server(s, CLOSE_WITHIN_S), "more connections without the key than the cap were kept"
        for s in idle[3:]:
            assert not closed_by_server(s, 0.2), "a connection within the cap was closed"
        refused = connect(url)
        idle.append(refused)
        assert request(refused, "/metrics", "wrong") == 401
        with connect(url) as fresh:  # at the cap: a scrape with the key is served
            assert request(fresh, "/metrics", "s3cret") == 200
        idle.extend(connect(url) for _ in range(cap))
        assert closed_by_server(refused, CLOSE_WITHIN_S), "a scrape refused its key escaped the cap"
        assert request(kept, "/metrics", "s3cret") == 200  # a connection that proved the key stays
    finally:
        kept.close()
        for s in idle:
            s.close()
        ex.close()


def test_a_taken_port_is_refused_naming_the_setting():
    from areal_fast.metrics.prometheus import ControllerExporter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="metrics.prometheus.*port"):
            ControllerExporter("127.0.0.1", s.getsockname()[1])


def test_an_exposed_endpoint_without_a_key_is_refused_at_config_load(monkeypatch):
    from areal_fast.config import ConfigError, load_config

    exposed = ["metrics.prometheus.enabled=true", "metrics.prometheus.host=0.0.0.0"]
    monkeypatch.delenv("AREAL_FAST_API_KEY", raising=False)
    monkeypatch.delenv("AREAL_FAST_METRICS_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"metrics\.prometheus\.host '0\.0\.0\.0'.*AREAL_FAST_API_KEY"):
        load_config(None, exposed)
    monkeypatch.setenv("AREAL_FAST_METRICS_KEY", "scrapes-only")  # the endpoint's own key is enough
    assert load_config(None, exposed)
    monkeypatch.delenv("AREAL_FAST_METRICS_KEY")
    monkeypatch.setenv("AREAL_FAST_API_KEY", "k")
    assert load_config(None, exposed)


def test_with_servers_started_by_hand_the_scrape_key_is_never_the_servers_key(tmp_path, monkeypatch):
    """``api_key`` is then the hand-started servers' key: a scraper holding it could drive them. The run
    is refused before anything starts unless $AREAL_FAST_METRICS_KEY names a key of its own; with
    launched servers (a fresh key of their own) the key the user gave the run serves."""
    from areal_fast.config import load_config
    from areal_fast.launch import train

    monkeypatch.delenv("AREAL_FAST_API_KEY", raising=False)
    monkeypatch.delenv("AREAL_FAST_METRICS_KEY", raising=False)
    run = ["api_key=given-key", f"experiment.output_dir={tmp_path / 'run'}", "metrics.prometheus.enabled=true"]
    by_hand = ["rollout.servers=[http://127.0.0.1:1]"]  # given-key is these servers' key
    exposed = ["metrics.prometheus.host=0.0.0.0"]
    cfg = load_config(None, [*run, *exposed, *by_hand])
    monkeypatch.setattr(train, "model_dir", lambda *a, **kw: pytest.fail("the run started before the key check"))
    with pytest.raises(train.NoScrapeKey, match="AREAL_FAST_METRICS_KEY is not set"):
        train.run_train(cfg, progress=False, say=lambda m: None)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    monkeypatch.setenv("AREAL_FAST_METRICS_KEY", "given-key")
    with pytest.raises(train.NoScrapeKey, match="AREAL_FAST_METRICS_KEY is that key too"):
        train.run_train(cfg, progress=False, say=lambda m: None)

    def key(overrides):
        c = load_config(None, [*run, *overrides])
        return train.metrics_key(c, train.server_kind(c.rollout))

    monkeypatch.setenv("AREAL_FAST_METRICS_KEY", "scrape-key")
    assert key([*exposed, *by_hand]) == "scrape-key"
    assert key(exposed) == "scrape-key"  # launched servers: a key of its own still wins
    monkeypatch.delenv("AREAL_FAST_METRICS_KEY")
    assert key(exposed) == "given-key"  # launched servers have a fresh key: given-key opens none of them
    assert key(by_hand) is None  # loopback: no key


def test_the_grafana_dashboard_plots_only_names_the_endpoint_serves():
    from areal_fast.metrics.prometheus import COUNTERS, GAUGES, PREFIX

    served = {PREFIX + n for n in GAUGES} | {PREFIX + n + "_total" for n in COUNTERS}
    dash = json.loads((ROOT / "docs" / "grafana_dashboard.json").read_text())
    used = {n for p in dash["panels"] for t in p.get("targets", []) for n in re.findall(r"areal_fast_\w+", t["expr"])}
    assert used and used <= served, sorted(used - served)
    assert set(OPERATOR_NAMES) <= used


# ----------------------------------------------------------------------------- a real run


TINY = [
    "model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
    "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
    "model.warm_start.num_key_value_heads=1", "data.synthetic.max_len=6", "data.synthetic.n_train=400",
    "data.synthetic.n_eval=8", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
    "train.batch_size=2", "eval.every_steps=10", "checkpoint.every_steps=0", "log.progress=false",
    "log.plots=false", "reward.workers=1", "weights.method=disk",
]


@pytest.mark.slow
def test_a_run_is_scraped_while_it_trains_and_every_sink_gets_the_same_metrics(tmp_path):
    """The tiny recipe with the endpoint on a free port, W&B offline and MLflow on its default store:
    two scrapes during the run see the step advance and every operator name; at the end the run prints
    where each sink wrote, and W&B and MLflow hold TensorBoard's names and values."""
    for mod in ("wandb", "mlflow", "sqlalchemy", "alembic", "tensorboard"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install 'areal_fast[metrics]')")
    from test_metrics_sinks import assert_same, mlflow_values, tensorboard_values, wandb_values

    out = tmp_path / "run"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_MODE")}
    env.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true", WANDB_API_KEY="")
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", EXAMPLE, f"experiment.output_dir={out}", *TINY,
           "experiment.total_steps=40", "log.tensorboard=true", "metrics.prometheus.enabled=true",
           "metrics.prometheus.port=0", "metrics.wandb.enabled=true", "metrics.wandb.mode=offline",
           "metrics.mlflow.enabled=true"]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        url = _wait(lambda: next((m.group(1) for x in lines if (m := re.match(r"prometheus: (\S+)", x))), None),
                    p, lines, "the endpoint's URL")
        first = _wait(lambda: _scrape_past(url, 0), p, lines, "step 1")
        second = _wait(lambda: _scrape_past(url, first["areal_fast_step"]), p, lines, "a later step")
        assert p.wait(timeout=240) == 0, "".join(lines)[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)
    missing = [n for n in OPERATOR_NAMES if n not in first]
    assert not missing, missing
    assert first["areal_fast_servers_live"] == 1 and first["areal_fast_trained_tokens_total"] > 0
    assert second["areal_fast_generated_tokens_total"] >= first["areal_fast_generated_tokens_total"] > 0
    text = "".join(lines)
    for sink in ("jsonl", "tensorboard", "wandb", "mlflow", "prometheus"):
        assert f"metrics ({sink}): " in text, text[-3000:]
    assert re.search(r"metrics \(prometheus\): http://127\.0\.0\.1:\d+/metrics", text)
    assert f"sqlite:///{out}/tracking/mlflow.db" in text
    from areal_fast.launch.run_dir import is_checked_entry  # every entry it wrote is checked at the next start

    assert all(is_checked_entry(p.name) for p in out.iterdir()), sorted(p.name for p in out.iterdir())
    tb = tensorboard_values(out)
    assert len(tb["train/reward"]) == 40
    assert_same(wandb_values(out), tb, "W&B vs TensorBoard")
    assert_same(mlflow_values(out), tb, "MLflow vs TensorBoard")


def _scrape_past(url: str, step: float) -> dict | None:
    got = scrape(url)
    return got if got["areal_fast_step"] > step else None


def _wait(probe, p: subprocess.Popen, lines: list[str], what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise AssertionError(f"the run exited ({p.returncode}) before {what}: {''.join(lines)[-3000:]}")
        try:
            got = probe()
        except (OSError, KeyError):
            got = None
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {''.join(lines)[-3000:]}")
