"""Delta weight sync (``areal_fast.weights.delta``): the sender's choices, and after K delta updates a
server's weights bitwise equal to a whole update.

In one process, like test_weights_session: a real gloo weight group whose server ranks run in
threads behind SGLang-like fake servers (tests/fakes.py). The engine-like server loads what it gets
through the embedded engine's own ``WeightReceiver`` (``embedded/weight_sync.py``), which
applies deltas natively, and says ``engine: areal_fast.embedded`` in /server_info like the engine.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
from areal_fast.embedded.weight_sync import WeightReceiver
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.delta import DeltaEncoder, wants_delta
from areal_fast.weights.delta_wire import DELTA_IDX, parse_delta_name, split_entries
from areal_fast.weights.gather import Bucket
from tools.weight_receiver import zero_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakes import FakeServer  # noqa: E402

TIMEOUT_S = 30

SHAPES = {  # several buckets at 1 KiB, one tensor larger than a bucket, odd sizes
    "embed.weight": (40, 16), "q.weight": (16, 16), "q.bias": (16,), "up.weight": (33, 15), "norm.weight": (7,),
}


class EngineLikeServer(FakeServer):
    """The fake SGLang server, loading through the embedded engine's receiver (deltas included)."""

    def __init__(self, dtype=torch.bfloat16, **kw):
        super().__init__(**kw)
        self.model = zero_model(SHAPES, dtype)
        self.receiver = WeightReceiver(self.model)
        self.entry_names: list[str] = []

    def _answer(self, path, body):
        code, ans = super()._answer(path, body)
        if path in ("/server_info", "/get_server_info"):
            ans["engine"] = "areal_fast.embedded"
        return code, ans

    def _receive(self, body):
        got = super()._receive(body)
        if self.refuse_bucket_with and any(n.startswith(self.refuse_bucket_with) for n in got):
            self.refuse_bucket_with = None  # once, after receiving, like SGLang's loader failing
            raise RuntimeError("Failed to update parameter online: test refusal")
        self.entry_names += list(got)
        self.receiver.load(list(got.items()))
        return {}


