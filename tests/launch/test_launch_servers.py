"""Where a run's inference servers come from (one decision: ``server_kind``), the one API key of a
run and how it reaches the rank that runs inside the launcher's process (an argument, not this
process's environment), and the rank's record sinks."""

from __future__ import annotations

import contextlib
import os
import types

import pytest

from areal_fast.backends.server_command import ServerKind, server_kind
from areal_fast.config import load_config
from areal_fast.launch import train
from areal_fast.launch.base import API_KEY_ENV, LaunchedProcess, gpus_per_server, server_command
from areal_fast.launch.rank import RecordFilter

SECRET = "0123456789abcdef-configured-key"
EXTERNAL = "rollout.servers=[http://127.0.0.1:1]"


def test_server_kind_is_decided_by_servers_then_engine():
    assert server_kind(load_config(None, [EXTERNAL]).rollout) is ServerKind.EXTERNAL
    assert server_kind(load_config(None, [EXTERNAL, "rollout.server=sglang"]).rollout) is ServerKind.EXTERNAL
    assert server_kind(load_config(None, []).rollout) is ServerKind.EMBEDDED
    assert server_kind(load_config(None, ["rollout.server=sglang"]).rollout) is ServerKind.SGLANG
    assert not ServerKind.EXTERNAL.launched and ServerKind.EMBEDDED.launched and ServerKind.SGLANG.launched
    with pytest.raises(ValueError, match="'tgi'"):
        server_kind(types.SimpleNamespace(servers=[], server="tgi"))


def test_the_launchers_build_the_command_and_count_gpus_of_the_launched_kind():
    embedded = load_config(None, ["rollout.device=cuda:0"]).rollout
    sglang = load_config(None, ["rollout.server=sglang", "rollout.server_args=[--tp-size,2]"]).rollout
    cmd = server_command(embedded, "/m", "127.0.0.1", 30001, seed=0, api_key_file=None)
    assert cmd[1:3] == ["-m", "areal_fast.embedded"] and "--device" in cmd
    cmd = server_command(sglang, "/m", "127.0.0.1", 30001, seed=0, api_key_file=None)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[cmd.index("--tp-size") + 1] == "2"
    assert gpus_per_server(embedded) == 1 and gpus_per_server(sglang) == 2
    assert gpus_per_server(load_config(None, []).rollout) == 0  # the embedded engine on the CPU


def test_run_api_key_fresh_for_launched_servers_configured_for_external_ones(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    launched = load_config(None, [f"api_key={SECRET}"])
    fresh = train.run_api_key(launched, server_kind(launched.rollout))
    assert fresh and fresh != SECRET and not fresh.startswith("-")
    external = load_config(None, [f"api_key={SECRET}", EXTERNAL])
    assert train.run_api_key(external, server_kind(external.rollout)) == SECRET


class FakeLauncher:
    """Records the servers it is asked to start; starts nothing."""

    def __init__(self):
        self.started = []

    def start_servers(self, rollout_cfg, model_path, *, seed, api_key):
        self.started.append(api_key)
        return [LaunchedProcess(name=f"server{i}", log_path=None, url=f"http://127.0.0.1:{40000 + i}")
                for i in range(rollout_cfg.n_servers)]


def _run_in_process(monkeypatch, tmp_path, overrides):
    """run_train with everything around the rank faked; returns (launcher, the rank's call)."""
    launcher, calls = FakeLauncher(), []

    def fake_rank(cfg, *, api_key=None, progress=False, say=None):
        calls.append({"api_key": api_key, "env": os.environ.get(API_KEY_ENV), "urls": list(cfg.rollout.servers),
                      "resolved": cfg.weights.resolved_api_key})
        return {"steps": 0}

    @contextlib.contextmanager
    def fake_open_launcher(cfg, log_dir, secrets_dir=None):
        yield launcher

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setattr(train, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(train, "model_dir", lambda cfg, say=print: "/m")
    monkeypatch.setattr(train, "check_data_and_reward", lambda cfg, model: None)
    monkeypatch.setattr(train, "open_launcher", fake_open_launcher)
    monkeypatch.setattr(train, "run_rank", fake_rank)
    cfg = load_config(None, [f"experiment.output_dir={tmp_path / 'run'}", "log.plots=false", *overrides])
    assert train.run_train(cfg, progress=False, say=lambda m: None) == {"steps": 0}
    assert len(calls) == 1
    return launcher, calls[0]


def test_the_in_process_rank_is_handed_the_launched_servers_key_not_through_the_environment(monkeypatch, tmp_path):
    launcher, call = _run_in_process(monkeypatch, tmp_path, ["rollout.n_servers=2"])
    assert len(launcher.started) == 1 and launcher.started[0]  # a fresh key for the servers we start
    assert call["api_key"] == launcher.started[0]  # the same key, as an argument
    assert call["env"] is None  # this process's environment is not used to carry it
    assert call["urls"] == ["http://127.0.0.1:40000", "http://127.0.0.1:40001"]
    assert os.environ.get(API_KEY_ENV) is None


def test_external_servers_are_not_launched_and_their_key_is_handed_over(monkeypatch, tmp_path):
    launcher, call = _run_in_process(monkeypatch, tmp_path, [EXTERNAL, f"api_key={SECRET}"])
    assert launcher.started == []
    assert call["api_key"] == SECRET and call["env"] is None and call["urls"] == ["http://127.0.0.1:1"]


def test_run_rank_puts_the_given_key_into_weights_api_key(monkeypatch, tmp_path):
    """The rank's client and weight sync both read weights.resolved_api_key: the argument lands there."""
    from areal_fast.launch import rank

    seen = []

    async def fake_rank0(cfg, api_key, say, progress):
        seen.append((api_key, cfg.weights.resolved_api_key))
        return {}

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setattr(rank, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # this test process keeps its threads
    monkeypatch.setattr(rank, "_rank0", fake_rank0)
    cfg = load_config(None, [f"experiment.output_dir={tmp_path}", EXTERNAL])
    rank.run_rank(cfg, api_key=SECRET)
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    rank.run_rank(cfg)  # a rank process: the environment the launcher gave it
    assert seen == [(SECRET, SECRET), ("from-the-environment", "from-the-environment")]
    assert cfg.weights.api_key is None  # the caller's config is not changed


def test_record_filter_splits_samples_from_metrics():
    metrics, samples = [], []
    to_metrics = RecordFilter(metrics.append, "samples", keep=False)
    to_samples = RecordFilter(samples.append, "samples", keep=True)
    for record in ({"kind": "samples", "n": 1}, {"step": 1}, {"kind": "eval", "step": 1}):
        to_metrics(record)
        to_samples(record)
    assert metrics == [{"step": 1}, {"kind": "eval", "step": 1}] and samples == [{"kind": "samples", "n": 1}]
