"""Delta weight sync: send only the elements that changed since the last update.

After an optimizer step at RL learning rates most bf16 elements of the model do not change (the
fp32 master moves by ~lr, less than half a bf16 step for most weights): 2.8 % per step at lr 1e-6
on a Qwen3-0.6B-shaped model, ~85 % at the tiny example's 2e-4 (``bench/bench_delta.py``). So
trainer rank 0 keeps a *shadow*: the bytes every server holds, as sent, in **host memory** (pinned
where CUDA is available: one model in the sent dtype, 15.2 GB at 7B, would not fit beside a 32B
model's shards on rank 0's GPU), as views of ONE host buffer of exactly the shadow's size. For
each bucket of an update, each 16-bit tensor's shadow is copied to the bucket's device, compared
with the new values there (:mod:`areal_fast.weights.delta_codec`, a kernel) and freed; the changes
(indices and values, a few percent of the tensor) come back to update the host shadow. The device holds one tensor's
staged shadow at a time (at most one bucket). The tensor travels as

* nothing, when no element changed;
* a delta, two entries ``NAME#delta_idx:SHAPE`` (int32 flat indices) and ``NAME#delta_val``
  (the new values, in the tensor's dtype), when at most ``delta_max_changed`` of it changed;
* itself, under its own name, otherwise (and every tensor that is not 16-bit).

The entries of a bucket are laid out widest dtype first (8-, 4-, 2-, 1-byte), so every entry sits
at a multiple of its element size and the bucket is a valid SGLang ``flattened_bucket``. A bucket
whose tensors all stayed the same is not sent, unless it is the update's last (it carries the
version and the cache flush): then it re-sends one unchanged element.

The buffer: torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two,
which made a shadow pinned tensor by tensor nearly twice the model at 7B; one buffer page-locked
by registering it with CUDA costs exactly its size. A whole update whose tensors (names, dtypes,
shapes) are those of the buffer writes into it; one whose tensors are new (the first, or after the
model changed) keeps exact-size host copies as it goes and moves them into a new buffer when it
succeeds (host memory holds the shadow twice for that moment).

Whole updates: the first after the transport (re)connects, every ``delta_full_every``-th, and the
one after any failed update (the servers' state is then unknown). The shadow is updated as each
bucket is encoded and thrown away when an update fails, so a delta is only ever computed against
bytes every server acknowledged. Who applies deltas:

* the embedded engine: natively (:func:`apply_named`, the codec's kernels);
* SGLang: only a server launched with our model package (``weights.delta: on``, see
  ``docs/weight_sync.md``); a stock SGLang server would skip the unknown names.

The wire names and the server side (split an update's entries, write a delta into a parameter) are
:mod:`areal_fast.weights.delta_wire`, which the servers import without the trainer's machinery.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from areal_fast.weights.delta_codec import MAX_WORDS, WORD_DTYPES, delta_apply, delta_encode
from areal_fast.weights.delta_wire import DELTA_IDX, DELTA_VAL, delta_name
from areal_fast.weights.gather import Bucket

__all__ = ["DELTA_IDX", "DELTA_VAL", "DeltaEncoder", "DeltaStats", "wants_delta"]

log = logging.getLogger(__name__)

def wants_delta(mode: str, engine: str | None, on_cuda: bool) -> bool:
    """Does a server get deltas? ``on``: every server (SGLang must run our model package, or it skips
    the entries); ``off``: none; ``auto``: servers that apply them (the embedded engine) when the
    trainer's tensors are on CUDA, where encoding runs at HBM speed and the wire is the bottleneck.
    From a CPU trainer the encode costs more than the bytes it saves (``bench/bench_delta.py`` gloo:
    2.85 s against 1.60 s per update on loopback, 7 % of the bytes)."""
    return mode == "on" or (mode == "auto" and on_cuda and engine == "areal_fast.embedded")


@dataclass
class DeltaStats:
    """What one update moved (trainer rank 0)."""

    mode: str = "whole"  # 'whole' or 'delta'
    bytes_sent: int = 0
    bytes_whole: int = 0  # what sending everything would have taken
    elements: int = 0  # 16-bit elements compared
    changed: int = 0
    tensors_whole: int = 0
    tensors_delta: int = 0
    buckets_skipped: int = 0

    @property
    def changed_frac(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor  # contiguous, any dtype


@dataclass
class DeltaEncoder:
    """Trainer rank 0's shadow of what the servers hold (host tensors), and the per-bucket choice
    (module docstring). ``backend``: the codec's backend for the encode on the buckets' device."""

    full_every: int = 10
    max_changed: float = 0.25
    backend: str | None = None
    shadow: dict[str, torch.Tensor] = field(default_factory=dict)
    since_full: int | None = None  # updates since the last whole one; None: the next is whole
    stats: DeltaStats = field(default_factory=DeltaStats)
    buffer: torch.Tensor | None = None  # the one host buffer (uint8) the shadow's tensors are views of
    _layout: list[tuple[str, torch.dtype, tuple]] = field(default_factory=list)  # the buffer's tensors
    _seen: list[tuple[str, torch.dtype, tuple]] = field(default_factory=list)  # kept in this update
    _loose: bool = False  # a shadow tensor outside the buffer (a new name, dtype or shape)

    def begin(self) -> bool:
        """Start an update; True if it may send deltas."""
        delta = self.since_full is not None and self.since_full + 1 < self.full_every and bool(self.shadow)
        if not delta and self.buffer is None:
            self.shadow.clear()  # a whole update rewrites the buffer's views in place; loose copies go
        self._seen = []
        self.stats = DeltaStats(mode="delta" if delta else "whole")
        return delta

    def done(self, ok: bool) -> None:
        """End an update: count it, or forget everything after a failure; the shadow in one buffer."""
        if not ok:
            self.invalidate()
            return
        if self.stats.mode == "whole":
            self.since_full = 0
            if self._seen != self._layout or self._loose:
                self._into_one_buffer(self._seen)
        else:
            self.since_full = (self.since_full or 0) + 1
            if self._loose:
                self._into_one_buffer([(n, t.dtype, tuple(t.shape)) for n, t in self.shadow.items()])

    def invalidate(self) -> None:
        self.shadow.clear()
        self.since_full = None
        self.buffer, self._layout, self._loose = None, [], False

    def _into_one_buffer(self, layout: list[tuple[str, torch.dtype, tuple]]) -> None:
        """The shadow of ``layout``'s tensors moved into one new host buffer of exactly their bytes."""
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in layout]  # 16-bit: every offset aligned
        buf = host_buffer(sum(sizes))
        shadow, off = {}, 0
        for (name, dtype, shape), n in zip(layout, sizes):
            view = buf[off : off + n].view(dtype).view(shape)
            view.copy_(self.shadow[name])
            shadow[name] = view
            off += n
        self.shadow, self.buffer, self._layout, self._loose = shadow, buf, list(layout), False

    def encode(self, bucket: Bucket) -> Bucket | None:
        """The bucket to send instead of ``bucket`` (None: send nothing), updating the shadow."""
        st = self.stats
        nbytes = int(bucket.data.numel())
        st.bytes_whole += nbytes
        if st.mode == "whole":
            for i, name in enumerate(bucket.names):
                if bucket.dtypes[i] in WORD_DTYPES:  # only 16-bit tensors ever travel as deltas
                    self._keep(name, bucket.tensor(i))
            st.bytes_sent += nbytes
            st.tensors_whole += len(bucket.names)
            return bucket
        entries: list[_Entry] = []
        for i, name in enumerate(bucket.names):
            entries.extend(self._encode_tensor(name, bucket.tensor(i)))
        if not entries:
            if not bucket.last:
                st.buckets_skipped += 1
                return None
            entries = self._keepalive(bucket)
        out = _pack(entries, bucket.index, bucket.last, bucket.data.device)
        st.bytes_sent += int(out.data.numel())
        return out

    def _keep(self, name: str, t: torch.Tensor) -> None:
        """The shadow of ``name`` := ``t`` (into its place in the buffer when it has one, else an
        exact-size host copy, moved into a new buffer at the update's end)."""
        self._seen.append((name, t.dtype, tuple(t.shape)))
        old = self.shadow.get(name)
        if old is None or old.dtype != t.dtype or old.shape != t.shape:
            old = self.shadow[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self._loose = True
        old.copy_(t)  # device -> host; a blocking copy: the host shadow is read next on the CPU

    def _encode_tensor(self, name: str, t: torch.Tensor) -> list[_Entry]:
        st = self.stats
        host = self.shadow.get(name)
        usable = (host is not None and t.dtype in WORD_DTYPES and host.dtype == t.dtype and host.shape == t.shape
                  and 0 < t.numel() <= MAX_WORDS)
        enc = None
        if usable:
            st.elements += t.numel()
            limit = int(math.floor(self.max_changed * t.numel()))
            # the shadow staged on the bucket's device for the compare (freed when this returns;
            # non_blocking from pinned memory, ordered before the encode on the same stream)
            old = host if host.device == t.device else host.to(t.device, non_blocking=host.is_pinned())
            enc = delta_encode(old, t, backend=self.backend, max_changed=limit)
            del old
            if enc is None:
                st.changed += t.numel()  # more than the limit; counted as all for the stats
        if enc is None:
            if t.dtype in WORD_DTYPES:
                self._keep(name, t)
            st.tensors_whole += 1
            return [_Entry(name, t.dtype, tuple(t.shape), t.contiguous())]
        idx, val = enc
        st.changed += idx.numel()
        if idx.numel() == 0:
            return []
        if host.device == idx.device:
            delta_apply(host, idx, val, backend=self.backend, check=False)
        else:  # the changes to the host shadow (a few percent of the tensor cross back, not all of it)
            delta_apply(host, idx.cpu(), val.cpu())
        st.tensors_delta += 1
        return [_Entry(delta_name(name, t.shape), torch.int32, (idx.numel(),), idx),
                _Entry(name + DELTA_VAL, t.dtype, (val.numel(),), val)]

    def _keepalive(self, bucket: Bucket) -> list[_Entry]:
        """One unchanged element of the bucket's first 16-bit tensor, as a delta (a bitwise no-op)."""
        for i, name in enumerate(bucket.names):
            t = bucket.tensor(i)
            if t.dtype in WORD_DTYPES and t.numel():
                idx = torch.zeros(1, dtype=torch.int32, device=t.device)
                return [_Entry(delta_name(name, t.shape), torch.int32, (1,), idx),
                        _Entry(name + DELTA_VAL, t.dtype, (1,), t.reshape(-1)[:1].clone())]
        raise AssertionError("a bucket with no 16-bit tensor is always sent whole")


def host_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised host buffer (uint8) of exactly ``nbytes``: page-locked where CUDA is available
    (fast, asynchronous copies to the device) by registering it with CUDA, since ``pin_memory=True``
    would round it up to a power of two; pageable where CUDA is not, or where registering fails."""
    if nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    mem = _PageLocked(-1, nbytes)
    buf = torch.frombuffer(mem, dtype=torch.uint8, count=nbytes)  # holds ``mem`` while any view lives
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        log.warning("delta shadow: registering %d bytes of host memory with CUDA failed (%s); the shadow stays "
                    "pageable (slower copies to the device)", nbytes, err)
        return buf
    mem.ptr = buf.data_ptr()
    return buf


class _PageLocked(mmap.mmap):
    """Anonymous host memory, unregistered from CUDA when the last tensor over it is gone (then unmapped)."""

    ptr = 0

    def __del__(self):
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
                pass


def _pack(entries: list[_Entry], index: int, last: bool, device) -> Bucket:
    """Entries back to back, widest element first (each at a multiple of its size, no padding)."""
    entries = sorted(entries, key=lambda e: -e.dtype.itemsize)  # stable: deltas keep idx before val order
    sizes = [e.data.numel() * e.dtype.itemsize for e in entries]
    offsets = [int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]])] if entries else []
    data = torch.empty(int(sum(sizes)), dtype=torch.uint8, device=device)
    for e, off, n in zip(entries, offsets, sizes):
        data[off : off + n].copy_(e.data.reshape(-1).view(torch.uint8))
    return Bucket(index=index, names=[e.name for e in entries], dtypes=[e.dtype for e in entries],
                  shapes=[e.shape for e in entries], offsets=offsets, data=data, last=last)