@pytest.fixture
def servers():
    made = []

    def make(cls=FakeServer, **kw):
        made.append(cls(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}


def _step(state, seed, frac=0.03):
    """A sparse move of the fp32 master, like a small-lr step: ~frac of the bf16 elements change."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        mask = torch.rand(t.shape, generator=g) < frac
        t[mask] += 0.01 * torch.sign(torch.randn(t.shape, generator=g)[mask]) + 0.001


def _assert_bitwise(model, state, dtype=torch.bfloat16):
    params = dict(model.named_parameters())
    for n, t in state.items():
        want = t.to(dtype)
        assert torch.equal(params[n].detach().view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                           want.view(torch.int16 if dtype.itemsize == 2 else torch.int32)), n


def _cfg(**kw):
    base = dict(bucket_bytes=1 << 10, dtype="bfloat16", collective="gloo", timeout_s=TIMEOUT_S)
    base.update(kw)
    return WeightSyncConfig(**base)


# ------------------------------------------------------------------------------ end to end
def test_k_delta_updates_equal_a_whole_update_bitwise(servers):
    eng = servers(EngineLikeServer)
    state = _state()
    ws = DistributedWeightSync([eng.url], _cfg(delta="on", delta_full_every=100))
    try:
        ws.update(state, 0)
        assert ws.delta.stats.mode == "whole"
        _assert_bitwise(eng.model, state)
        for k in range(1, 5):  # K = 4 delta updates
            _step(state, k)
            eng.entry_names.clear()
            ws.update(state, k)
            st = ws.delta.stats
            assert st.mode == "delta" and 0 < st.changed < st.elements, st
            assert st.bytes_sent < st.bytes_whole / 3, st
            assert any(DELTA_IDX in n for n in eng.entry_names)
            _assert_bitwise(eng.model, state)
        assert eng.weight_version == "4"
        # nothing changed: only the last bucket travels, one unchanged element
        eng.entry_names.clear()
        ws.update(state, 5)
        assert ws.delta.stats.changed == 0 and len(eng.entry_names) == 2 and eng.weight_version == "5"
        _assert_bitwise(eng.model, state)
        # one tensor moved entirely: sent whole, the others as deltas
        state["up.weight"] += 0.05
        _step(state, 9)
        eng.entry_names.clear()
        ws.update(state, 6)
        assert "up.weight" in eng.entry_names and ws.delta.stats.tensors_delta > 0
        _assert_bitwise(eng.model, state)
    finally:
        ws.close()


def test_an_fp32_engine_fed_bf16_deltas_holds_what_a_whole_load_gives(servers):
    eng = servers(EngineLikeServer, dtype=torch.float32)
    state = _state(1)
    ws = DistributedWeightSync([eng.url], _cfg(delta="on"))
    try:
        for k in range(3):
            _step(state, 10 + k)
            ws.update(state, k)
        assert ws.delta.stats.mode == "delta"
        _assert_bitwise(eng.model, {n: t.to(torch.bfloat16) for n, t in state.items()}, torch.float32)
    finally:
        ws.close()


def test_stock_sglang_or_a_cpu_trainer_gets_whole_updates_by_default(servers):
    eng, plain = servers(EngineLikeServer), servers()
    state = _state(2)
    ws = DistributedWeightSync([eng.url, plain.url], _cfg())  # delta: auto, CPU tensors
    try:
        for k in range(3):
            _step(state, 20 + k)
            ws.update(state, k)
            assert ws.delta.stats.mode == "whole"
        assert not any(DELTA_IDX in n for n in eng.entry_names) and set(plain.received) == set(SHAPES)
        _assert_bitwise(eng.model, state)
    finally:
        ws.close()
    emb = "areal_fast.embedded"
    assert wants_delta("auto", emb, on_cuda=True) and not wants_delta("auto", emb, on_cuda=False)
    assert not wants_delta("auto", None, on_cuda=True) and wants_delta("on", None, on_cuda=False)
    assert not wants_delta("off", emb, on_cuda=True)


def test_full_every_n_and_after_a_failure(servers):
    eng = servers(EngineLikeServer)
    state = _state(3)
    ws = DistributedWeightSync([eng.url], _cfg(delta="on", delta_full_every=3))
    try:
        modes = []
        for k in range(7):
            _step(state, 30 + k)
            ws.update(state, k)
            modes.append(ws.delta.stats.mode)
        assert modes == ["whole", "delta", "delta", "whole", "delta", "delta", "whole"]
        eng.refuse_bucket_with = "embed.weight"  # the fake refuses a bucket naming it (after receiving)
        _step(state, 40)
        with pytest.raises(Exception, match="test refusal"):
            ws.update(state, 7)
        assert ws.delta.since_full is None and not ws.delta.shadow
        _step(state, 41)
        ws.update(state, 8)
        assert ws.delta.stats.mode == "whole"
        _assert_bitwise(eng.model, state)
    finally:
        ws.close()


# ---------------------------------------------------------------------------------- encoder
def _bucket(tensors: dict[str, torch.Tensor], last=True) -> Bucket:
    data, offsets, off = [], [], 0
    for t in tensors.values():
        b = t.contiguous().view(-1).view(torch.uint8)
        offsets.append(off)
        off += b.numel()
        data.append(b)
    return Bucket(index=0, names=list(tensors), dtypes=[t.dtype for t in tensors.values()],
                  shapes=[tuple(t.shape) for t in tensors.values()], offsets=offsets, data=torch.cat(data), last=last)


def test_delta_bucket_is_aligned_and_keeps_non_16_bit_tensors_whole():
    enc = DeltaEncoder(full_every=10, max_changed=0.25)
    a = torch.randn(5, 3).to(torch.bfloat16)
    f = torch.randn(3)  # fp32: never a delta
    i = torch.arange(3, dtype=torch.int64)
    enc.begin()
    enc.encode(_bucket({"i": i, "f": f, "a": a}))
    enc.done(True)
    assert set(enc.shadow) == {"a"}  # only 16-bit tensors are shadowed
    a2 = a.clone()
    a2[1, 2] = -a2[1, 2]
    assert enc.begin()
    out = enc.encode(_bucket({"i": i, "f": f, "a": a2}))
    for name, dt, off in zip(out.names, out.dtypes, out.offsets):
        assert off % dt.itemsize == 0, (name, off)
    assert [dt.itemsize for dt in out.dtypes] == sorted((dt.itemsize for dt in out.dtypes), reverse=True)
    named = [(n, out.tensor(k)) for k, n in enumerate(out.names)]
    whole, deltas = split_entries(named)
    assert {n for n, _ in whole} == {"f", "i"} and list(deltas) == ["a"]
    shape, idx, val = deltas["a"]
    assert shape == (5, 3) and idx.tolist() == [5] and val.view(torch.int16).tolist() == [a2.view(torch.int16)[1, 2]]
    assert enc.stats.tensors_delta == 1 and enc.stats.tensors_whole == 2


def test_unchanged_buckets_are_skipped_except_the_last():
    enc = DeltaEncoder()
    a = torch.randn(8).to(torch.bfloat16)
    enc.begin()
    enc.encode(_bucket({"a": a}, last=False))
    enc.done(True)
    enc.begin()
    assert enc.encode(_bucket({"a": a}, last=False)) is None and enc.stats.buckets_skipped == 1
    out = enc.encode(_bucket({"a": a}, last=True))
    assert [parse_delta_name(n)[1] for n in out.names] == ["idx", "val"]


def test_delta_pairs_that_do_not_match_are_refused():
    i = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="without their pair"):
        split_entries([("w#delta_idx:4", i)])
    with pytest.raises(ValueError, match="do not pair"):
        split_entries([("w#delta_idx:4", i), ("w#delta_val", torch.zeros(3, dtype=torch.bfloat16))])
    recv = WeightReceiver(zero_model(SHAPES, torch.bfloat16))
    with pytest.raises(ValueError, match="outside"):
        recv.load([("q.bias#delta_idx:16", torch.tensor([16], dtype=torch.int32)),
                   ("q.bias#delta_val", torch.ones(1, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="computed for shape"):
        recv.load([("q.bias#delta_idx:4x4", torch.tensor([1], dtype=torch.int32)),
                   ("q.bias#delta_val", torch.ones(1, dtype=torch.bfloat16))])


@pytest.mark.parametrize("bad", [-1, 16])
def test_the_embedded_receiver_refuses_indices_outside_the_tensor_before_writing(bad):
    """The twin of the SGLang applier's check: the error names the tensor and the index, and neither
    the good delta nor the whole tensor of the same call is written."""
    model = zero_model(SHAPES, torch.bfloat16)
    recv = WeightReceiver(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"q\.bias: index {bad} outside 16 elements"):
        recv.load([("q.weight#delta_idx:16x16", torch.tensor([3], dtype=torch.int32)),
                   ("q.weight#delta_val", torch.ones(1, dtype=torch.bfloat16)),
                   ("norm.weight", torch.ones(7, dtype=torch.bfloat16)),
                   ("q.bias#delta_idx:16", torch.tensor([0, bad], dtype=torch.int32)),
                   ("q.bias#delta_val", torch.ones(2, dtype=torch.bfloat16))])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
