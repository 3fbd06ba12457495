"""Asynchronous reward service: rewards run in a pool of worker processes, never in the caller's.

    controller (asyncio)                         worker processes (forked from a forkserver
    ---------------------                        that preloaded sympy/math-verify)
    await service.score(task, completion)
      |  wait for an idle worker  (bounded: one call per worker, the rest queue)
      |  conn.send((id, reward, task, completion)) ---->  fn = get_reward_fn(reward)
      |  await reply (loop.add_reader on the pipe) <----  fn(task, completion) -> RewardResult
      |  ...or per-call timeout: SIGKILL the worker, start a fresh one, result (0, timeout)
      |  ...or the worker died (OOM, SIGKILL, os._exit, segfault): fresh one, and the same call
      |     once more on it; a second death gives (0, error)
      v
    RewardResult(value, status ok|timeout|error, detail, elapsed)

A call that timed out is not retried: it would most likely time out again and hold a worker
for another full timeout. A worker that died mid-call is different: the cause is often outside
the call (the OOM killer picked the worker, an operator killed it), so the call is retried once
on a fresh worker; ``stats()["retries"]`` counts these, ``retried_ok`` those that then succeeded.

Every timeout and error is counted (`stats()`) and logged as a warning with the running counts,
at most once per ``warn_interval_s`` (and at close), so a reward that silently returns 0 for a
whole run cannot happen. Code rewards launch sandboxed subprocesses from the workers; when a
worker is killed, its sandboxes die with it (PR_SET_PDEATHSIG chain, see sandbox.py).

We manage the worker processes ourselves instead of using ProcessPoolExecutor because a hung
call must be stopped by killing exactly the worker running it, which the executor cannot do
(it can only mark the whole pool broken). Overhead per call is ~0.1-0.3 ms (see
bench/bench_reward.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from .registry import get_reward_fn
from .result import RewardResult, coerce_result, escape_controls
from .sandbox import cleanup_after

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # a cold forkserver imports torch-free sympy + math-verify: ~2-5 s here
_PRELOAD = ["areal_fast.reward._preload"]


class _WorkerDied(Exception):
    pass


def _worker_main(conn, sys_path: list[str]) -> None:
    """Loop of one worker process: receive a call, run the reward, send the result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, name, task, completion = msg
        try:
            res = coerce_result(get_reward_fn(name)(task, completion), name)
        except BaseException as e:  # SystemExit from user code too: the worker must survive it
            res = RewardResult(0.0, "error", f"reward {name!r} raised {type(e).__name__}: {e}")
        try:
            conn.send((call_id, res))
        except Exception as e:  # e.g. an unpicklable detail
            conn.send((call_id, RewardResult(0.0, "error", f"cannot send result: {e!r}")))


@dataclass(eq=False)
class _Worker:
    proc: multiprocessing.process.BaseProcess | None = None
    conn: object = None
    future: asyncio.Future | None = None
    call_id: int = -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()


