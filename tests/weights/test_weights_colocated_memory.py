"""The colocated sync materialises the full (unsharded) tensors one bucket at a time: its extra
memory is one bucket of ``weights.bucket_bytes`` (a larger tensor alone), not the whole model.

Run on the CPU through the real ``ColocatedWeightSync._send`` with FSDP2-style ``Shard(0)`` DTensors
over a one-rank gloo mesh; only the server (facts, session, HTTP) and the CUDA IPC serialisation
are stand-ins. ``DTensor.full_tensor`` is wrapped to count the bytes of full tensors alive at once
(a finalizer on each one's storage, so views and detached aliases keep it counted)."""

from __future__ import annotations

import contextlib
import types
import weakref

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from areal_fast.backends.sglang import colocated
from areal_fast.backends.sglang.colocated import ColocatedWeightSync
from areal_fast.trainer.model import init_process_group_if_needed
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.layout import ModelSpec, hf_to_sglang

# 4 layers, untied embeddings (the two largest tensors), vocabulary 200 (padded on the server)
SPEC = ModelSpec("qwen2", num_layers=4, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                 head_dim=8, vocab_size=200, qkv_bias=True)
BUCKET = 4096  # bytes: the model is ~50x larger in fp32


class LiveFullBytes:
    """Bytes of full tensors alive now and at most, by storage lifetime."""

    def __init__(self):
        self.live = self.peak = self.calls = 0

    def _freed(self, n: int) -> None:
        self.live -= n

    def track(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        n = s.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        self.calls += 1
        weakref.finalize(s, self._freed, n)
        return t


def _sharded_state(g: torch.Generator) -> tuple[dict, dict]:
    init_process_group_if_needed(torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    full = {n: torch.randn(s, generator=g) for n, s in SPEC.hf_shapes().items()}
    return full, {n: distribute_tensor(t.clone(), mesh, [Shard(0)]) for n, t in full.items()}


def _offline_sync(monkeypatch, sent: list) -> ColocatedWeightSync:
    """A ColocatedWeightSync whose server side is stubbed: facts of a tp-1 server, no session,
    payloads recorded instead of posted; the serialiser keeps the named tensors."""
    sync = ColocatedWeightSync("http://127.0.0.1:1", SPEC, WeightSyncConfig(bucket_bytes=BUCKET))
    facts = types.SimpleNamespace(check_layout=lambda **kw: None, tp_size=1, version="0.5.23")
    monkeypatch.setattr(sync, "read_facts", lambda: {sync.urls[0]: facts})
    monkeypatch.setattr(sync, "session", lambda *a, **k: contextlib.nullcontext([]))
    sync._http = types.SimpleNamespace(all=lambda urls, path, body: sent.append((path, body)) or [{}],
                                       close=lambda: None)
    monkeypatch.setattr(colocated, "serialize_for_sglang", lambda named: named)
    # the stream sync before the server reads (CUDA only): a no-op here
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(synchronize=lambda: None))
    return sync


def test_colocated_gathers_one_bucket_at_a_time_and_sends_the_reference_shard(monkeypatch):
    full, state = _sharded_state(torch.Generator().manual_seed(0))
    probe = LiveFullBytes()
    real_full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: probe.track(real_full_tensor(self, **kw)))
    sent: list = []
    sync = _offline_sync(monkeypatch, sent)
    sync._send(state, "7")

    assert probe.calls == len(SPEC.hf_shapes()), "every tensor is gathered once"
    model_fp32 = sum(t.numel() * 4 for t in full.values())
    largest_sent = max(t.numel() for t in full.values()) * torch.bfloat16.itemsize
    assert probe.peak <= BUCKET + largest_sent, (
        f"{probe.peak} bytes of full tensors alive at once (model in fp32: {model_fp32}); "
        f"at most one bucket ({BUCKET}) plus the largest tensor ({largest_sent}) expected")
    assert probe.live == 0, "no full tensor outlives the update"

    (path, body), = sent
    assert path == "/update_weights_from_tensor" and body["weight_version"] == "7"
    named, = body["serialized_named_tensors"]
    want = hf_to_sglang({n: t.to(torch.bfloat16) for n, t in full.items()}, SPEC, 1)[0]
    assert [n for n, _ in named] == list(want)
    for n, t in named:  # bit for bit what the reference layout gives
        assert torch.equal(t.view(torch.int16), want[n].view(torch.int16)), n


def test_colocated_second_update_reuses_the_plan_and_sends_new_weights(monkeypatch):
    full, state = _sharded_state(torch.Generator().manual_seed(1))
    sent: list = []
    sync = _offline_sync(monkeypatch, sent)
    sync._send(state, "1")
    plan = sync._plan
    with torch.no_grad():
        for n, t in state.items():
            t.to_local().mul_(-2)
            full[n].mul_(-2)
    sync._send(state, "2")
    assert sync._plan is plan
    named, = sent[-1][1]["serialized_named_tensors"]
    want = hf_to_sglang({n: t.to(torch.bfloat16) for n, t in full.items()}, SPEC, 1)[0]
    for n, t in named:
        assert torch.equal(t.view(torch.int16), want[n].view(torch.int16)), n
