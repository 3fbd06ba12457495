"""``rollout.server: vllm``: a run launches real vLLM servers (the launchers' one ``server_command`` and
``server_env``, ``launch/base.py``): vLLM's own command (``backends/vllm/server_command.py``) with the
run's model, tensor-parallel size and key file, the dev-mode environment, and every flag one that
vLLM's own argument parser defines (read from the wheel, as the contract tests do). Nothing runs."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from areal_fast.backends.server_command import ServerKind, server_kind
from areal_fast.config import ConfigError, load_config
from areal_fast.launch.base import gpus_per_server, server_command, server_env, server_key_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VLLM = ["rollout.api=vllm", "rollout.server=vllm", "rollout.server_args=[--tensor-parallel-size,2]"]
KEY = "k-0123456789abcdef"


def _command(tmp_path: Path, overrides: list[str]) -> tuple[list[str], dict, str]:
    r = load_config(None, overrides).rollout
    with server_key_file(lambda: tmp_path / "secrets", KEY) as key_file:
        cmd = server_command(r, "/models/qwen3-1.7b", "10.0.0.5", 8001, seed=3, api_key_file=key_file)
        key_text = Path(key_file).read_text()
    return cmd, server_env(r), key_text


def test_the_launcher_builds_vllm_s_command_and_env(tmp_path):
    cmd, env, key_text = _command(tmp_path, VLLM)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/models/qwen3-1.7b" and cmd[cmd.index("--port") + 1] == "8001"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd.count("--tensor-parallel-size") == 1
    assert cmd[cmd.index("--served-model-name") + 1] == "default" and cmd[cmd.index("--seed") + 1] == "3"
    assert "--weight-transfer-config" in cmd  # 0.33.0 has the weight transfer
    assert KEY not in " ".join(cmd) and f"api-key: {KEY}" in key_text, "the key travels in the --config file"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    r = load_config(None, VLLM).rollout
    assert server_kind(r) is ServerKind.VLLM and gpus_per_server(r) == 2
    assert "VLLM_SERVER_DEV_MODE" not in server_env(load_config(None, []).rollout)


def test_the_launcher_starts_a_lora_run_s_vllm_servers_with_runtime_adapters(tmp_path):
    """A LoRA run's launched vLLM server: the launcher's own command and environment carry the flags the run
    needs (the suite's shared real vLLM server is started by the tests, so only this checks the launcher)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse_lora.yaml"
    r = load_config(example, ["rollout.api=vllm", "rollout.server=vllm"]).rollout
    with server_key_file(lambda: tmp_path / "secrets", KEY) as key_file:
        cmd = server_command(r, "/models/tiny", "127.0.0.1", 8001, seed=0, api_key_file=key_file)
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1].isdigit()
    assert server_env(r)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_every_release_a_run_accepts_gets_the_transfer_engine(tmp_path):
    cmd, _, _ = _command(tmp_path, VLLM + ["rollout.vllm_version=0.27.0"])  # the oldest a run accepts
    assert "--weight-transfer-config" in cmd


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.server=vllm"], "api 'vllm'"),  # vLLM servers speak vLLM's API
    (["rollout.api=vllm", "rollout.server=sglang"], "server 'vllm'"),
])
def test_engine_and_backend_must_agree(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


@pytest.mark.slow  # reads the vLLM wheel's sources (downloaded once, cached)
@pytest.mark.parametrize("version", ["0.27.0", "0.33.0"])
def test_launched_vllm_flags_are_vllm_parser_flags(tmp_path, version):
    from vllm_wheel import unknown_vllm_flags

    cmd, _, _ = _command(tmp_path, VLLM + [f"rollout.vllm_version={version}"])
    assert unknown_vllm_flags(version, cmd) == []


# ---------------------------------------------------------------------------- the key guard
def test_a_launched_vllm_server_runs_behind_the_key_guard(tmp_path):
    """vLLM checks its key under /v1 only: the launcher adds the key guard (vLLM's own --middleware),
    last on the line (vLLM adds it last: the outermost layer, before a middleware of the user's), and
    puts its directory, which holds that one module, first on the server's PYTHONPATH."""
    import subprocess

    from areal_fast.backends.vllm.server_command import KEYGUARD, KEYGUARD_DIR

    cmd, env, _ = _command(tmp_path, VLLM + ["rollout.server_args=[--middleware,my.Mw]"])
    assert cmd[-2:] == ["--middleware", KEYGUARD] and cmd.index("my.Mw") < len(cmd) - 2
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(KEYGUARD_DIR)
    assert sorted(p.name for p in KEYGUARD_DIR.glob("*.py")) == ["areal_fast_vllm_keyguard.py"]
    # vLLM's interpreter has no areal_fast: the module imports from its directory alone
    probe = ("import sys, areal_fast_vllm_keyguard as g; assert 'areal_fast' not in sys.modules; "
             "print(g.KeyGuard.__name__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(KEYGUARD_DIR)})
    assert r.returncode == 0 and r.stdout.strip() == "KeyGuard", r.stderr[-2000:]


def _guard_module():
    import importlib.util

    from areal_fast.backends.vllm.server_command import KEYGUARD_DIR

    spec = importlib.util.spec_from_file_location("areal_fast_vllm_keyguard",
                                                  KEYGUARD_DIR / "areal_fast_vllm_keyguard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _through(guard_of, path: str, authorization: str | None = None, kind: str = "http", app=None,
             root_path: str = ""):
    """What the guard (``guard_of(inner app)``) does with one request: (the inner app was reached,
    the messages sent back)."""
    import asyncio

    reached, sent = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    scope = {"type": kind, "path": path, "root_path": root_path, "method": "POST", "headers": headers}
    if app is not None:
        scope["app"] = app
    asyncio.run(guard_of(inner)(scope, receive, send))
    return bool(reached), sent


def test_the_key_guard_lets_nothing_but_health_through_without_the_key():
    g = _guard_module()
    guard = lambda app: g.KeyGuard(app, keys=[KEY])  # noqa: E731
    for path in ("/pause", "/collective_rpc", "/update_weights", "/adapters", "/v1/load_lora_adapter", "/sleep",
                 "/invocations", "/v1/completions", "/metrics", "/version", "/healthz", "/"):
        for auth in (None, "", f"Bearer {KEY}x", f"bearer {KEY}", KEY, f"Bearer  {KEY}", "Bearer"):
            reached, sent = _through(guard, path, auth)
            assert not reached and sent[0]["status"] == 401, (path, auth)
        assert _through(guard, path, f"Bearer {KEY}")[0], path
    assert _through(guard, "/health")[0]
    reached, sent = _through(guard, "/pause", kind="websocket")  # closed before it is accepted
    assert not reached and sent == [{"type": "websocket.close", "code": 1008}]
    assert _through(guard, "/pause", kind="lifespan")[0]
    # the keys of several --api-key values: each one opens, others do not
    assert _through(lambda app: g.KeyGuard(app, keys=["a", "b"]), "/pause", "Bearer b")[0]
    # no key anywhere: open, as vLLM is; keys not known (a key file gone on a release without parsed
    # arguments): closed
    assert _through(lambda app: g.KeyGuard(app, keys=[]), "/pause")[0]
    assert not _through(lambda app: g.KeyGuard(app, keys=None), "/pause", f"Bearer {KEY}")[0]

    def app_with(api_key):  # vLLM's FastAPI app: its parsed arguments on app.state.args
        return types.SimpleNamespace(state=types.SimpleNamespace(args=types.SimpleNamespace(api_key=api_key)))

    # the server's keys are vLLM's parsed ones, however the command line spelt them (--api_key, --api-ke)
    assert _through(g.KeyGuard, "/pause", f"Bearer {KEY}", app=app_with([KEY]))[0]
    assert not _through(g.KeyGuard, "/pause", "Bearer other", app=app_with([KEY]))[0]
    assert g._keys_of_app({"app": app_with(None)}, {"VLLM_API_KEY": "env"}) == ["env"]  # vLLM's fallback
    assert g._keys_of_app({"app": app_with(None)}, {}) == [] and g._keys_of_app({}, {}) is None
    # behind a root path: /health only as the whole path under it
    for path, opened in (("/x/health", True), ("/xhealth", False), ("/x/pause", False)):
        assert _through(guard, path, root_path="/x")[0] is opened, path


def test_the_key_guard_reads_the_key_vllm_reads(tmp_path):
    """--api-key on the line, else the --config file's api-key (the launcher's way), else $VLLM_API_KEY;
    a named key file that cannot be read: not known (None: closed until vLLM's own key is seen)."""
    from areal_fast.backends.keyfile import write_api_key_file

    g = _guard_module()
    key_file = str(write_api_key_file(tmp_path / "secrets", KEY))
    env = {"VLLM_API_KEY": "from-env"}
    assert g.server_keys(["--model", "m", "--config", key_file], env) == [KEY]
    assert g.server_keys(["--config", key_file, "--api-key", "a", "b", "--port", "1"], env) == ["a", "b"]
    assert g.server_keys([f"--config={key_file}"], {}) == [KEY]
    assert g.server_keys(["--model", "m"], env) == ["from-env"] and g.server_keys([], {}) == []
    assert g.server_keys(["--config", str(tmp_path / "gone.yaml")], env) is None


# ---------------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("overrides, cached", [
    (["rollout.pause_mode=in_place"], False),
    (["rollout.pause_mode=auto"], False),  # auto is in place on 0.33.0 (per-token versions)
    (["rollout.pause_mode=auto", "rollout.vllm_version=0.27.0"], True),  # ... and abort before
    (["rollout.pause_mode=abort"], True),  # an abort pause resets vLLM's cache (clear_cache)
])
def test_a_run_that_pauses_in_place_launches_vllm_without_prefix_caching(tmp_path, overrides, cached):
    cmd, _, _ = _command(tmp_path, VLLM + overrides)
    assert ("--no-enable-prefix-caching" not in cmd) is cached


