"""update_weights_from_distributed over gloo from a separate trainer-side process (exact spec protocol)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file

from areal_fast.data.tiny_models import build_tiny_qwen2, hf_greedy, load_hf, perturbed_state_dict
from areal_fast.embedded import start_engine_in_thread
from areal_fast.netutil import find_free_port

PROBE = [4, 40, 14, 41]
PROBE_TOKENS = 12
DIST_TIMEOUT_S = 3.0  # the engine's group timeout in the silent-trainer test


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny")), vocab_size=256)
    h = start_engine_in_thread(base)
    yield base, h, tmp_path_factory.mktemp("sender")
    h.stop()


def _run_sender(spec: dict, tmp) -> dict:
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    sender = Path(__file__).with_name("reference_sender.py")
    proc = subprocess.run([sys.executable, str(sender), str(spec_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(open(spec["result_path"]).read())


def test_update_from_distributed_per_tensor_then_flattened_bucket(setup):
    base, h, tmp = setup
    old = hf_greedy(load_hf(base), PROBE, PROBE_TOKENS)
    for seed in (1, 2):
        save_file(perturbed_state_dict(base, seed=seed), str(tmp / f"sd{seed}.safetensors"))
    spec = {"url": h.url, "master_port": find_free_port(), "group_name": "weight_update_group",
            "result_path": str(tmp / "result.json"), "probe": PROBE, "probe_new_tokens": PROBE_TOKENS,
            "rounds": [{"tensors": str(tmp / "sd1.safetensors"), "version": "1", "load_format": None,
                        "dtype": "float32"},
                       {"tensors": str(tmp / "sd2.safetensors"), "version": "2",
                        "load_format": "flattened_bucket", "dtype": "bfloat16"}]}
    res = _run_sender(spec, tmp)
    assert res["init"]["success"] is True, res["init"]
    assert res["destroy"]["success"] is True
    r1, r2 = res["rounds"]
    assert r1["update"]["success"] is True and r2["update"]["success"] is True, (r1["update"], r2["update"])
    assert r1["weight_version"] == "1" and r2["weight_version"] == "2"
    want1 = hf_greedy(load_hf(base, perturbed_state_dict(base, seed=1)), PROBE, PROBE_TOKENS)
    sd2 = {k: v.bfloat16().float() for k, v in perturbed_state_dict(base, seed=2).items()}  # sent as bf16
    want2 = hf_greedy(load_hf(base, sd2), PROBE, PROBE_TOKENS)
    assert r1["output_ids"] == want1 and r1["output_ids"] != old
    assert r2["output_ids"] == want2 and r2["output_ids"] != want1
    assert not h.server.receiver.groups  # destroyed


def test_a_trainer_that_joins_and_never_sends_fails_the_update_in_bounded_time(tmp_path_factory):
    """The update call fails after the group timeout with a clear message; meanwhile the engine keeps
    answering, and the probe generation after it runs on the unchanged weights."""
    base = build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_silent")), vocab_size=256)
    h = start_engine_in_thread(base, dist_timeout_s=DIST_TIMEOUT_S)
    tmp = tmp_path_factory.mktemp("silent")
    try:
        save_file(perturbed_state_dict(base, seed=3), str(tmp / "sd.safetensors"))
        spec = {"url": h.url, "master_port": find_free_port(), "group_name": "weight_update_group",
                "result_path": str(tmp / "result.json"), "probe": PROBE, "probe_new_tokens": PROBE_TOKENS,
                "rounds": [{"tensors": str(tmp / "sd.safetensors"), "version": "1", "load_format": None,
                            "dtype": "float32", "silent": True}]}
        res = _run_sender(spec, tmp)
    finally:
        h.stop()
    (rnd,) = res["rounds"]
    assert rnd["update"]["success"] is False and "Failed to receive weights" in rnd["update"]["message"]
    assert rnd["waited_s"] < DIST_TIMEOUT_S + 30  # bounded by the group timeout, not 300 s or forever
    assert rnd["weight_version"] == "default"
    assert rnd["output_ids"] == hf_greedy(load_hf(base), PROBE, PROBE_TOKENS)
