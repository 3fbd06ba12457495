"""The local launcher (fail fast with the log tail, clean shutdown) and the metric files."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

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
