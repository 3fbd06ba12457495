"""The local launcher (fail fast with the log tail, clean shutdown, servers that require the run's API
key) and the metric files."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import pytest

from areal_fast.config import RolloutConfig
from areal_fast.launch.local import LocalLauncher, ProcessDied
from areal_fast.metrics.sinks import plot_run, read_jsonl, truncate_jsonl
from areal_fast.netutil import find_free_port


def test_a_process_dying_at_start_up_fails_fast_with_its_log(tmp_path):
    with LocalLauncher(tmp_path) as L:
        p = L.start("server0", [sys.executable, "-c", "import sys; print('bad model path'); sys.exit(3)"],
                    url=f"http://127.0.0.1:{find_free_port()}")
        with pytest.raises(ProcessDied) as e:  # the death is noticed (a TimeoutError would mean it was not)
            L.wait_healthy([p], timeout=60)
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
    assert {p.name for p in paths} == {"reward.png", "throughput.png", "staleness.png", "mismatch.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_launched_servers_refuse_requests_without_the_api_key(tmp_path):
    """The key reaches the server in a private file, never on its command line (world-readable in
    /proc/<pid>/cmdline) nor in its log; requests without it get 401, the rollout client with it works."""
    import asyncio
    import stat

    from areal_fast.backends.sglang.client import SGLangRolloutClient
    from areal_fast.data.tiny_models import build_tiny_qwen2
    from areal_fast.rollout.client import RequestError

    model = build_tiny_qwen2(str(tmp_path / "model"), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    key = "k" + os.urandom(8).hex()
    secrets_dir = tmp_path / "out" / ".secrets"
    with LocalLauncher(tmp_path / "logs", secrets_dir=secrets_dir) as L:
        (server,) = L.start_servers(RolloutConfig(n_servers=1, health_timeout=120), model, seed=0, api_key=key)
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        assert key not in " ".join(argv) and "--api-key" not in argv
        assert "--config" in argv  # the key file, read at start-up ...
        assert list(secrets_dir.iterdir()) == []  # ... and removed once the server was healthy
        assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600  # a server may log its arguments
        assert _get(server.url + "/get_model_info") == 401
        assert _get(server.url + "/get_model_info", "wrong") == 401
        assert _get(server.url + "/get_model_info", key) == 200
        assert _get(server.url + "/health") == 200  # health needs no key (as in SGLang)

        async def generate(api_key):
            async with SGLangRolloutClient([server.url], api_key=api_key, max_attempts=1) as c:
                return await c.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0.0}, rid="r")

        assert len(asyncio.run(generate(key)).output_ids) == 3
        with pytest.raises(RequestError, match="401"):
            asyncio.run(generate("wrong"))
    assert key not in server.log_path.read_text()  # the command line is logged without the key


def test_the_key_file_is_private_and_never_written_through_what_exists(tmp_path):
    from areal_fast.backends.keyfile import redact_command, write_api_key_file
    from areal_fast.backends.sglang.server_command import sglang_server_command

    d = tmp_path / "secrets"
    d.mkdir(mode=0o755)
    f = write_api_key_file(d, "abc123")
    assert stat_mode(d) == 0o700 and stat_mode(f) == 0o600
    import yaml

    assert yaml.safe_load(f.read_text()) == {"api-key": "abc123"}
    assert yaml.safe_load(write_api_key_file(d, "1234").read_text()) == {"api-key": "1234"}  # a str, not 1234
    assert f != write_api_key_file(d, "abc123")  # a fresh name each time (O_EXCL never meets an old file)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(PermissionError, match="link"):
        write_api_key_file(link, "abc")  # a symlinked directory is refused, naming it
    with pytest.raises(ValueError, match="'-'"):
        write_api_key_file(d, "-abc")
    cmd = sglang_server_command("embedded", "/m", "127.0.0.1", 1234, api_key_file=f)
    assert cmd[cmd.index("--config") + 1] == str(f) and "--api-key" not in cmd
    with pytest.raises(ValueError, match="not both"):
        sglang_server_command("embedded", "/m", "127.0.0.1", 1234, api_key="k", api_key_file=f)
    with pytest.raises(ValueError, match="one --config"):
        sglang_server_command("sglang", "/m", "127.0.0.1", 1234, api_key_file=f, extra_args=["--config", "x.yaml"])
    assert redact_command(["x", "--api-key", "s3", "--api-key=s4"]) == ["x", "--api-key", "***", "--api-key=***"]


def test_run_server_args_may_not_take_the_key_files_config_option(tmp_path):
    """The key has one source: ``--config`` (which would replace our key file) is refused at load."""
    with pytest.raises(ValueError, match="server_args"):
        RolloutConfig(server_args=["--config", "mine.yaml"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  server_args: ['--config', 'mine.yaml']\n")
    from areal_fast.config import load_config

    with pytest.raises(ValueError, match=r"rollout\.server_args"):
        load_config(cfg)


def stat_mode(path) -> int:
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)
