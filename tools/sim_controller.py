"""Stand-ins for the parts of a run around the controller, for the controller-scale benchmark
(``bench/bench_controller_scale.py``, docs/scale.md): prompts, tokenizer and rewards of no cost, a
trainer that sleeps, a weight sync that only calls the simulated servers, a rollout port that checks
every answer exactly, and the probes of the controller's process (loop lag, GC time, memory)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from areal_fast.controller import Controller
from areal_fast.rollout.sharded import ShardedRollout
from areal_fast.sample import Sample
from tools import sim_sglang as sim

TICK_S = 0.01  # loop-lag ticker period: fine enough to see 10 ms stalls, ~100 wakeups/s of CPU
PROMPT_LEN = 64


@dataclass
class SimRow:
    index: int
    text: str
    task: dict


class SimPrompts:
    """An endless prompt stream: position p is row p."""

    def at(self, position: int) -> SimRow:
        return SimRow(position, str(position), {})


class SimTokenizer:
    """Prompt ids of a fixed length; decode returns "" (the reward is a stand-in, and the real
    tokenizer's cost is not the controller's)."""

    def __init__(self, prompt_len: int = PROMPT_LEN):
        self.prompt_len = prompt_len

    def encode(self, text: str) -> list[int]:
        p = int(text)
        return [2 + (p * 31 + i) % 997 for i in range(self.prompt_len)]

    def decode(self, ids) -> str:
        return ""


class _Reward:
    value = 1.0
    status = "ok"


class ConstReward:
    async def score(self, task, completion):
        return _Reward


class SleepTrainer:
    """TrainerPort that sleeps for a modelled step time: ``step_s(samples)`` wall seconds. With
    ``hold_first`` (a callable, polled from the trainer's thread) the first step starts only once it
    returns True: the buffer then fills as far as the gate allows (``--fill-buffer``)."""

    def __init__(self, step_s, hold_first=None, hold_limit_s: float = 3600.0):
        self.step_s = step_s
        self.steps: list[dict] = []
        self.hold_first, self.hold_limit_s = hold_first, hold_limit_s
        self.held_s = 0.0
        self.training_tokens = 0  # output tokens of the batch being trained (held by the trainer)

    def train(self, samples: list[Sample], version: int) -> dict:
        if self.hold_first is not None and not self.steps:
            t0 = time.perf_counter()
            while not self.hold_first():
                if time.perf_counter() - t0 > self.hold_limit_s:
                    raise RuntimeError(f"--fill-buffer: the gate still admitted after {self.hold_limit_s} s")
                time.sleep(0.05)
            self.held_s = time.perf_counter() - t0
        self.training_tokens = sum(len(x.output_ids) for x in samples)
        s = self.step_s(samples)
        time.sleep(s)
        self.steps.append({"samples": len(samples), "sleep_s": s})
        self.training_tokens = 0
        return {"modelled_s": s}

    def save(self, path: Path, version: int) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def check(self, path: Path) -> None:
        pass

    def load(self, path: Path) -> None:
        pass


class SimSync:
    """SyncPort: every simulated server takes ``weight_version`` (what a real update ends with);
    optionally sleeps for a modelled transfer time first."""

    def __init__(self, urls: list[str], api_key: str | None, delay_s=lambda version: 0.0, flush_cache: bool = True):
        self.urls, self.api_key, self.delay_s, self.flush_cache = urls, api_key, delay_s, flush_cache
        self.session: aiohttp.ClientSession | None = None
        self.version = 0

    async def sync(self, version: int) -> dict:
        if self.session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            # a new connection per call: between steps (often > the servers' 5 s keep-alive) a kept-alive
            # one may have been closed by its server, and aiohttp cannot tell before writing into it
            self.session = aiohttp.ClientSession(headers=headers,
                                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))
        d = self.delay_s(version)
        if d > 0:
            await asyncio.sleep(d)

        async def one(url):
            async with self.session.post(url + "/update_weights_from_disk",
                                         json={"model_path": "sim", "weight_version": str(version),
                                               "flush_cache": self.flush_cache}) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}/update_weights_from_disk answered {r.status}: {await r.text()}")

        await asyncio.gather(*(one(u) for u in self.urls))
        self.version = version
        return {"modelled_s": d}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class CheckedRollout:
    """A production rollout port (``ClientRollout``, or ``ShardedRollout`` with --client-procs > 1),
    plus: exact checks of every sample, exactly-once accounting, and pause / continue timings.
    ``pause_mode`` None keeps the production call (``pause()``)."""

    def __init__(self, port, cfg: sim.SimConfig, max_new: int, sync: SimSync, pause_mode: str | None = None):
        self.port = port
        self.cfg, self.max_new, self.sync_port, self.pause_mode = cfg, max_new, sync, pause_mode
        self.returned: dict[str, int] = {}
        self.errors: list[str] = []
        self.check_cpu_s = 0.0
        self.trained_tokens = 0
        self.returned_tokens = 0  # output tokens of every sample returned to the controller
        self.pauses: list[dict] = []
        self._t_pause = 0.0

    async def generate(self, input_ids, sampling, rid) -> Sample:
        g = await self.port.generate(input_ids, sampling, rid)
        c0 = time.process_time()
        self.returned[rid] = self.returned.get(rid, 0) + 1
        self.returned_tokens += len(g.output_ids)
        if self.returned[rid] > 1:
            self.errors.append(f"{rid}: returned {self.returned[rid]} times")
        if len(self.errors) < 20:
            self.errors += sim.check_sample(rid, len(input_ids), sampling.get("max_new_tokens", 128), g.output_ids,
                                            g.output_logprobs, g.output_versions, g.finish_reason, self.cfg,
                                            self.sync_port.version + 1)
        self.check_cpu_s += time.process_time() - c0
        return g

    async def pause(self) -> None:
        self._t_pause = time.perf_counter()
        sharded = isinstance(self.port, ShardedRollout)
        if self.pause_mode is None:
            await self.port.pause()
        elif sharded:
            await self.port.pause(self.pause_mode)
        else:
            await self.port.control(lambda: self.port.client.pause_all(self.pause_mode), "pause_generation")
        mode = self.port.pause_mode if sharded else self.port.client.pause_mode
        self.pauses.append({"ack_s": time.perf_counter() - self._t_pause, "mode": str(mode),
                            "in_workers_s": max(self.port.pause_seconds_in_workers, default=0.0) if sharded else None})

    async def resume(self) -> None:
        await self.port.resume()
        self.pauses[-1]["continue_s"] = time.perf_counter() - self._t_pause


class LoopLag:
    """Records how late a task sleeping ``period`` wakes up (the event loop's responsiveness)."""

    def __init__(self, period: float = TICK_S, other_rss_mb=None, on_peak=None):
        self.period, self.lags = period, []
        self.on_peak = on_peak  # called at each new peak of this process's RSS (what it holds then)
        self.rss0 = self.peak_rss = current_rss_mb()  # sampled every 10th tick
        self.other_rss_mb = other_rss_mb  # RSS of the rollout worker processes together (sharded client)
        self.peak_other_rss = self.peak_total_rss = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period)
            self.lags.append(loop.time() - t - self.period)
            if len(self.lags) % 10 == 0:
                own = current_rss_mb()
                other = self.other_rss_mb() if self.other_rss_mb else 0.0
                if own > self.peak_rss and self.on_peak is not None:
                    self.on_peak()
                self.peak_rss = max(self.peak_rss, own)
                self.peak_other_rss = max(self.peak_other_rss, other)
                self.peak_total_rss = max(self.peak_total_rss, own + other)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def summary(self) -> dict:
        xs = sorted(self.lags) or [0.0]
        return {"lag_p50_ms": 1e3 * xs[len(xs) // 2], "lag_p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
                "lag_max_ms": 1e3 * xs[-1]}


class GcClock:
    """CPU time spent inside the garbage collector (gc.callbacks; process CPU, so a collection that
    waits for a busy core is not counted as its own cost)."""

    def __init__(self):
        self.total_s, self.collections, self._t = 0.0, 0, 0.0

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._t = time.process_time()
        else:
            self.total_s += time.process_time() - self._t
            self.collections += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


async def sim_stats(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(headers=headers) as s, s.get(url + "/sim_stats") as r:
        return await r.json()


async def sim_stats_all(urls: list[str], api_key: str | None) -> dict:
    """The counters of several simulator processes (one url of each) together: sums, the worst loop
    lag, every version seen. A rid completed on two processes is not counted as a duplicate here
    (the benchmark's own exactly-once check, per returned sample, covers it)."""
    parts = await asyncio.gather(*(sim_stats(u, api_key) for u in urls))
    out = dict(parts[0])
    for p in parts[1:]:
        for k, v in p.items():
            if k == "versions":
                out[k] = sorted(set(out[k]) | set(v))
            elif k == "loop_lag_max_s":
                out[k] = max(out[k], v)
            else:
                out[k] += v
    return out


class MemoryProbe:
    """What the controller process holds at the moment of its peak RSS (called by :class:`LoopLag`
    at each new peak): finished groups in the buffer (in memory, and spilled to its file), the batch
    being trained, the finished samples of groups still generating, the requests in flight. Its own
    CPU is measured (and subtracted like the checks')."""

    def __init__(self, ctrl: Controller, rollout: CheckedRollout, trainer: SleepTrainer, gate, group_size: int):
        self.ctrl, self.rollout, self.trainer, self.gate, self.group_size = ctrl, rollout, trainer, gate, group_size
        self.appended_tokens = 0
        self.cpu_s = 0.0
        self.at_peak: dict = {}
        append = ctrl.buffer.append

        def counting_append(g) -> None:  # tokens of every group that reached the buffer
            self.appended_tokens += sum(len(s.output_ids) for s in g.samples)
            append(g)

        ctrl.buffer.append = counting_append

    def __call__(self) -> None:
        c0 = time.process_time()
        groups = samples = tokens = spilled = spilled_bytes = 0
        for g in self.ctrl.buffer.snapshot():
            if hasattr(g, "samples"):
                groups += 1
                samples += len(g.samples)
                tokens += sum(len(s.output_ids) for s in g.samples)
            else:
                spilled += 1
                spilled_bytes += g.length
        training = self.trainer.training_tokens
        self.at_peak = {"rss_mb": current_rss_mb(), "buffer_groups": groups, "buffer_samples": samples,
                        "buffer_tokens": tokens, "buffer_spilled_groups": spilled,
                        "buffer_spilled_mb": spilled_bytes / 2**20, "training_tokens": training,
                        "in_flight_finished_tokens": self.rollout.returned_tokens - self.appended_tokens,
                        "in_flight_requests": self.gate.running * self.group_size,
                        "parked_mb": self.ctrl.buffer.parked / 2**20,
                        "parked_spilled_parts": self.ctrl.buffer.parked_spilled,
                        "http_buffered_mb": self._http_buffered() / 2**20,
                        "tasks": len(asyncio.all_tasks())} | malloc_split_mb()
        self.cpu_s += time.process_time() - c0

    def _http_buffered(self) -> int:
        """Bytes of answers being received (the connections' buffers; in-process client only)."""
        client = getattr(getattr(self.rollout, "port", None), "client", None)
        return sum(len(c._buf) for s in getattr(client, "servers", ()) if s.pool is not None for c in s.pool._open)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_split_mb() -> dict:
    """glibc's view of the C heap (``mallinfo2``, glibc >= 2.33; empty elsewhere): ``malloc_in_use_mb``
    is what is allocated now (heap chunks in use + mmapped chunks), ``malloc_free_held_mb`` what was
    freed but is still held by the allocator (fragmentation: counted in RSS where its pages were touched)."""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    f.restype = _Mallinfo2
    m = f()
    return {"malloc_in_use_mb": (m.uordblks + m.hblkhd) / 2**20, "malloc_free_held_mb": m.fordblks / 2**20,
            "malloc_mmapped_mb": m.hblkhd / 2**20}


def peak_rss_mb() -> float:
    """The process's peak RSS since it started (imports included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20
    except (OSError, IndexError, ValueError):
        return float("nan")
