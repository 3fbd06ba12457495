"""The delta sender's shadow (``DeltaEncoder``) lives in host memory, not on the trainer's GPU (one
model in the sent dtype: 15.2 GB at 7B, an OOM at 32B); each tensor's shadow is staged to the
bucket's device for the encode and freed, so the device holds at most one bucket of staged copies.

The CPU has no second device, so the buckets here are CPU tensors that *say* they are on
``cuda:0`` (:class:`OnDevice`), and a ``TorchFunctionMode`` (:class:`FakeDevice`) plays the
device's copies and allocations on the CPU, counting the bytes staged to it. The encoder runs
its reference backend (the automatic choice would pick the CUDA kernels for a CUDA device).
On a GPU the same contract is checked for real (``test_host_shadow_on_cuda_is_pinned``)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from areal_fast.weights.delta import DeltaEncoder
from areal_fast.weights.delta_wire import split_entries
from areal_fast.weights.gather import Bucket

FAKE = torch.device("cuda", 0)


class OnDevice(torch.Tensor):
    """A CPU tensor that reports ``cuda:0``: what the encoder sees of a GPU trainer's bucket."""

    @property
    def device(self):
        return FAKE

    @property
    def is_cuda(self):
        return True


def _is_fake(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class FakeDevice(TorchFunctionMode):
    """Copies to ``cuda`` become CPU copies typed :class:`OnDevice` (their bytes counted while they
    live), allocations on ``cuda`` the same, copies to the CPU plain tensors."""

    def __init__(self):
        super().__init__()
        self.staged_live = self.staged_peak = self.staged_copies = 0

    def _count(self, t: torch.Tensor) -> None:
        n = t.untyped_storage().nbytes()
        self.staged_live += n
        self.staged_peak = max(self.staged_peak, self.staged_live)
        self.staged_copies += 1
        weakref.finalize(t.untyped_storage(), self._freed, n)

    def _freed(self, n: int) -> None:
        self.staged_live -= n

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            src = args[0]
            if func is torch.Tensor.to:
                device, dtype, _nb, _mf = torch._C._nn._parse_to(*args[1:], **kwargs)
            else:
                device, dtype = (FAKE if func is torch.Tensor.cuda else torch.device("cpu")), None
            with torch._C.DisableTorchFunctionSubclass():
                if device is not None and _is_fake(device) and not isinstance(src, OnDevice):
                    out = src.to(dtype=dtype or src.dtype, copy=True).as_subclass(OnDevice)
                    self._count(out)
                    return out
                if device is not None and device.type == "cpu" and isinstance(src, OnDevice):
                    return src.to(dtype=dtype or src.dtype, copy=True)  # a plain CPU tensor
        if _is_fake(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            return func(*args, **kwargs).as_subclass(OnDevice)
        return func(*args, **kwargs)


def _bucket(tensors: dict[str, torch.Tensor], index=0, last=True, on_device=True) -> Bucket:
    offsets, off = [], 0
    for t in tensors.values():
        off = -(-off // t.element_size()) * t.element_size()
        offsets.append(off)
        off += t.numel() * t.element_size()
    buf = torch.zeros(off, dtype=torch.uint8)
    for t, o in zip(tensors.values(), offsets):
        buf[o : o + t.numel() * t.element_size()] = t.contiguous().view(-1).view(torch.uint8)
    if on_device:
        buf = buf.as_subclass(OnDevice)
    return Bucket(index=index, names=list(tensors), dtypes=[t.dtype for t in tensors.values()],
                  shapes=[tuple(t.shape) for t in tensors.values()], offsets=offsets, data=buf, last=last)


def _model(g) -> dict[str, torch.Tensor]:
    return {"embed": torch.randn(40, 16, generator=g).to(torch.bfloat16),
            "q": torch.randn(16, 16, generator=g).to(torch.bfloat16),
            "norm": torch.randn(16, generator=g),  # fp32: never shadowed
            "up": torch.randn(33, 15, generator=g).to(torch.float16)}


def _buckets(state, on_device=True):
    return [_bucket({"embed": state["embed"]}, 0, False, on_device),
            _bucket({"q": state["q"], "norm": state["norm"]}, 1, False, on_device),
            _bucket({"up": state["up"]}, 2, True, on_device)]


def _step(state, g, frac):
    """Flip the sign of about ``frac`` of every 16-bit tensor's elements."""
    out = {}
    for n, t in state.items():
        t = t.clone()
        if t.dtype != torch.float32:
            m = torch.rand(t.shape, generator=g) < frac
            t[m] = -t[m]
        out[n] = t
    return out


def _entries(b: Bucket) -> list[tuple[str, bytes]]:
    with torch._C.DisableTorchFunctionSubclass():
        return [(n, b.tensor(i).reshape(-1).view(torch.uint8).numpy().tobytes()) for i, n in enumerate(b.names)]


def test_shadow_is_in_host_memory_and_device_copies_are_one_bucket_at_most():
    g = torch.Generator().manual_seed(0)
    v0 = _model(g)
    v1 = _step(v0, g, 0.05)  # deltas
    v2 = _step(v1, g, 0.6)  # more than max_changed: whole, the shadow rewritten
    on_dev = DeltaEncoder(full_every=10, max_changed=0.25, backend="reference")
    on_cpu = DeltaEncoder(full_every=10, max_changed=0.25, backend="reference")  # the same run, all on the CPU
    biggest_bucket = max(b.data.numel() for b in _buckets(v0, on_device=False))
    mode = FakeDevice()
    for k, state in enumerate((v0, v1, v2)):
        assert on_dev.begin() == (k > 0) and on_cpu.begin() == (k > 0)
        for b_dev, b_cpu in zip(_buckets(state), _buckets(state, on_device=False)):
            with mode:
                out_dev = on_dev.encode(b_dev)
            out_cpu = on_cpu.encode(b_cpu)
            assert (out_dev is None) == (out_cpu is None)
            if out_dev is not None:
                assert isinstance(out_dev.data, OnDevice), "what is sent stays on the device"
                assert _entries(out_dev) == _entries(out_cpu)
            assert mode.staged_live == 0, "no staged copy outlives the bucket's encode"
        on_dev.done(True)
        on_cpu.done(True)
        for n, t in on_dev.shadow.items():
            assert type(t) is torch.Tensor and t.device.type == "cpu", f"shadow of {n} is on {t.device}"
            assert torch.equal(t.view(torch.int16), on_cpu.shadow[n].view(torch.int16)), n
            assert torch.equal(t.view(torch.int16), state[n].view(torch.int16)), n
    assert set(on_dev.shadow) == {"embed", "q", "up"}
    assert mode.staged_copies > 0, "delta updates compare on the device: the shadow is staged there"
    assert mode.staged_peak <= biggest_bucket, (mode.staged_peak, biggest_bucket)
    # v2: every 16-bit tensor changed past the limit (whole, its shadow rewritten), and the fp32 one
    assert on_dev.stats.tensors_whole == 4 and on_dev.stats.tensors_delta == 0


def test_delta_after_host_shadow_applies_to_the_servers_copy():
    """The deltas computed against the host shadow rebuild the new weights from the old ones."""
    g = torch.Generator().manual_seed(1)
    v0 = _model(g)
    v1 = _step(v0, g, 0.03)
    enc = DeltaEncoder(backend="reference")
    mode = FakeDevice()
    enc.begin()
    with mode:
        for b in _buckets(v0):
            enc.encode(b)
    enc.done(True)
    assert enc.begin()
    server = {n: t.clone() for n, t in v0.items()}
    with mode:
        outs = [enc.encode(b) for b in _buckets(v1)]
    for out in outs:
        if out is None:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            named = [(n, out.tensor(i).as_subclass(torch.Tensor)) for i, n in enumerate(out.names)]
        whole, deltas = split_entries(named)
        for n, t in whole:
            server[n] = t.clone()
        for n, (_shape, idx, val) in deltas.items():
            server[n].view(-1)[idx.long()] = val
    for n in v1:
        assert torch.equal(server[n].view(torch.uint8), v1[n].view(torch.uint8)), n
    assert enc.stats.tensors_delta == 3


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_the_shadow_is_one_host_buffer_of_exactly_the_16_bit_bytes():
    """Views of one buffer, of exactly the shadowed tensors' bytes (pinned tensor by tensor, the
    pinned allocator rounded each up to a power of two), reused by later updates, whole ones too,
    and replaced by one of the new size when the tensors change."""
    g = torch.Generator().manual_seed(3)
    v0 = _model(g)
    states = [v0, _step(v0, g, 0.05), _step(v0, g, 0.6)]  # whole, deltas, then more than max_changed
    enc = DeltaEncoder(full_every=2, max_changed=0.25, backend="reference")  # the third update is whole
    want = sum(t.numel() * t.element_size() for t in v0.values() if t.dtype != torch.float32)
    first = None
    for state in states:
        enc.begin()
        for b in _buckets(state, on_device=False):
            enc.encode(b)
        enc.done(True)
        assert len({_storage(t) for t in enc.shadow.values()}) == 1, "one buffer, not one block per tensor"
        assert enc.buffer.untyped_storage().nbytes() == want
        assert {_storage(t) for t in enc.shadow.values()} == {_storage(enc.buffer)}
        first = first or _storage(enc.buffer)
        assert _storage(enc.buffer) == first, "an update of the same tensors writes into the same buffer"
        for n, t in enc.shadow.items():
            assert torch.equal(t.view(torch.int16), state[n].view(torch.int16)), n
    assert enc.stats.mode == "whole"  # the third update: whole, into the same buffer
    grown = dict(states[-1], q=torch.randn(16, 24, generator=g).to(torch.bfloat16))  # a tensor changed shape
    enc.begin()
    for b in _buckets(grown, on_device=False):
        enc.encode(b)
    enc.done(True)
    assert enc.buffer.untyped_storage().nbytes() == want + 16 * 8 * 2
    assert {_storage(t) for t in enc.shadow.values()} == {_storage(enc.buffer)}
    assert torch.equal(enc.shadow["q"].view(torch.int16), grown["q"].view(torch.int16))
    enc.done(False)  # a failed update drops the shadow and its buffer
    assert enc.buffer is None and not enc.shadow


def test_the_page_locked_buffer_is_registered_once_and_unregistered_with_its_last_view(monkeypatch):
    """Where CUDA is available the buffer is host memory registered with CUDA (exact size); it is
    unregistered when the last tensor over it goes, not before (CUDA's registry played here)."""
    import gc

    from areal_fast.weights import delta

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's names
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    buf = delta.host_buffer(3000)
    view = buf[1000:2000].view(torch.bfloat16)
    view.fill_(1.5)
    ptr = buf.data_ptr()
    assert calls == [("register", ptr, 3000)] and buf.numel() == 3000
    del buf
    gc.collect()
    assert calls == [("register", ptr, 3000)], "unregistered while a view was alive"
    assert bool((view == 1.5).all())
    del view
    gc.collect()
    assert calls == [("register", ptr, 3000), ("unregister", ptr)]


@pytest.mark.gpu
def test_host_shadow_on_cuda_is_pinned_and_the_device_holds_one_tensor_at_most():
    g = torch.Generator().manual_seed(2)
    v0 = {n: t.cuda() for n, t in _model(g).items()}
    v1 = {n: t.cuda() for n, t in _step({n: t.cpu() for n, t in v0.items()}, g, 0.05).items()}
    enc = DeltaEncoder()

    def buckets(state):
        cpu = _buckets({n: t.cpu() for n, t in state.items()}, on_device=False)
        for b in cpu:
            b.data = b.data.cuda()
        return cpu

    enc.begin()
    for b in buckets(v0):
        enc.encode(b)
    enc.done(True)
    for t in enc.shadow.values():
        assert t.device.type == "cpu" and t.is_pinned()
    # one page-locked buffer of exactly the shadow's bytes, not a power-of-two block per tensor
    want = sum(t.numel() * t.element_size() for t in v0.values() if t.dtype != torch.float32)
    assert enc.buffer.is_pinned() and enc.buffer.untyped_storage().nbytes() == want
    assert {_storage(t) for t in enc.shadow.values()} == {_storage(enc.buffer)}
    assert enc.begin()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    bs = buckets(v1)
    held = torch.cuda.memory_allocated() - base
    for b in bs:
        enc.encode(b)
    enc.done(True)
    extra = torch.cuda.max_memory_allocated() - base - held
    biggest = max(b.data.numel() for b in bs)
    assert extra <= 4 * biggest + (8 << 20), (extra, biggest)  # staged shadow + encode outputs + the packed bucket
    for n, t in enc.shadow.items():
        assert t.is_pinned() and torch.equal(t.view(torch.int16), v1[n].cpu().view(torch.int16)), n
