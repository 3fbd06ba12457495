"""End to end against the embedded engine (areal_fast.embedded) in a subprocess: the
trainer (this process, no FSDP) pushes new weights through the broadcast path and the disk
path; the engine's weight_version changes and its greedy continuation equals a local HF model
holding the same bf16-rounded weights."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

PROMPT = [5, 17, 42, 3, 99]
N_NEW = 8


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _get(url, path):
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen2
    from areal_fast.embedded.launch import launch_engine_subprocess

    base = build_tiny_qwen2(str(tmp_path_factory.mktemp("e2e") / "base"))
    h = launch_engine_subprocess(base, dtype="float32")
    try:
        yield h, base
    finally:
        h.stop()


def _engine_greedy(url):
    out = _post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0,
                                                                           "ignore_eos": True}})
    return out["output_ids"][:N_NEW], out["meta_info"]["weight_version"]


def _expected_greedy(base, state):
    from areal_fast.data.tiny_models import hf_greedy, load_hf

    model = load_hf(base, {k: v.to(torch.bfloat16).float() for k, v in state.items()})
    return hf_greedy(model, PROMPT, N_NEW)


@pytest.mark.slow  # an engine subprocess
def test_broadcast_then_disk_update_real_engine(engine):
    from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
    from areal_fast.data.tiny_models import perturbed_state_dict
    from areal_fast.weights.sync import WeightSyncConfig

    h, base = engine
    before, _ = _engine_greedy(h.url)
    s1 = perturbed_state_dict(base, seed=1)
    sync = DistributedWeightSync([h.url], WeightSyncConfig(bucket_bytes=64 << 10, collective="gloo", timeout_s=60,
                                                           dtype="bfloat16", group_name="e2e_weight_group"))
    try:
        sync.update(s1, 7)
        assert sync.version == "7"
        assert _get(h.url, "/get_model_info")["weight_version"] == "7"
        got, ver = _engine_greedy(h.url)
        assert ver == "7"
        want = _expected_greedy(base, s1)
        assert got == want and got != before
        s2 = perturbed_state_dict(base, seed=2)
        sync.update(s2, 8)  # the group is reused
        assert sync.n_inits == 1 and _engine_greedy(h.url) == (_expected_greedy(base, s2), "8")
    finally:
        sync.close()
    s3 = perturbed_state_dict(base, seed=3)
    disk = DiskWeightSync([h.url], WeightSyncConfig(timeout_s=60, dtype="bfloat16"), config_dir=base)
    disk.update(s3, 9)
    assert _engine_greedy(h.url) == (_expected_greedy(base, s3), "9")


@pytest.mark.slow  # an engine subprocess
def test_delta_updates_real_engine(engine):
    """Delta updates through the engine's HTTP route: after a whole update and K sparse steps sent as
    deltas, the engine's greedy output equals a model holding the bf16 weights of the last step."""
    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
    from areal_fast.data.tiny_models import perturbed_state_dict
    from areal_fast.weights.sync import WeightSyncConfig

    h, base = engine
    state = perturbed_state_dict(base, seed=4)
    sync = DistributedWeightSync([h.url], WeightSyncConfig(bucket_bytes=64 << 10, collective="gloo", timeout_s=60,
                                                           dtype="bfloat16", group_name="e2e_delta_group", delta="on"))
    g = torch.Generator().manual_seed(0)
    try:
        sync.update(state, 20)
        assert sync.delta.stats.mode == "whole"
        for k in range(1, 4):  # K = 3 deltas: ~3 % of the elements move by one bf16 step or more
            for t in state.values():
                if t.is_floating_point():
                    m = torch.rand(t.shape, generator=g) < 0.03
                    t[m] *= 1 + 2**-6
            sync.update(state, 20 + k)
            st = sync.delta.stats
            assert st.mode == "delta" and st.tensors_delta > 0 and st.bytes_sent < st.bytes_whole / 2, st
        assert _engine_greedy(h.url) == (_expected_greedy(base, state), "23")
    finally:
        sync.close()
