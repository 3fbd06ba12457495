"""The controller's buffer of finished groups, with a bound on its memory: groups beyond the bound
wait in a spill file, and checkpoints stream the buffer to disk in the same binary form.

Why: at 256 servers / 16,384 in flight, eta 4, answers of ~6,000 tokens on average, the gate lets
up to (eta + 1) x B groups exist beyond the trained ones; when generation outruns training the
finished ones wait here: ~25k samples x ~6k tokens x 13 bytes (id and version int32, float32
log-prob, mask byte) = ~2 GB, the controller's whole memory goal. A checkpoint that encoded them as
base64 inside one JSON made two more copies while it was written.

::

    park(part of a running group) --> in memory or spill file (same bound) --> unpark() when the group is done
    append(group) --> in memory (while the column bytes in memory, parts included, stay <= bound)
                  \\-> spill file: one record, at a free extent (reused; truncated when it empties)
    FIFO of slots: Group (in memory) or _Spilled (position, oldest version, extent): strict drops
    need no read; take() pops slots, load() reads spilled ones back (pread: safe in a thread),
    release() frees their extents.

A **record** (one group; the spill file and a checkpoint's ``buffer.bin`` hold the same bytes)::

    magic b"AFG1" | meta length u32 | data length u64 | CRC-32 of meta + data u32   (little-endian)
    meta: JSON {"fields": the group's own fields (position, row, ...),
                "samples": per sample {"reward", "finish_reason", "info", "min_version"},
                "columns": {column name: item count of each sample's column}}
    data: the columns' raw little-endian bytes, column by column in the order of ``COLUMNS`` (the
          sample record's names: prompt_ids, output_ids, output_logprobs, output_versions,
          loss_mask), sample by sample within a column; a prompt equal to the first sample's is
          stored once, counted -1

A spilled group is copied into a checkpoint byte for byte (its CRC travels with it); a damaged or
truncated record is a ``ValueError`` naming the record and its offset, which the controller reports
as a corrupt checkpoint (a length field is checked against the bytes left in the file before
anything is read: a damaged one is never a huge allocation).

The spill file is created in the run's output directory (a disk, where the system temp dir may be
memory-backed tmpfs) with ``tempfile.TemporaryFile``: unlinked at once, so a crash leaves nothing
behind; the kernel frees it when the process exits.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import struct
import sys
import tempfile
import threading
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from areal_fast.checkpoint import STATE_FILE, CorruptCheckpoint, read_state
from areal_fast.columns import ITEMSIZE, LOGPROB_ARRAY, MASK_ARRAY, ROUTING_ARRAY, TOKEN_ARRAY
from areal_fast.group import Group
from areal_fast.sample import COLUMN_NAMES

MAGIC = b"AFG1"
_HEADER = struct.Struct("<4sIQI")  # magic, meta length, data length, CRC-32 of meta + data
# the columns of a sample, in the order a record stores them (the sample record's names)
COLUMNS = {"prompt_ids": TOKEN_ARRAY, "output_ids": TOKEN_ARRAY, "output_logprobs": LOGPROB_ARRAY,
           "output_versions": TOKEN_ARRAY, "loss_mask": MASK_ARRAY, "routed_experts": ROUTING_ARRAY}
_OPTIONAL_COLUMNS = ("routed_experts",)  # absent from records written before it: empty columns
assert tuple(COLUMNS) == COLUMN_NAMES
_SAMPLE_FIELDS = ("reward", "finish_reason", "info")  # what a record keeps of a sample besides its columns
_GROUP_FIELDS = ("position", "row", "admitted_version", "gen_seconds", "episodes_failed")
_SAME_PROMPT = -1  # a sample's prompt equal to the first sample's: stored once
_COPY_CHUNK = 8 << 20  # bytes per read when a spilled record is copied into a checkpoint
MB = 1 << 20


# ----------------------------------------------------------------------------- records


def _le(a: array) -> array:
    """``a`` with little-endian items (a byte-swapped copy on a big-endian host)."""
    if sys.byteorder == "big" and a.itemsize > 1:
        a = array(a.typecode, a)
        a.byteswap()
    return a


def _columns_of(g) -> tuple[dict, list[array]]:
    """The item counts (record meta) and the arrays, in record order, of group ``g``."""
    counts: dict[str, list[int]] = {}
    arrays = []
    first = g.samples[0].prompt_ids if g.samples else None
    for name in COLUMNS:
        ns = []
        for i, s in enumerate(g.samples):
            c = getattr(s, name)
            if name == "prompt_ids" and i and (c is first or c == first):
                ns.append(_SAME_PROMPT)
                continue
            ns.append(len(c))
            arrays.append(c)
        counts[name] = ns
    return counts, arrays


def _nbytes(arrays: list[array]) -> int:
    return sum(len(a) * a.itemsize for a in arrays)


def column_bytes(g) -> int:
    """Bytes of a group's columns as a record stores them (what the memory bound counts)."""
    return _nbytes(_columns_of(g)[1])


