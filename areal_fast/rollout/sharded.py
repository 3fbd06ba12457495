"""The rollout client sharded across worker processes, for when one core cannot carry the answers.

    rollout = ShardedRollout(urls, 2, client_class=cls, api_key=key, pause_mode="auto")  # the client's options
    async with rollout:                  # spawns the workers, each reads the facts of its servers
        gen = await rollout.generate(prompt_ids, {"max_new_tokens": 256}, rid="q1-s0")
        gen.output_ids, gen.output_logprobs, gen.output_versions   # array.array columns of a Sample
        await rollout.pause(); ...; await rollout.resume()

Layout (``docs/scale.md``)::

    controller process (asyncio)                       worker k (spawned, own asyncio loop)
    +----------------------------+   unix socket   +--------------------------------------+
    | ShardedRollout.generate ---+-- req frames -->| RolloutClient over urls[k::N]        |
    |   future per rid  <--------+-- answer frames-| (retries, failover, stitching, pause |
    | pause/resume: broadcast,   |   (batched per  |  modes: all of RolloutClient)        |
    |   wait for every ack       |   loop turn)    |                                      |
    +----------------------------+                 +--------------------------------------+

Each worker owns a disjoint subset of the servers (``urls[k::N]``) and runs an ordinary
``RolloutClient`` over it, with every option passed through unchanged (api key, timeouts, pause
mode). The controller keeps no HTTP, JSON or per-token Python object: an answer crosses the socket
as the raw bytes of its ``array`` columns (4-byte ids, versions and log-probs) and becomes the
``array.array`` columns of a :class:`~areal_fast.sample.Sample` again, whose ``prompt_ids`` is the
caller's prompt (the array the controller made of it, not a copy). Frames are a 4-byte
length and a pickle (protocol 5, bytes fields only: no per-token objects); requests and answers
made in one turn of a loop travel in one frame.

Routing: a new request goes to the live worker with the fewest requests outstanding per server
it owns. ``pause``/``resume``/``health`` go to every worker (or the owner of a url) and return when
every worker acknowledged. Dead servers are handled as ``ClientRollout`` does (``is_dead``, then
``remove_server`` on the worker that owns the url).

A worker that dies (its socket reaches end of file) is logged as an error naming it (index, pid,
exit code, servers), its servers leave the pool, and the requests it had in flight are sent again,
from their start, to the other workers; an answer for a rid that is not outstanding at the worker
that sent it is dropped and counted (``stats["duplicates_dropped"]``), so nothing is lost or
answered twice. With no worker left every waiting call raises :class:`WorkerDied`.

The code is in three modules, by side: this one is the controller's (``ShardedRollout``: spawning,
routing, resending, broadcasts, reaping), ``sharded_worker`` the worker process's, and
``sharded_wire`` what crosses the socket (frames, messages, the answer's columns as bytes).

Workers end with the controller: ``close()`` asks them to stop and reaps them (terminate, then
kill after a grace period); a worker also exits when its socket closes and is killed by the kernel
when the controller process dies (``PR_SET_PDEATHSIG``), so none is ever orphaned.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from areal_fast import columns
from areal_fast.rollout.answer import tune_gc
from areal_fast.rollout.client import API_KEY_ENV, RequestError, RolloutClient, RolloutError, ServerError  # noqa: F401
from areal_fast.rollout.loop import event_loop_choice
from areal_fast.rollout.port import ClientRollout
from areal_fast.rollout.sharded_wire import Batcher, answer_sample, frame, read_frame
from areal_fast.rollout.sharded_worker import worker_main
from areal_fast.rollout.staleness import ADMISSION_ORDER
from areal_fast.sample import Sample

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # spawn + imports + /server_info of every server, on a loaded 2-core machine
_POLL_S = 0.02  # how often a waiting call looks whether a worker process ended
CLOSE_GRACE_S = 10.0  # a closing worker gets this long to end its HTTP sessions before SIGTERM/SIGKILL


class WorkerDied(RolloutError):
    """A rollout worker process ended without being asked to (the message names it)."""


# ----------------------------------------------------------------------------- controller side


@dataclass(eq=False)
class _Worker:
    index: int
    urls: list[str]
    proc: multiprocessing.process.BaseProcess
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task | None = None
    requests: Batcher | None = None
    outstanding: set[str] = field(default_factory=set)  # rids sent here and not answered yet
    cancelled: set[str] = field(default_factory=set)  # rids cancelled by the caller, the worker not heard yet
    acks: dict[int, asyncio.Future] = field(default_factory=dict)
    alive: bool = True
    ready: asyncio.Future | None = None

    @property
    def name(self) -> str:
        return f"rollout worker {self.index} (pid {self.proc.pid}, servers {', '.join(self.urls) or 'none'})"

    def send(self, obj) -> None:
        if self.alive and self.writer is not None and not self.writer.is_closing():
            self.writer.writelines(frame(obj))


@dataclass(eq=False)
class _Pending:
    input_ids: bytes
    prompt: array  # the caller's prompt as array('i'): the answer's sample holds it
    sampling: dict
    future: asyncio.Future
    worker: _Worker
    priority: int = 0  # the group's admission order (rollout.staleness.ADMISSION_ORDER), read in the caller's task


async def _exited(proc, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``proc`` to end (without blocking the loop); True if it did."""
    deadline = time.monotonic() + timeout_s
    while proc.is_alive():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


