"""The one weight-sync configuration: torch-free, validated field by field with the field named,
the same class in the run config (``weights:``) and in the transports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_fast.weights.config import WeightSyncConfig


def test_import_does_not_load_torch():
    code = "import sys, areal_fast.weights.config; assert 'torch' not in sys.modules, sorted(sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_run_config_uses_this_class():
    from areal_fast import config

    assert config.WeightSyncConfig is WeightSyncConfig


@pytest.mark.parametrize("kw,field", [
    ({"method": "nccl"}, "method"), ({"bucket_bytes": 10}, "bucket_bytes"), ({"dtype": "int8"}, "dtype"),
    ({"load_format": "auto"}, "load_format"), ({"disk_load_format": "dummy"}, "disk_load_format"),
    ({"group_name": ""}, "group_name"), ({"master_port": 70000}, "master_port"), ({"collective": "mpi"}, "collective"),
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": float("inf")}, "timeout_s"), ({"timeout_s": -5}, "timeout_s"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        WeightSyncConfig(**kw)


def test_torch_dtype_is_accepted_and_send_dtype_follows_the_device():
    import torch

    assert WeightSyncConfig(dtype=torch.bfloat16).dtype == "bfloat16"
    auto = WeightSyncConfig()
    assert auto.send_dtype("cuda") == torch.bfloat16 and auto.send_dtype("cpu") is None
    assert WeightSyncConfig(dtype="float16").send_dtype("cpu") == torch.float16
    assert WeightSyncConfig(dtype=None).send_dtype("cuda") is None


def test_api_key_from_env_and_not_printed(monkeypatch):
    monkeypatch.setenv("AREAL_FAST_API_KEY", "s3cret")
    assert WeightSyncConfig().resolved_api_key == "s3cret"
    cfg = WeightSyncConfig(api_key="mine")
    assert cfg.resolved_api_key == "mine" and "mine" not in repr(cfg)
    monkeypatch.setenv("AREAL_FAST_HOST", "10.0.0.7")
    assert WeightSyncConfig().resolved_master_addr == "10.0.0.7"
    assert WeightSyncConfig(master_addr="127.0.0.1").resolved_master_addr == "127.0.0.1"