def write_record(f: BinaryIO, g, columns: tuple[dict, list[array]] | None = None) -> int:
    """Write group ``g`` as one record to the file ``f`` (at its position); the bytes written. The
    columns go to the file one by one from the group's own arrays: no joined copy. ``columns``:
    ``_columns_of(g)`` when the caller has it already."""
    counts, arrays = columns or _columns_of(g)
    samples = [{**{k: getattr(s, k) for k in _SAMPLE_FIELDS}, "min_version": s.min_model_version()}
               for s in g.samples]
    meta = json.dumps({"fields": {k: getattr(g, k) for k in _GROUP_FIELDS}, "samples": samples,
                       "columns": counts}).encode()
    arrays = [_le(a) for a in arrays]
    crc = zlib.crc32(meta)
    for a in arrays:
        crc = zlib.crc32(a, crc)
    size = _nbytes(arrays)
    f.write(_HEADER.pack(MAGIC, len(meta), size, crc))
    f.write(meta)
    for a in arrays:
        f.write(a)
    return _HEADER.size + len(meta) + size


def _record(raw: bytes | memoryview, name: str) -> tuple[int, int, int]:
    """Header of a record: (meta length, data length, CRC); ValueError when it is not one."""
    if len(raw) < _HEADER.size:
        raise ValueError(f"{name}: truncated record header ({len(raw)} of {_HEADER.size} bytes)")
    magic, n_meta, n_data, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"{name}: not a group record (magic {bytes(magic)!r})")
    return n_meta, n_data, crc


