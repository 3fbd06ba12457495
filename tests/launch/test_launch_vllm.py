"""``rollout.server: vllm``: a run launches real vLLM servers (the launchers' one ``server_command`` and
``server_env``, ``launch/base.py``): vLLM's own command (``backends/vllm/server_command.py``) with the
run's model, tensor-parallel size and key file, the dev-mode environment, and every flag one that
vLLM's own argument parser defines (read from the wheel, as the contract tests do). Nothing runs."""

from __future__ import annotations

import os
import sys
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