class ShardedRollout(ClientRollout):
    """The rollout port over ``processes`` worker processes (see the module docstring).

    ``client_class`` is the backend's client adapter (``areal_fast.backends.registry.client_class``:
    rollout names no backend), built in every worker with ``client_kwargs``, its keyword options,
    which reach every worker unchanged; the
    api key defaults to ``AREAL_FAST_API_KEY`` as there. ``is_dead(url)`` (run in this process)
    tells a failed control call which servers to drop, as for ``ClientRollout``. ``loop`` is the
    workers' event loop (``areal_fast.rollout.loop``: None = ``AREAL_FAST_EVENT_LOOP`` or auto)."""

    def __init__(self, urls: list[str], processes: int, *, client_class: type[RolloutClient], is_dead=None,
                 loop: str | None = None, **client_kwargs):
        urls = [u.rstrip("/") for u in urls]
        if not 1 <= processes <= len(urls):
            raise ValueError(f"client_processes: must be >= 1 and <= the number of servers ({len(urls)}), "
                             f"got {processes!r}")
        if not (isinstance(client_class, type) and issubclass(client_class, RolloutClient)):
            raise TypeError(f"client_class must be a RolloutClient subclass (a backend's adapter), got "
                            f"{client_class!r}")
        client_class(urls, **client_kwargs)  # refuses a bad option here, before any process starts
        self.client_class = client_class
        event_loop_choice(loop)
        super().__init__(None, is_dead=is_dead)
        client_kwargs.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
        self.client_kwargs = client_kwargs
        self.loop = loop
        self.processes = processes
        self._shards = [urls[k::processes] for k in range(processes)]
        self.workers: list[_Worker] = []
        self._owner: dict[str, _Worker] = {}
        self._pending: dict[str, _Pending] = {}
        self._seq = 0
        self._dir: str | None = None
        self._server: asyncio.base_events.Server | None = None
        self._closing = False
        self.pause_mode: str | None = None  # the mode of our pause while paused, else None
        self.server_pause_modes: dict[str, str] = {}
        self.pause_seconds_in_workers: list[float] = []  # each worker's pause_all() of the last pause
        self.worker_failures: list[str] = []  # one message per worker that died
        self.stats = {"requests": 0, "answers": 0, "resent": 0, "duplicates_dropped": 0, "workers_lost": 0}

    @property
    def api_key(self) -> str | None:
        return self.client_kwargs.get("api_key")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.workers:
            return
        ctx = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="areal_rollout_")  # 0700: only this user can connect
        path = str(Path(self._dir) / "s")
        loop = asyncio.get_running_loop()
        self._server = await asyncio.start_unix_server(self._on_connect, path)
        for k, urls in enumerate(self._shards):
            args = (k, path, urls, self.client_class, self.client_kwargs, self.loop)
            w = _Worker(k, urls, ctx.Process(target=worker_main, args=args,
                                             name=f"rollout-worker-{k}", daemon=True))
            w.ready = loop.create_future()
            self.workers.append(w)
            for u in urls:
                self._owner[u] = w
        for w in self.workers:
            w.proc.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(self._wait_ready(w) for w in self.workers)), START_TIMEOUT_S)
        except BaseException:
            await self.close()
            raise
        if self.client_kwargs.get("gc_tuning", True):
            tune_gc()
        log.info("rollout client in %d worker processes (pids %s) over %d servers", len(self.workers),
                 ", ".join(str(w.proc.pid) for w in self.workers), sum(len(w.urls) for w in self.workers))

    async def _wait_ready(self, w: _Worker) -> None:
        """The worker's ready message, or an error naming it if its process ends first."""
        while not w.ready.done():
            if not w.proc.is_alive():
                raise WorkerDied(f"{w.name} exited with code {w.proc.exitcode} before it was ready")
            await asyncio.wait({w.ready}, timeout=_POLL_S)
        err = w.ready.result()
        if err is not None:
            raise err

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_frame(reader)
        if not hello or hello[0] != "hello" or not 0 <= hello[1] < len(self.workers):
            writer.close()
            return
        w = self.workers[hello[1]]
        w.writer, w.requests = writer, Batcher(writer, "gen")
        w.reader_task = asyncio.current_task()
        try:
            await self._read_loop(w, reader)
        except asyncio.CancelledError:  # the loop is ending; asyncio's stream callback would log it
            writer.close()

    async def _read_loop(self, w: _Worker, reader: asyncio.StreamReader) -> None:
        while True:
            msg = await read_frame(reader)
            if msg is None:
                break
            kind = msg[0]
            if kind == "ans":
                self._on_answers(w, msg[1])
            elif kind == "ack":
                fut = w.acks.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_result((msg[2], msg[3]))
            elif kind == "ready":
                if not w.ready.done():
                    w.ready.set_result(msg[1])
        if not self._closing:
            await self._lost(w)

    async def close(self) -> None:
        """Stop every worker and reap it; requests still waiting raise RolloutError."""
        self._closing = True
        for w in self.workers:
            w.send(("close",))
        for w in self.workers:
            if w.proc.pid is not None:  # started
                if not await _exited(w.proc, CLOSE_GRACE_S):
                    w.proc.terminate()  # our own child, by its handle
                    if not await _exited(w.proc, CLOSE_GRACE_S):
                        w.proc.kill()
                        await _exited(w.proc, CLOSE_GRACE_S)
                w.proc.join(0)  # reaped: no zombie left
            w.alive = False
            if w.writer is not None:
                w.writer.close()
        for p in self._pending.values():
            if not p.future.done():
                p.future.set_exception(RolloutError("the sharded rollout client was closed"))
        self._pending.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def __aenter__(self) -> ShardedRollout:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation
    def _live(self) -> list[_Worker]:
        return [w for w in self.workers if w.alive and w.urls]

    def _route(self) -> _Worker:
        live = self._live()
        if not live:
            raise WorkerDied("no rollout worker is left: " + "; ".join(self.worker_failures))
        return min(live, key=lambda w: len(w.outstanding) / len(w.urls))

    def _send(self, rid: str, p: _Pending, w: _Worker) -> None:
        p.worker = w
        w.outstanding.add(rid)
        w.requests.add((rid, p.input_ids, p.sampling, p.priority))

    async def generate(self, input_ids, sampling, rid) -> Sample:
        if not self.workers:
            raise RolloutError("sharded rollout client not started: use 'async with' or await start()")
        if rid in self._pending:
            raise ValueError(f"rid {rid!r} is already being generated by this client")
        self.client_class._check_request(input_ids, sampling, rid)  # the caller's mistake raises here, not in a worker
        prompt = columns.tokens(input_ids, "input_ids")
        p = _Pending(prompt.tobytes(), prompt, dict(sampling), asyncio.get_running_loop().create_future(), None,
                     ADMISSION_ORDER.get() or 0)
        self._pending[rid] = p
        self.stats["requests"] += 1
        try:
            self._send(rid, p, self._route())
            return await p.future
        except asyncio.CancelledError:
            p = self._pending.get(rid)
            if p is not None and p.worker is not None and rid in p.worker.outstanding:
                p.worker.cancelled.add(rid)
                p.worker.requests.flush()  # the request itself may still wait in the batch
                p.worker.send(("cancel", rid))
            raise
        finally:
            q = self._pending.pop(rid, None)
            if q is not None and q.worker is not None:
                q.worker.outstanding.discard(rid)

    def _on_answers(self, w: _Worker, items: list) -> None:
        for item in items:
            rid = item[0]
            if rid in w.cancelled:  # the caller stopped waiting: the answer (or the worker's word) is dropped
                w.cancelled.discard(rid)
                continue
            p = self._pending.get(rid)
            if p is None or p.worker is not w or rid not in w.outstanding:
                self.stats["duplicates_dropped"] += 1
                continue
            w.outstanding.discard(rid)
            if p.future.done():  # its caller was cancelled a moment ago (before it could tell the worker)
                continue
            self.stats["answers"] += 1
            if len(item) == 2:
                p.future.set_exception(item[1] or RolloutError(f"{w.name} cancelled rid {rid!r} by itself"))
            else:
                p.future.set_result(answer_sample(rid, item, p.prompt))

    async def _lost(self, w: _Worker) -> None:
        """Worker ``w`` ended unasked: name it, drop its servers, send its requests to the others."""
        w.alive = False
        await _exited(w.proc, 5.0)
        msg = f"{w.name} died (exit code {w.proc.exitcode})"
        self.worker_failures.append(msg)
        self.stats["workers_lost"] += 1
        for u in w.urls:
            self._owner.pop(u, None)
        for fut in w.acks.values():
            if not fut.done():
                fut.set_result((None, None))  # a broadcast goes on with the others
        w.acks.clear()
        orphans = [r for r in w.outstanding if r in self._pending]
        w.outstanding.clear()
        if not self._live():
            log.error("%s; no rollout worker is left", msg)
            for r in orphans:
                self._pending[r].future.set_exception(WorkerDied(msg + "; no rollout worker is left"))
            return
        log.error("%s; its %d request(s) in flight are sent again to the other workers", msg, len(orphans))
        for r in orphans:
            self.stats["resent"] += 1
            self._send(r, self._pending[r], self._route())

    # ------------------------------------------------------------------ control
    async def _ask(self, w: _Worker, op: str, arg=None):
        """Control call ``op`` on worker ``w``: its result; its error is raised here."""
        self._seq += 1
        fut = asyncio.get_running_loop().create_future()
        w.acks[self._seq] = fut
        w.requests.flush()  # requests sent before the call reach the worker before it
        w.send(("ctl", self._seq, op, arg))
        ok, result = await fut
        if ok is False:
            raise result
        return result

    async def _broadcast(self, op: str, arg=None) -> list:
        """``op`` on every live worker; returns when all acknowledged (the first error raised after)."""
        live = [w for w in self.workers if w.alive]
        if not live:
            raise WorkerDied("no rollout worker is left: " + "; ".join(self.worker_failures))
        res = await asyncio.gather(*(self._ask(w, op, arg) for w in live), return_exceptions=True)
        errs = [r for r in res if isinstance(r, BaseException)]
        if errs:
            raise errs[0]
        return res

    async def pause(self, mode: str | None = None) -> None:
        """Pause every server (``mode`` None: the configured pause mode) and wait for every ack."""
        async def pause_all():
            got = [g for g in await self._broadcast("pause", mode) if g]  # a worker lost meanwhile gives None
            self.server_pause_modes = {u: m for modes, _ in got for u, m in modes.items()}
            self.pause_seconds_in_workers = [s for _, s in got]
            self.pause_mode = mode or self.client_kwargs.get("pause_mode", "auto")

        await self.control(pause_all, "pause_generation")

    async def resume(self) -> None:
        await self.control(lambda: self._broadcast("continue"), "continue_generation")
        self.pause_mode = None
        self.server_pause_modes = {}

    async def health(self, url: str):
        """``RolloutClient.health`` of ``url``, asked by the worker that owns it."""
        url = url.rstrip("/")
        w = self._owner.get(url)
        if w is None or not w.alive:
            raise RolloutError(f"{url} is not served by a live rollout worker")
        return await self._ask(w, "health", url)

    @property
    def urls(self) -> list[str]:
        return [u for w in self.workers if w.alive for u in w.urls]

    def remove_server(self, url: str) -> bool:
        """Drop ``url`` from the pool; the worker that owned it fails over to its other servers. A worker
        left with no server leaves the routing, and its requests in flight go to the others."""
        url = url.rstrip("/")
        w = self._owner.get(url)
        if w is None:
            return False
        if len(self.urls) == 1:
            raise RuntimeError(f"the last inference server {url} died; cannot continue")
        del self._owner[url]
        w.urls = [u for u in w.urls if u != url]
        if w.urls:
            w.send(("remove", url))
            return True
        log.warning("%s lost its last server %s; its requests go to the other workers", w.name, url)
        orphans = [r for r in w.outstanding if r in self._pending]
        w.outstanding.clear()
        for r in orphans:
            w.cancelled.add(r)
            w.send(("cancel", r))
            self.stats["resent"] += 1
            self._send(r, self._pending[r], self._route())
        return True

    async def add_server(self, url: str) -> None:
        """Route requests to ``url`` from now on, through the live worker with the fewest servers."""
        url = url.rstrip("/")
        if url in self._owner:
            return
        live = [w for w in self.workers if w.alive]
        if not live:
            raise WorkerDied("no rollout worker is left to take server " + url)
        w = min(live, key=lambda w: len(w.urls))
        await self._ask(w, "add", url)
        self._owner[url] = w
        w.urls.append(url)

    # ------------------------------------------------------------------ measures (benchmarks)
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc.pid is not None]

    def worker_cpu_seconds(self) -> float:
        """User + system CPU seconds of every worker process so far (from /proc; Linux)."""
        total = 0.0
        for pid in self.worker_pids():
            try:
                parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
        return total

    def worker_rss_mb(self, peak: bool = False) -> float:
        """Resident memory of every worker process together (``peak``: each one's high-water mark)."""
        key = "VmHWM:" if peak else "VmRSS:"
        total = 0.0
        for pid in self.worker_pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(key):
                        total += int(line.split()[1]) / 1024
            except (OSError, ValueError):
                pass
        return total

