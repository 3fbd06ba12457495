"""vLLM's weight transfer from the trainer (``backends.vllm.transfer``) against the embedded engine's
vLLM twin over gloo (CPU): the same endpoints, bodies and ranks as with real vLLM over NCCL.

- two updates over one group (made once), while a request is kept (vLLM's keep pause): the twin
  ends with weights bitwise equal to the trainer's, labelled with the new version, and every token
  of the kept request carries the version of the weights that made it;
- the transport refuses what cannot work before any rendezvous: CPU tensors to a real vLLM server
  (NCCL only), a release without the endpoints, one server per DP rank.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _shared import until_running

from areal_fast.backends.vllm.client import VLLMRolloutClient
from areal_fast.backends.vllm.compat import VLLMBehaviour
from areal_fast.backends.vllm.transfer import VLLMServer, _ranks_of, choose_transfer_backend
from areal_fast.data.tiny_models import build_tiny_qwen2, perturbed_state_dict
from areal_fast.embedded import start_engine_in_thread
from areal_fast.weights.errors import WeightSyncError

SENDER = Path(__file__).with_name("_vllm_sender.py")
PROMPT = [3, 17, 42, 9, 100]


@pytest.mark.slow  # a sender subprocess (torch import) and two updates
def test_transfer_to_the_twin_is_bitwise_and_labels_every_token(tmp_path):
    model_dir = build_tiny_qwen2(str(tmp_path / "base"), vocab_size=256)
    states = [perturbed_state_dict(model_dir, seed=s) for s in (7, 8)]
    for i, st in enumerate(states):
        torch.save(st, tmp_path / f"s{i}.pt")
    twin = start_engine_in_thread(model_dir, seed=1, api="vllm", vllm_version="0.33.0", weight_version="0",
                                  dtype="float32")
    sched = twin.server.scheduler

    def send() -> str:
        cmd = [sys.executable, str(SENDER), twin.url, str(tmp_path / "s0.pt"), "1", str(tmp_path / "s1.pt"), "2"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH":
                           os.pathsep.join([str(SENDER.parent), os.environ.get("PYTHONPATH", "")])})
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    async def run():
        async with VLLMRolloutClient([twin.url], vllm_version="0.33.0", pause_mode="in_place") as c:
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 200, "ignore_eos": True,
                                                           "temperature": 1.0}, rid="kept"))
            await until_running(twin, 2, task=task)
            await c.pause_all()
            n_before = max(len(r.output_ids) for r in list(sched._rows))
            out = await asyncio.to_thread(send)
            await c.continue_all()
            return n_before, out, await asyncio.wait_for(task, 120)

    try:
        n_before, out, s = asyncio.run(run())
        params = twin.server.receiver._params
        sent = [n for n in states[1] if n in params]
        assert sent and all(torch.equal(params[n].detach(), states[1][n]) for n in sent), "weights bitwise"
        assert sched.weight_version == "2"
        # the sender closed its sync: the twin's end of the group was shut too (re-made cleanly next time)
        assert "vllm_weight_transfer" not in twin.server.receiver.groups
    finally:
        twin.stop()
    assert "INITS 1" in out, "one group for both updates"
    assert s.num_segments == 1 and len(s.output_ids) == 200, "the kept request went on"
    v = list(s.output_versions)
    assert v == [0] * n_before + [2] * (200 - n_before), "each token labelled by the weights that made it"


def _server(url="http://h:1", twin=False, device="cuda", version="0.33.0", ranks=1) -> VLLMServer:
    return VLLMServer(url, VLLMBehaviour.of(version), ranks, twin, device)


def test_cpu_tensors_go_to_the_twin_only():
    assert choose_transfer_backend(torch.device("cpu"), [_server(twin=True, device="cpu")]) == "gloo"
    with pytest.raises(WeightSyncError, match="must be on CUDA.*http://real:1"):
        choose_transfer_backend(torch.device("cpu"), [_server(twin=True, device="cpu"), _server("http://real:1")])
    with pytest.raises(WeightSyncError, match="run on CPU"):
        choose_transfer_backend(torch.device("cuda"), [_server(twin=True, device="cpu")])
    assert choose_transfer_backend(torch.device("cuda"), [_server()]) == "nccl"


def test_ranks_of_a_server_and_external_dp_refused():
    par = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2}
    assert _ranks_of("u", {"vllm_config": {"parallel_config": par}}) == 8
    with pytest.raises(WeightSyncError, match="one server per DP rank"):
        _ranks_of("u", {"vllm_config": {"parallel_config": {**par, "data_parallel_size_local": 1}}})
    with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE"):
        _ranks_of("u", {"detail": "Not Found"})
