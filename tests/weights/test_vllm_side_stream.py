"""vLLM's weight broadcast runs on a stream of its own (areal_fast/backends/vllm/transfer.py,
``SideStream``): the order of its stream operations, checked on CPU with a recording stand-in for
``torch.cuda``, and on a GPU that the compute stream goes on while a broadcast runs and that the
broadcast reads what the compute stream wrote before it."""

from __future__ import annotations

import pytest
import torch

from areal_fast.backends.vllm.transfer import SideStream, _NcclChannel


class _Recorder:
    """A stand-in for ``torch.cuda``: streams and events that log what is done to them."""

    def __init__(self):
        self.log: list[tuple] = []
        self.compute = _Stream(self, "compute")
        self.done = False

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        return _Stream(self, "side")

    def current_stream(self, device=None):
        return self.compute

    def Event(self):  # noqa: N802
        return _Event(self)


class _Stream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_stream(self, other):
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.cuda.log.append(("wait_event", self.name, event.stream))


class _Event:
    def __init__(self, cuda):
        self.cuda, self.stream = cuda, None

    def record(self, stream):
        self.stream = stream.name
        self.cuda.log.append(("record", stream.name))

    def query(self):
        return self.cuda.done


class _Tensor:
    def __init__(self, cuda):
        self.cuda = cuda

    def is_contiguous(self):
        return True

    def record_stream(self, stream):
        self.cuda.log.append(("record_stream", stream.name))


def test_the_broadcast_waits_for_the_compute_stream_runs_on_its_own_and_is_waited_by_event():
    cuda = _Recorder()
    side = SideStream(0, cuda=cuda)
    t = _Tensor(cuda)
    work = side.broadcast(lambda x, stream: cuda.log.append(("broadcast", stream.name, x is t)), t)
    assert cuda.log == [
        ("wait_stream", "side", "compute"),  # the bucket was written on the compute stream
        ("broadcast", "side", True),  # not on the compute stream: packing and gathering go on
        ("record_stream", "side"),  # its memory is not handed out again before the broadcast read it
        ("record", "side"),
    ]
    assert not work.is_completed()  # the host sees the broadcast's own progress, not its enqueueing
    cuda.done = True
    assert work.is_completed()
    work.wait()  # the compute stream's next work (refilling the buffer) comes after the broadcast
    assert cuda.log[-1] == ("wait_event", "compute", "side")


def test_the_nccl_channel_broadcasts_through_the_side_stream():
    cuda, sent = _Recorder(), []

    class Comm:
        def broadcast(self, tensor, src, stream):
            sent.append((tensor, src, stream.name))

    ch = object.__new__(_NcclChannel)  # without vLLM's communicator: only its broadcast is used here
    ch.comm, ch.side = Comm(), SideStream(0, cuda=cuda)
    t = _Tensor(cuda)
    ch.broadcast(t)
    assert sent == [(t, 0, "side")] and ("record_stream", "side") in cuda.log


@pytest.mark.gpu
def test_on_cuda_the_compute_stream_runs_during_a_broadcast_and_the_broadcast_reads_its_writes():
    dev = torch.device("cuda", torch.cuda.current_device())
    side = SideStream(dev)
    src = torch.zeros(1 << 20, device=dev)
    got = torch.empty_like(src)
    torch.cuda._sleep(50_000_000)  # the compute stream is busy ...
    src.fill_(7.0)  # ... and writes the bucket late: the side stream must wait for it

    def send(t, stream):  # a broadcast stand-in: a slow read of t on the given stream
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)
            got.copy_(t)

    work = side.broadcast(send, src)
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream(dev))  # compute work issued after the broadcast
    mark.synchronize()
    assert not work.is_completed(), "the compute stream waited behind the broadcast"
    work.wait()
    src.fill_(1.0)  # the next bucket, written only after the broadcast has read this one
    torch.cuda.synchronize(dev)
    assert work.is_completed()
    assert bool((got == 7.0).all()) and bool((src == 1.0).all())
