"""The chaos benchmark's pure parts (``bench/bench_chaos.py``, ``docs/chaos.md``): the fault schedule,
the sample accounting of a finished run (every prompt position below the final one trained once,
buffered or pending; see :func:`account`), the per-fault recovery figures, and the stalling TCP
proxy. Nothing here starts a run; ``tests/bench/test_bench_chaos.py`` checks each part.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

# ----------------------------------------------------------------------------- the schedule

FAULTS = {
    # kind: (phase, number of arguments, what it does)
    "server_kill": ("main", 0, "SIGKILL one launched server (the launcher relaunches it)"),
    "server_stop": ("main", 1, "SIGSTOP one server; SIGCONT after ARG seconds ('never': left stopped)"),
    "reward_kill": ("main", 0, "SIGKILL one reward worker process"),
    "reward_hang": ("main", 1, "for ARG seconds, the reward sleeps forever on about 1 row in 3"),
    "controller_kill": ("main", 0, "SIGKILL the run (launcher, trainer and controller), then resume it"),
    "proxy_slow": ("proxy", 2, "for ARG1 seconds, the proxy holds every chunk ARG2 seconds each way"),
}


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule: ``kind`` injected when the run first reaches train step ``step``."""

    step: int
    kind: str
    args: tuple[str, ...] = ()

    @property
    def phase(self) -> str:
        return FAULTS[self.kind][0]

    @property
    def duration_s(self) -> float | None:
        """Seconds the fault lasts (server_stop, reward_hang, proxy_slow); None: never lifted / instant."""
        if self.kind in ("server_stop", "reward_hang", "proxy_slow"):
            return None if self.args[0] == "never" else float(self.args[0])
        return None

    @property
    def delay_s(self) -> float:
        return float(self.args[1]) if self.kind == "proxy_slow" else 0.0

    def label(self) -> str:
        return ":".join([str(self.step), self.kind, *self.args])


def parse_schedule(text: str) -> list[Fault]:
    """``STEP:KIND[:ARG...]`` items separated by commas (or spaces), sorted by step. ValueError names
    the item at fault: an unknown kind, a step that is not an integer >= 1, a wrong argument count, a
    duration or delay that is not a number > 0 ('never' is allowed for server_stop only)."""
    out = []
    for item in text.replace(",", " ").split():
        parts = item.split(":")
        if len(parts) < 2:
            raise ValueError(f"schedule item {item!r}: expected STEP:KIND[:ARG...]")
        step_s, kind, args = parts[0], parts[1], tuple(parts[2:])
        if kind not in FAULTS:
            raise ValueError(f"schedule item {item!r}: unknown fault {kind!r} (one of {', '.join(FAULTS)})")
        try:
            step = int(step_s)
        except ValueError:
            step = 0
        if step < 1:
            raise ValueError(f"schedule item {item!r}: the step must be an integer >= 1, got {step_s!r}")
        if len(args) != FAULTS[kind][1]:
            raise ValueError(f"schedule item {item!r}: {kind} takes {FAULTS[kind][1]} argument(s), got {len(args)}")
        for i, a in enumerate(args):
            if kind == "server_stop" and a == "never":
                continue
            try:
                ok = float(a) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"schedule item {item!r}: argument {i + 1} must be a number > 0, got {a!r}")
        out.append(Fault(step, kind, args))
    return sorted(out, key=lambda f: f.step)


# ----------------------------------------------------------------------------- accounting


@dataclass
class Accounting:
    """What happened to every prompt position the data loader handed out."""

    issued: int
    trained: int
    buffered: int
    pending: int
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)  # trained or held, but never handed out
    short_groups: list[int] = field(default_factory=list)  # trained with fewer samples than the group size
    steps_missing: list[int] = field(default_factory=list)
    steps_repeated: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unknown or self.short_groups or self.steps_missing
                    or self.steps_repeated)

    def to_dict(self) -> dict:
        return {**asdict(self), "lost_n": len(self.lost), "duplicated_n": len(self.duplicated), "ok": self.ok}


def account(train_events: list[dict], final_state: dict, buffered: list[int],
            samples_per_group: dict[int, int] | None = None, group_size: int | None = None) -> Accounting:
    """Check every position below ``final_state['position']`` was trained exactly once, or is held
    (buffered, pending) at the end; the steps of the lineage are 1..N each once; each trained group had
    ``group_size`` samples (when ``samples_per_group`` from samples.jsonl is given).

    ``train_events``: the ``kind == "train"`` rows of the final ``metrics.jsonl``; ``final_state``:
    the last checkpoint's controller.json; ``buffered``: its buffered groups' positions."""
    steps = Counter(int(e["step"]) for e in train_events)
    n_steps = max(steps, default=0)
    trained = Counter(int(p) for e in train_events for p in e["positions"])
    pending = [int(p) for p in final_state.get("pending", [])]
    held = Counter(buffered) + Counter(pending)
    issued = int(final_state["position"])
    seen = trained + held
    acc = Accounting(issued=issued, trained=sum(trained.values()), buffered=len(buffered), pending=len(pending))
    acc.duplicated = sorted(p for p, n in seen.items() if n > 1)
    acc.lost = [p for p in range(issued) if p not in seen]
    acc.unknown = sorted(p for p in seen if p >= issued or p < 0)
    acc.steps_missing = [s for s in range(1, n_steps + 1) if s not in steps]
    acc.steps_repeated = sorted(s for s, n in steps.items() if n > 1)
    if samples_per_group is not None and group_size is not None:
        acc.short_groups = sorted(p for p in trained if samples_per_group.get(p, 0) < group_size)
    return acc


# ----------------------------------------------------------------------------- recovery figures