class RewardService:
    """Scores (task, completion) pairs in worker processes; see the module docstring.

    Args:
        num_workers: worker processes (default: the CPUs this process may use). It also bounds
            concurrency: at most this many calls run at once, the rest wait in FIFO order.
        timeout_s: per-call limit (queueing excluded). A task may override it with "timeout_s".
        default_reward: reward name used when a task has no "reward" key.
        warn_interval_s: at most one warning with the timeout/error counts per interval.
        mp_context: multiprocessing start method ("forkserver" keeps workers warm and never
            forks the caller, which may hold threads, CUDA or a big heap).

    The service belongs to the event loop of its first call. As with any multiprocessing
    start method but fork, the caller's ``__main__`` is imported in each worker, so scripts
    need the usual ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, *, num_workers: int | None = None, timeout_s: float = 20.0,
                 default_reward: str | None = None, warn_interval_s: float = 30.0,
                 mp_context: str = "forkserver"):
        if num_workers is None:
            num_workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if num_workers < 1:
            raise ValueError(f"RewardService: num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardService: timeout_s must be > 0, got {timeout_s}")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.default_reward = default_reward
        self.warn_interval_s = float(warn_interval_s)
        self._ctx = multiprocessing.get_context(mp_context)
        if mp_context == "forkserver":
            self._ctx.set_forkserver_preload(_PRELOAD)
        self._workers = [_Worker() for _ in range(self.num_workers)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._closed = False
        self._ids = itertools.count()
        self._waiting = 0
        self._counts: dict[str, int] = defaultdict(int)
        self._by_reward: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._unreported = {"timeout": 0, "error": 0}
        self._last_warn = -float("inf")
        self._last_bad: tuple[str, str, str] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> RewardService:
        """Start the workers (optional: the first `score` does it). Idempotent."""
        if self._closed:
            raise RuntimeError("RewardService is closed")
        if self._started:
            return self
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._idle = asyncio.Queue()
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._started:
                await asyncio.gather(*(self._spawn(w) for w in self._workers), return_exceptions=True)
                for w in self._workers:
                    self._idle.put_nowait(w)
                self._started = True
        return self

    async def __aenter__(self) -> RewardService:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers; calls in flight end with (0, error). Logs unreported failures."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            self._stop(w, graceful=True)
        self._warn(force=True)

    # ------------------------------------------------------------------ scoring
    async def score(self, task: dict, completion: str, *, timeout_s: float | None = None) -> RewardResult:
        """Reward of ``completion`` for ``task``; never raises for reward failures (status says)."""
        if not isinstance(task, dict):
            raise TypeError(f"RewardService.score: task must be a dict, got {type(task).__name__}")
        name = task.get("reward", self.default_reward)
        if not isinstance(name, str):
            raise ValueError(f"RewardService.score: task has no 'reward' name and no default_reward (task keys: "
                             f"{sorted(task)})")
        timeout = float(timeout_s or task.get("timeout_s") or self.timeout_s)
        await self.start()
        self._waiting += 1
        try:
            worker = await self._idle.get()
        finally:
            self._waiting -= 1
        try:
            res, died = await self._call(worker, name, task, completion, timeout)
            if died and not self._closed:  # retry once, on the fresh worker that replaced it
                self._counts["retries"] += 1
                first = res
                res, died = await self._call(worker, name, task, completion, timeout)
                if res.status == "ok":
                    self._counts["retried_ok"] += 1
                else:
                    res.detail = f"{first.detail}; retried on a fresh worker: {res.detail}"
        finally:
            self._idle.put_nowait(worker)
        self._record(name, res)
        return res

    async def _call(self, w: _Worker, name: str, task: dict, completion: str,
                    timeout: float) -> tuple[RewardResult, bool]:
        """One attempt on worker ``w``: (result, whether the worker died running it)."""
        if self._closed:
            return RewardResult(0.0, "error", "reward service is closed"), False
        if not w.alive():
            if w.proc is not None:
                self._counts["worker_deaths"] += 1
            self._stop(w)
            try:
                await self._spawn(w)
            except Exception as e:
                return RewardResult(0.0, "error", f"cannot start a reward worker: {e!r}"), False
        w.call_id = next(self._ids)
        w.future = self._loop.create_future()
        start = time.perf_counter()
        try:
            w.conn.send((w.call_id, name, task, completion))
        except Exception as e:  # unpicklable task, or the pipe broke
            w.future = None
            if isinstance(e, OSError):  # the worker died before it got the call
                self._counts["worker_deaths"] += 1
                await self._restart(w)
                return RewardResult(0.0, "error", f"cannot send the call to a worker: {e!r}"), True
            return RewardResult(0.0, "error", f"cannot send the call to a worker: {e!r}"), False
        try:
            res = await asyncio.wait_for(asyncio.shield(w.future), timeout)
        except asyncio.TimeoutError:
            await self._restart(w)
            return RewardResult(0.0, "timeout", f"reward {name!r} exceeded {timeout:g} s (worker killed)",
                                time.perf_counter() - start), False
        except _WorkerDied as e:
            self._counts["worker_deaths"] += 1
            await self._restart(w)
            return RewardResult(0.0, "error", f"reward {name!r}: {e}", time.perf_counter() - start), True
        except asyncio.CancelledError:
            # the caller gave up; the worker is still busy with this call: replace it
            await asyncio.shield(self._restart(w))
            raise
        finally:
            w.future = None
        res.elapsed = time.perf_counter() - start
        return res, False

    def _on_readable(self, w: _Worker) -> None:
        try:
            call_id, res = w.conn.recv()
        except Exception as e:  # EOF: the worker died; anything else: the pipe is unusable
            self._loop.remove_reader(w.conn.fileno())
            if w.future is not None and not w.future.done():
                w.proc.join(0.5)
                w.future.set_exception(_WorkerDied(f"worker {w.proc.pid} died (exit code {w.proc.exitcode}, "
                                                   f"{type(e).__name__})"))
            return
        if w.future is not None and not w.future.done() and call_id == w.call_id:
            w.future.set_result(res)

    # ------------------------------------------------------------------ workers
    async def _spawn(self, w: _Worker) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, list(sys.path)), daemon=True,
                                 name="areal-reward-worker")
        await asyncio.to_thread(proc.start)
        child.close()
        try:
            ready = await asyncio.to_thread(parent.poll, _STARTUP_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:g} s")
            parent.recv()
        except BaseException:
            proc.kill()
            parent.close()
            raise
        w.proc, w.conn = proc, parent
        self._loop.add_reader(parent.fileno(), self._on_readable, w)
        self._counts["workers_started"] += 1

    async def _restart(self, w: _Worker) -> None:
        self._stop(w)
        self._counts["worker_restarts"] += 1
        if self._closed:
            return
        try:
            await self._spawn(w)
        except Exception as e:  # the next call on this slot retries
            log.warning("reward service: could not restart a worker (%r); will retry on next call", e)

    def _stop(self, w: _Worker, graceful: bool = False) -> None:
        if w.conn is not None:
            try:
                self._loop.remove_reader(w.conn.fileno())
            except (OSError, ValueError):
                pass
            if graceful and w.future is None:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        if w.proc is not None:
            if graceful:
                w.proc.join(0.2)
            if w.proc.is_alive():
                w.proc.kill()  # SIGKILL; its sandboxes follow through PR_SET_PDEATHSIG
            w.proc.join(5)
            if w.proc.exitcode != 0:  # killed or died mid-call: remove its sandbox run dirs
                cleanup_after(w.proc.pid)
        if w.conn is not None:
            w.conn.close()
        if w.future is not None and not w.future.done():
            w.future.set_exception(_WorkerDied("reward service closed the worker"))
            w.future.exception()  # mark retrieved: after a timeout nobody awaits it any more
        w.proc, w.conn = None, None

    # ------------------------------------------------------------------ accounting
    def _record(self, name: str, res: RewardResult) -> None:
        self._counts["calls"] += 1
        self._counts[res.status] += 1
        r = self._by_reward[name]
        r["calls"] += 1
        r[res.status] += 1
        r["elapsed_s"] += res.elapsed
        if res.status != "ok":
            self._unreported[res.status] += 1
            # the detail holds what a reward function or the program it ran wrote: shown, never obeyed
            self._last_bad = (escape_controls(name), res.status, escape_controls(res.detail[:300]))
            self._warn()

    def _warn(self, force: bool = False) -> None:
        if not any(self._unreported.values()):
            return
        now = time.monotonic()
        if not force and now - self._last_warn < self.warn_interval_s:
            return
        self._last_warn = now
        c = self._counts
        log.warning("reward service: %d timeouts and %d errors scored 0 since the last report (totals: %d calls, "
                    "%d timeouts, %d errors, %d worker restarts); last: %s -> %s: %s",
                    self._unreported["timeout"], self._unreported["error"], c["calls"], c["timeout"], c["error"],
                    c["worker_restarts"], *self._last_bad)
        self._unreported = {"timeout": 0, "error": 0}

    def stats(self) -> dict:
        """Counters: calls, ok, timeout, error, worker_restarts, worker_deaths, retries (calls
        retried after their worker died), retried_ok (of those, the ones that then succeeded),
        workers_started, workers (alive), queued, and per reward name: calls, ok, timeout, error,
        elapsed_s."""
        out = {k: self._counts.get(k, 0) for k in ("calls", "ok", "timeout", "error", "worker_restarts",
                                                    "worker_deaths", "retries", "retried_ok", "workers_started")}
        out["workers"] = sum(w.alive() for w in self._workers)
        out["queued"] = self._waiting
        out["by_reward"] = {k: dict(v) for k, v in self._by_reward.items()}
        return out
