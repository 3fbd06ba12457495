"""The wire format between ``ShardedRollout`` (``rollout/sharded.py``) and its worker processes
(``rollout/sharded_worker.py``): what crosses the unix socket, and how.

A frame is a 4-byte little-endian length and one pickle (protocol 5). Messages are tuples whose
first field names them::

    worker -> controller                          controller -> worker
    ("hello", index, pid)      first frame        ("gen", [(rid, ids, sampling, priority), ...])
    ("ready", None | error)    client started     ("cancel", rid)
    ("ans", [item, ...])       answers            ("remove", url)
    ("ack", seq, ok, result)   a control call's   ("ctl", seq, op, arg)   op: pause, continue, health
                               end                ("close",)

``ids`` is the prompt as the raw bytes of an ``array('i')``; ``priority`` the request's scheduling
priority (its group's admission order, read in the controller's task: ``rollout.staleness``).
An answer ``item`` is either
``(rid, error | None)`` (the worker's error, or None when the controller cancelled it) or
``(rid, finish_reason, ids, logprobs, versions, (matched, aborted, num_segments, servers,
latency_s))`` with the three columns as the raw bytes of their arrays: no per-token Python object
crosses (:func:`answer_item` writes one, :func:`answer_sample` reads it back as a ``Sample``).
Requests and answers made in one turn of a loop leave in one frame (:class:`Batcher`). The
client's ``RequestError`` / ``ServerError`` cross as themselves; an error that does not survive a
pickle round trip crosses as a ``RolloutError`` naming it (:func:`picklable`).
"""

from __future__ import annotations

import asyncio
import copyreg
import pickle
import struct
from array import array

from areal_fast.columns import LOGPROB_ARRAY, ROUTING_ARRAY, TOKEN_ARRAY
from areal_fast.rollout.calls import RequestError, RolloutError, ServerError
from areal_fast.sample import Sample

_HEADER = struct.Struct("<I")  # frame length; a frame holds one pickle
_PICKLE = 5


def frame(obj) -> list[bytes]:
    """``obj`` as one frame: its length, then its pickle (for ``writer.writelines``)."""
    body = pickle.dumps(obj, protocol=_PICKLE)
    return [_HEADER.pack(len(body)), body]


async def read_frame(reader: asyncio.StreamReader):
    """The next object, or None at end of file."""
    try:
        head = await reader.readexactly(_HEADER.size)
        return pickle.loads(await reader.readexactly(_HEADER.unpack(head)[0]))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class Batcher:
    """Messages written in one turn of the loop leave in one frame (one syscall, one pickle)."""

    def __init__(self, writer: asyncio.StreamWriter, tag: str):
        self.writer, self.tag, self.items = writer, tag, []

    def add(self, item) -> None:
        if not self.items:
            asyncio.get_running_loop().call_soon(self.flush)
        self.items.append(item)

    def flush(self) -> None:
        items, self.items = self.items, []
        if items and not self.writer.is_closing():
            self.writer.writelines(frame((self.tag, items)))


def as_array(raw: bytes, typecode: str) -> array:
    """The array of ``typecode`` whose raw bytes are ``raw`` (one memcpy)."""
    a = array(typecode)
    a.frombytes(raw)
    return a


def answer_item(rid: str, r: Sample) -> tuple:
    """The answer item of a finished ``generate``: its columns as their bytes."""
    return (rid, r.finish_reason, r.output_ids.tobytes(), r.output_logprobs.tobytes(),
            r.output_versions.tobytes(), (r.matched, r.aborted, r.num_segments, r.servers, r.latency_s),
            r.routed_experts.tobytes())


def answer_sample(rid: str, item: tuple, prompt: array) -> Sample:
    """The ``Sample`` of an answer item (not an error item); ``prompt`` is the caller's, as it is."""
    matched, aborted, segments, servers, latency = item[5]
    return Sample(prompt_ids=prompt, output_ids=as_array(item[2], TOKEN_ARRAY),
                  output_logprobs=as_array(item[3], LOGPROB_ARRAY), output_versions=as_array(item[4], TOKEN_ARRAY),
                  routed_experts=as_array(item[6], ROUTING_ARRAY), finish_reason=item[1], rid=rid, matched=matched,
                  aborted=aborted, num_segments=segments, servers=servers, latency_s=latency)


def _reduce_http_error(e: RequestError | ServerError):
    return type(e), (e.url, e.status, e.body)


# the client's errors cross to the controller as themselves (a caller can tell a 4xx from the rest)
copyreg.pickle(RequestError, _reduce_http_error)
copyreg.pickle(ServerError, _reduce_http_error)


def picklable(e: BaseException) -> BaseException:
    """``e`` if it survives a pickle round trip, else a RolloutError naming it."""
    try:
        pickle.loads(pickle.dumps(e, protocol=_PICKLE))
        return e
    except Exception:  # noqa: BLE001 - any exception that does not survive a round trip
        return RolloutError(f"{type(e).__name__}: {e}")