BASELINE_WINDOW_S = 30.0  # the throughput before a fault: the steps seen in this window before it
NORMAL_FACTOR = 2.0  # a step interval within this factor of the baseline median is "normal pace"
NORMAL_RUN = 3  # steps in a row at normal pace end the recovery


@dataclass
class Arrival:
    """A train step as the bench saw it appear in metrics.jsonl (``t``: bench clock, seconds)."""

    t: float
    step: int
    samples: int
    tokens: int
    incarnation: int = 0


def _rate(arrivals: list[Arrival], t0: float, t1: float) -> dict:
    inside = [a for a in arrivals if t0 <= a.t < t1]
    span = max(t1 - t0, 1e-9)
    return {"steps": len(inside), "samples_per_s": sum(a.samples for a in inside) / span,
            "tokens_per_s": sum(a.tokens for a in inside) / span}


def pool_back_at(pool: list[tuple[float, int]], t0: float, size: int) -> float | None:
    """The first time at or after ``t0`` when the pool (bench-clock samples of its size) held ``size``
    servers again after having fewer, or None. A pool that never dropped is back at ``t0``."""
    after = [(t, n) for t, n in pool if t >= t0]
    dropped = False
    for t, n in after:
        if n < size:
            dropped = True
        elif dropped:
            return t
    return None if dropped else t0


def fault_figures(arrivals: list[Arrival], t0: float, *, pool: list[tuple[float, int]] | None = None,
                  pool_size: int | None = None, progress_step: int | None = None,
                  end_t: float | None = None) -> dict:
    """Recovery of one fault injected at bench time ``t0``, from the steps seen before and after it.

    - baseline: samples/s and tokens/s over the ``BASELINE_WINDOW_S`` before ``t0``, and the median
      step interval there;
    - recovered at: the first step after which ``NORMAL_RUN`` intervals in a row are within
      ``NORMAL_FACTOR`` x the baseline median, counted only once the pool is back to ``pool_size``
      (server faults) and the run is past ``progress_step`` (a resume: the last step trained before
      the kill); None when that never happened before ``end_t``;
    - steps delayed: the steps the baseline pace would have made from ``t0`` to recovery, minus the
      new steps made (the steps a resume trained again are not new);
    - dip: samples/s from ``t0`` to recovery (at least 10 s) over the baseline's."""
    arrivals = sorted(arrivals, key=lambda a: a.t)
    before = [a for a in arrivals if t0 - BASELINE_WINDOW_S <= a.t < t0]
    start = before[0].t if before else t0 - BASELINE_WINDOW_S
    base = _rate(arrivals, start, t0)
    gaps = [b.t - a.t for a, b in zip(before, before[1:])]
    median_gap = statistics.median(gaps) if gaps else None
    step_at_t0 = max((a.step for a in arrivals if a.t < t0), default=0)
    gate_t = t0
    if pool is not None and pool_size is not None:
        back = pool_back_at(pool, t0, pool_size)
        gate_t = back if back is not None else float("inf")
    after = [a for a in arrivals if a.t >= t0]
    recovered = None
    if median_gap is not None:
        limit = NORMAL_FACTOR * median_gap
        for i, a in enumerate(after):
            if a.t < gate_t or (progress_step is not None and a.step <= progress_step):
                continue
            nxt = after[i:i + NORMAL_RUN + 1]
            if len(nxt) == NORMAL_RUN + 1 and all(y.t - x.t <= limit for x, y in zip(nxt, nxt[1:])):
                recovered = a.t
                break
    out = {"baseline_samples_per_s": base["samples_per_s"], "baseline_tokens_per_s": base["tokens_per_s"],
           "baseline_step_s": median_gap, "recovery_s": None if recovered is None else recovered - t0,
           "pool_back_s": None if gate_t in (t0, float("inf")) or pool is None else gate_t - t0}
    stop = recovered if recovered is not None else (end_t if end_t is not None else (after[-1].t if after else t0))
    window_end = max(stop, t0 + 10.0)
    win = _rate(arrivals, t0, window_end)
    out["window_s"] = window_end - t0
    out["window_samples_per_s"] = win["samples_per_s"]
    out["dip"] = (1.0 - win["samples_per_s"] / base["samples_per_s"]) if base["samples_per_s"] > 0 else None
    if median_gap:
        made = max((a.step for a in arrivals if t0 <= a.t <= stop), default=step_at_t0) - step_at_t0
        out["steps_delayed"] = max(0, round((stop - t0) / median_gap) - max(made, 0))
    else:
        out["steps_delayed"] = None
    return out


# ----------------------------------------------------------------------------- the stalling proxy


class StallingProxy:
    """A TCP proxy in front of one server that holds every chunk ``delay_s`` seconds before passing it
    on, both ways (``delay_s`` may change at any time, from any thread; lowering it releases held
    bytes). Runs its own event loop in a daemon thread: ``start()`` returns the port it listens on."""

    POLL_S = 0.05  # how often a held chunk looks at a lowered delay

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1"):
        self.upstream, self.host = upstream, host
        self.delay_s = 0.0
        self.port: int | None = None
        self.chunks = 0  # chunks forwarded (both ways)
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalling-proxy", daemon=True)

    def start(self) -> int:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the stalling proxy did not start within 10 s")
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection, then end the loop's thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, self.host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader, writer) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer), return_exceptions=True)

    async def _pump(self, reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                arrived = time.monotonic()
                while (left := arrived + self.delay_s - time.monotonic()) > 0:
                    await asyncio.sleep(min(left, self.POLL_S))
                self.chunks += 1  # counted first: the peer may read the bytes before write() returns
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