def test_prefix_caching_asked_of_a_run_that_pauses_in_place_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--enable-prefix-caching"):
        _command(tmp_path, VLLM + ["rollout.pause_mode=in_place",
                                   "rollout.server_args=[--enable-prefix-caching]"])


# ---------------------------------------------------------------------------- scheduling
def test_launched_vllm_servers_and_twins_schedule_by_priority(tmp_path):
    """Requests sent again after an abort pause must not queue behind newer groups' (the staleness
    bound): launched vLLM servers, and the twins a run launches, take ``--scheduling-policy priority``,
    and a run's own ``--scheduling-policy`` is refused, naming why."""
    from areal_fast.embedded.__main__ import parse_args

    for overrides in ([], ["rollout.pause_mode=in_place"]):
        cmd, _, _ = _command(tmp_path, VLLM + overrides)
        assert cmd[cmd.index("--scheduling-policy") + 1] == "priority" and cmd.count("--scheduling-policy") == 1
    twin, _, _ = _command(tmp_path, ["rollout.api=vllm", "rollout.server=embedded"])
    assert twin[twin.index("--scheduling-policy") + 1] == "priority"
    args = twin[twin.index("--model-path"):]
    del args[args.index("--config"):args.index("--config") + 2]  # the key file is gone with its context
    assert parse_args(args).scheduling_policy == "priority"
    with pytest.raises(ValueError, match="--scheduling-policy is set by the launcher"):
        _command(tmp_path, VLLM + ["rollout.server_args=[--scheduling-policy=fcfs]"])


def test_a_pythonpath_of_the_user_s_keeps_the_key_guard_first(tmp_path):
    from areal_fast.backends.vllm.server_command import KEYGUARD_DIR

    _, env, _ = _command(tmp_path, VLLM + ["rollout.server_env={PYTHONPATH: /opt/mine}"])
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(KEYGUARD_DIR), "/opt/mine"]
