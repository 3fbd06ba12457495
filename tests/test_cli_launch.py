"""The local launcher (fail fast with the log tail, clean shutdown, servers that require the run's API
key) and the metric files."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest

from areal_fast.config import RolloutConfig
from areal_fast.launch.local import LocalLauncher, ProcessDied
from areal_fast.launch.metrics import plot_run, read_jsonl, truncate_jsonl
from areal_fast.netutil import find_free_port


def test_a_process_dying_at_start_up_fails_fast_with_its_log(tmp_path):
    with LocalLauncher(tmp_path) as L:
        p = L.start("server0", [sys.executable, "-c", "import sys; print('bad model path'); sys.exit(3)"],
                    url=f"http://127.0.0.1:{find_free_port()}")
        t0 = time.monotonic()
        with pytest.raises(ProcessDied) as e:
            L.wait_healthy([p], timeout=60)
        assert time.monotonic() - t0 < 30  # noticed at once, not after the health timeout
    msg = str(e.value)
    assert "server0" in msg and "code 3" in msg and "bad model path" in msg


def test_shutdown_stops_every_process_and_check_reports_deaths(tmp_path):
    L = LocalLauncher(tmp_path)
    sleeper = L.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], critical=False)
    quitter = L.start("quitter", [sys.executable, "-c", "raise SystemExit(4)"], critical=True)
    quitter.popen.wait()
    with pytest.raises(ProcessDied, match="quitter.*code 4"):
        L.check()
    assert sleeper.alive()
    L.shutdown()
    assert not sleeper.alive()
    assert (tmp_path / "sleeper.log").is_file()
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper.pid, 0)


def test_metrics_truncate_on_resume_and_plots(tmp_path):
    f = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "reward": s / 10, "trained_tokens_per_s": 100.0, "staleness": [0, 1]}
            for s in range(1, 6)] + [{"kind": "eval", "step": 5, "eval_reward": 0.5}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')  # a line cut by kill -9
    truncate_jsonl(f, 3)
    assert [r["step"] for r in read_jsonl(f)] == [1, 2, 3]
    paths = plot_run(f, tmp_path / "plots")
    assert {p.name for p in paths} == {"reward.png", "throughput.png", "staleness.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_launched_servers_refuse_requests_without_the_api_key(tmp_path):
    from areal_fast.rollout.testing import build_tiny_qwen2

    model = build_tiny_qwen2(str(tmp_path / "model"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    key = "k-" + os.urandom(8).hex()
    with LocalLauncher(tmp_path / "logs") as L:
        (server,) = L.start_servers(RolloutConfig(n_servers=1, health_timeout=120), model, seed=0, api_key=key)
        assert _get(server.url + "/get_model_info") == 401
        assert _get(server.url + "/get_model_info", "wrong") == 401
        assert _get(server.url + "/get_model_info", key) == 200
        assert _get(server.url + "/health") == 200  # health needs no key (as in SGLang)
    assert key not in server.log_path.read_text()  # the command line is logged with the key hidden