def decode_record(meta: bytes | memoryview, data: bytes | memoryview, crc: int, name: str) -> dict:
    """A group's fields (keyword arguments of ``Group``: its samples as dicts of ``Sample`` keyword
    arguments) from a record's meta and data (see the module docstring); ValueError naming ``name``
    when the CRC, the meta or the column lengths do not check out."""
    if zlib.crc32(data, zlib.crc32(meta)) != crc:
        raise ValueError(f"{name}: CRC mismatch (the record is damaged)")
    try:
        m = json.loads(bytes(meta))
        kw, counts, samples = dict(m["fields"]), m["columns"], [dict(s) for s in m["samples"]]
        for col in _OPTIONAL_COLUMNS:
            counts.setdefault(col, [0] * len(samples))
        plan = [(col, code, int(n)) for col, code in COLUMNS.items() for n in counts[col]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{name}: unreadable record meta ({e!r})") from None
    cols = _read_columns(memoryview(data), plan, name)
    for col in COLUMNS:
        if len(cols.get(col, ())) != len(samples):
            raise ValueError(f"{name}: {len(cols.get(col, ()))} {col} columns for {len(samples)} samples")
        for s, c in zip(samples, cols[col]):
            s[col] = c
    if samples:
        first = samples[0]["prompt_ids"]
        for s in samples:
            if s["prompt_ids"] is None:
                s["prompt_ids"] = first
    kw["samples"] = samples
    return kw


def _read_columns(mv: memoryview, plan: list[tuple[str, str, int]], name: str) -> dict[str, list]:
    """The arrays of a record's data, by column name, in ``plan`` order ((column, typecode, items);
    a prompt counted -1 is None: the first sample's); ValueError when they do not fill the data."""
    off = 0
    cols: dict[str, list] = {}
    for col, code, n in plan:
        if col in ("prompts", "prompt_ids") and n == _SAME_PROMPT:
            cols.setdefault(col, []).append(None)
            continue
        size = n * ITEMSIZE[code]
        if n < 0 or off + size > len(mv):
            raise ValueError(f"{name}: column {col} of {n} items does not fit the record's {len(mv)} bytes")
        a = array(code)
        a.frombytes(mv[off:off + size])
        if sys.byteorder == "big" and a.itemsize > 1:
            a.byteswap()
        off += size
        cols.setdefault(col, []).append(a)
    if off != len(mv):
        raise ValueError(f"{name}: {len(mv) - off} bytes after the last column")
    return cols


def read_records(f: BinaryIO, count: int, name: str) -> Iterator[dict]:
    """The ``count`` groups (as ``Group`` keyword arguments) of a stream of records (a seekable file),
    one at a time; ValueError naming ``name``, the record and its offset when one is short, damaged,
    or the stream goes on. A record's lengths are checked against the bytes left in the file before
    anything is read (a damaged length field is a ValueError, never a huge allocation)."""
    pos = f.tell()
    end = f.seek(0, io.SEEK_END)
    f.seek(pos)
    for i in range(count):
        rec = f"{name}: record {i} at offset {pos}"
        n_meta, n_data, crc = _record(f.read(_HEADER.size), rec)
        left = end - pos - _HEADER.size
        if n_meta + n_data > left:
            raise ValueError(f"{rec}: its lengths (meta {n_meta}, data {n_data} bytes) run past the end of the file "
                             f"({left} bytes left); the record is damaged or truncated")
        meta, data = f.read(n_meta), f.read(n_data)
        if len(meta) != n_meta or len(data) != n_data:
            raise ValueError(f"{rec}: truncated ({len(meta) + len(data)} of {n_meta + n_data} bytes)")
        pos += _HEADER.size + n_meta + n_data
        yield decode_record(meta, data, crc, rec)
    if f.read(1):
        raise ValueError(f"{name}: data after the last of its {count} records (at offset {pos})")


# ----------------------------------------------------------------------------- spill file


@dataclass(frozen=True, slots=True)
class _Spilled:
    """A group in the spill file: what strict drops and metrics need stays in memory."""

    position: int
    oldest: int | None  # oldest model-token version (Group.min_model_version)
    offset: int
    length: int

    def min_model_version(self) -> int | None:
        return self.oldest


class SpillFile:
    """An unlinked temporary file of records with first-fit reuse of freed extents (adjacent free
    extents merge; the file is cut back when its tail is free), so its size follows the spilled bytes
    of the moment, not the run's total. Reads and writes use ``pread``/``pwrite`` (no shared file
    position): a reader thread and the event loop's writes do not disturb each other; allocation
    happens on the event loop only."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self._f = None
        self.size = 0  # file length
        self._free: list[tuple[int, int]] = []  # (offset, length), sorted, merged
        self._lock = threading.Lock()  # the allocator: a checkpoint writer may free from its thread

    def _file(self):
        if self._f is None:
            d = self.directory
            if d is not None:
                d.mkdir(parents=True, exist_ok=True)
            self._f = tempfile.TemporaryFile(prefix="areal_fast_buffer_", dir=d)
        return self._f

    def _alloc(self, n: int) -> int:
        for i, (off, ln) in enumerate(self._free):
            if ln >= n:
                self._free[i:i + 1] = [(off + n, ln - n)] if ln > n else []
                return off
        off = self.size
        self.size += n
        return off

    def write(self, g, columns: tuple[dict, list[array]] | None = None) -> tuple[int, int]:
        """Write group ``g`` as a record (``columns``: see :func:`write_record`); its (offset, length)."""
        buf = io.BytesIO()  # one group (~1 MB at 16 x 6k tokens), so that pwrite places it in one call
        n = write_record(buf, g, columns)
        with self._lock:
            off = self._alloc(n)
        fd = self._file().fileno()
        view, done = buf.getbuffer(), 0
        while done < n:
            done += os.pwrite(fd, view[done:], off + done)
        del view
        return off, n

    def read(self, off: int, n: int) -> bytes:
        fd = self._file().fileno()
        out = os.pread(fd, n, off)
        while len(out) < n:  # pread may return less than asked (large reads)
            more = os.pread(fd, n - len(out), off + len(out))
            if not more:
                raise ValueError(f"spill file: {n} bytes at {off} expected, file ends after {len(out)}")
            out += more
        return out

    def load(self, s: _Spilled) -> dict:
        raw = memoryview(self.read(s.offset, s.length))
        n_meta, n_data, crc = _record(raw, f"spilled group {s.position}")
        body = raw[_HEADER.size:]
        return decode_record(body[:n_meta], body[n_meta:n_meta + n_data], crc, f"spilled group {s.position}")

    def copy_to(self, s: _Spilled, out: BinaryIO) -> None:
        """The record of ``s`` into ``out``, byte for byte, in chunks (no decoding)."""
        done = 0
        while done < s.length:
            chunk = self.read(s.offset + done, min(_COPY_CHUNK, s.length - done))
            out.write(chunk)
            done += len(chunk)

    def free(self, off: int, n: int) -> None:
        with self._lock:
            self._free_locked(off, n)

    def _free_locked(self, off: int, n: int) -> None:
        i = bisect.bisect(self._free, (off, n))
        self._free.insert(i, (off, n))
        merged: list[tuple[int, int]] = []
        for o, ln in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((o, ln))
        if merged and merged[-1][0] + merged[-1][1] == self.size:  # a free tail: give it back to the disk
            self.size = merged.pop()[0]
            self._file().truncate(self.size)
        self._free = merged

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self.size, self._free = 0, []


# ----------------------------------------------------------------------------- the buffer


@dataclass(frozen=True, slots=True)
class _Parked:
    """A part of a running group kept in memory (:meth:`GroupBuffer.park`)."""

    part: Any
    nbytes: int


class GroupBuffer:
    """FIFO of finished groups with at most ``memory_bytes`` of columns in memory (None: no bound).
    ``make_group`` builds a group from its fields (``areal_fast.group.Group``).

    A group that would take the in-memory column bytes above the bound is spilled; the groups at
    the head (the next batch) were buffered first, so they are the ones in memory. The same bound
    covers the finished episodes of groups still generating (:meth:`park`): with long-tailed answers
    they are most of the finished columns (a group waits for its longest sample). ``len`` and
    iteration (which reads spilled groups back) work from any thread; ``append``, ``take``,
    ``put_back``, ``release``, ``park``, ``unpark`` and ``discard`` belong to the event loop."""

    def __init__(self, memory_bytes: int | None, spill_dir: Path | None, make_group: Callable[..., Any]):
        self.memory_bytes = memory_bytes
        self.make_group = make_group
        self.spill = SpillFile(spill_dir)
        self._slots: deque = deque()
        self._sizes: dict[int, int] = {}  # id(group in memory) -> its column bytes
        self.in_memory = 0  # column bytes of the groups in memory
        self.spilled = 0  # groups in the spill file now
        self.spilled_total = 0  # groups ever spilled (a metric)
        self.parked = 0  # column bytes of parts of running groups kept in memory
        self.parked_spilled = 0  # parts of running groups in the spill file now
        self.parked_spilled_total = 0  # parts ever written there (a metric)
        self._pins = 0  # checkpoint writes under way: released extents are freed after them
        self._deferred: list[_Spilled] = []
        self._lock = threading.Lock()  # pins and deferred frees (the writer thread unpins)

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator:
        """The groups, FIFO (spilled ones read back: for tests and tools, not the training path)."""
        return iter(self.load(list(self._slots)))

    # -------------------------------------------------------- event loop side
    def _spill_if_over(self, g) -> tuple[int, tuple[int, int] | None]:
        """``g``'s column bytes, and its (offset, length) in the spill file when keeping it in memory
        would pass the bound (groups and parked parts together), else None."""
        cols = _columns_of(g)
        n = _nbytes(cols[1])
        if self.memory_bytes is not None and self.in_memory + self.parked + n > self.memory_bytes:
            return n, self.spill.write(g, cols)
        return n, None

    def append(self, g) -> None:
        n, extent = self._spill_if_over(g)
        if extent is not None:
            self._slots.append(_Spilled(g.position, g.min_model_version(), *extent))
            with self._lock:
                self.spilled += 1
            self.spilled_total += 1
            return
        self._slots.append(g)
        self._sizes[id(g)] = n
        self.in_memory += n

    def extend(self, groups: Iterable) -> None:
        for g in groups:
            self.append(g)

    def take(self):
        """Pop the head slot: a group, or a spilled one (``position``, ``min_model_version()``);
        :meth:`load` then :meth:`release` it, or :meth:`put_back`."""
        return self._slots.popleft()

    def put_back(self, slots: list) -> None:
        """Slots taken but not trained go back to the head, in their order."""
        self._slots.extendleft(reversed(slots))

    def load(self, slots: list) -> list:
        """The groups of ``slots`` (spilled ones read back; reads only: safe in a thread)."""
        return [self.make_group(**self.spill.load(s)) if isinstance(s, _Spilled) else s for s in slots]

    def release(self, slots: list) -> None:
        """Slots taken for good (trained or dropped): their memory and spill extents are freed."""
        for s in slots:
            if isinstance(s, _Spilled):
                with self._lock:
                    if self._pins:
                        self._deferred.append(s)
                        continue
                self._free(s)
            else:
                self.in_memory -= self._sizes.pop(id(s), 0)

    # -------------------------------------------------------- finished parts of running groups
    def park(self, part):
        """Hold ``part`` (a group of some finished episodes of a group still generating) until
        :meth:`unpark`: in memory while the bound allows, else in the spill file. Returns its handle.
        Parts are never in a checkpoint (a running group is regenerated after a restart)."""
        n, extent = self._spill_if_over(part)
        if extent is not None:
            self.parked_spilled += 1
            self.parked_spilled_total += 1
            return _Spilled(part.position, None, *extent)
        self.parked += n
        return _Parked(part, n)

    def unpark(self, handle):
        """The part of ``handle`` (read back if it was spilled: one pread); its memory or extent is freed."""
        try:
            return handle.part if isinstance(handle, _Parked) else self.make_group(**self.spill.load(handle))
        finally:
            self.discard(handle)

    def discard(self, handle) -> None:
        """Forget a parked part unread (its group was cancelled or failed)."""
        if isinstance(handle, _Parked):
            self.parked -= handle.nbytes
        else:  # never in a checkpoint's snapshot: no pin to wait for
            self.spill.free(handle.offset, handle.length)
            self.parked_spilled -= 1

    def _free(self, s: _Spilled) -> None:
        self.spill.free(s.offset, s.length)
        with self._lock:
            self.spilled -= 1

    # -------------------------------------------------------- checkpoints
    def snapshot(self) -> list:
        """The slots now (a list of references: no group is copied)."""
        return list(self._slots)

    def write(self, slots: list, f: BinaryIO) -> int:
        """Write a :meth:`snapshot` to ``f`` as records, group by group (a spilled one copied as it
        is); the bytes written. Safe in a thread while the loop appends; between :meth:`pin` and
        :meth:`unpin`, slots released meanwhile keep their extents until the copy is done."""
        start = f.tell()
        for s in slots:
            if isinstance(s, _Spilled):
                self.spill.copy_to(s, f)
            else:
                write_record(f, s)
        return f.tell() - start

    def pin(self) -> None:
        with self._lock:
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            done = self._deferred if not self._pins else []
            if done:
                self._deferred = []
        for s in done:  # released while a checkpoint was being written (the allocator has its lock)
            self._free(s)

    def close(self) -> None:
        self.spill.close()


def checkpoint_groups(path: Path, st: dict | None = None) -> Iterator[Group]:
    """The buffered groups of the checkpoint at ``path`` (``st``: its controller state, read when not
    given), one at a time, FIFO, from ``buffer.bin``. CorruptCheckpoint names the file when a group is
    unreadable or the file is short or too long. The checkpoint's layout is ``areal_fast.checkpoint``'s,
    its records this module's."""
    st = read_state(path) if st is None else st
    ref, where = st["buffer_file"], STATE_FILE
    try:
        where = str(ref["name"])
        f = path / where
        if f.stat().st_size != int(ref["bytes"]):
            raise ValueError(f"{f.stat().st_size} bytes, {STATE_FILE} says {ref['bytes']}")
        with open(f, "rb") as fh:
            for kw in read_records(fh, int(ref["groups"]), where):
                yield Group(**kw)
    except (OSError, ValueError, TypeError, KeyError, OverflowError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: a buffered group in {where} is unreadable: {e!r}") from e
