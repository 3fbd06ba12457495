"""Without a shared file system (``weights.shared_fs: false``) the disk path is refused clearly:
at config load for ``method: disk``, and by the disk sync port when it is made."""

from __future__ import annotations

import pytest

from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.port import DiskSync


def test_method_disk_without_a_shared_file_system_is_refused_at_load():
    with pytest.raises(ValueError, match=r"method: 'disk' needs .*shared_fs is false"):
        WeightSyncConfig(method="disk", shared_fs=False)
    WeightSyncConfig(method="distributed", shared_fs=False)  # no file crosses nodes: fine


def test_the_disk_port_is_refused_before_it_writes(tmp_path):
    cfg = WeightSyncConfig(method="distributed", shared_fs=False)
    with pytest.raises(ValueError, match=r"method: 'disk' needs .*shared_fs is false"):
        DiskSync(object(), object(), tmp_path / "sync", cfg)
    assert not (tmp_path / "sync").exists()
