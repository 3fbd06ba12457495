"""The policy that sets the number of inference servers of a run (``rollout.autoscale``,
``docs/autoscale.md``): one decision per trainer step, from what the loop measured.

The one implementation: the run's autoscaler (``areal_fast.elastic.autoscale``) feeds it each step's
record, and the simulator of the loop at the paper's scale (``bench/bench_autoscale.py``) feeds it its
simulated steps; both call :meth:`AutoscalePolicy.step` with a :class:`Reading` and act on the
:class:`Decision` (the run writes the launcher's target, ``servers/target.json``; the simulator starts
or stops a simulated server). Nothing here does I/O.

What it reads, over the steps since the last change took effect (the *window*):

- the trainer's idle fraction: time waiting for a batch / (waiting + training + weight sync);
- the buffer: finished groups waiting when the trainer asked for its batch, in batches;
- staleness: the mean staleness of the trained groups, as a fraction of eta;
- tokens trained per step and generated tokens per second (the servers' rate per server);
- the generation length (mean tokens of a trained sample).

What it does:

- **up** when the trainer waits (idle above ``idle_high``): to the count whose generation rate,
  at the rate per server the window measured (generation was the bottleneck, so the rate is the
  servers' own), covers what the trainer consumes with ``headroom`` to spare; with
  ``shared_gpus`` (the simulator's trainer takes the GPUs the servers leave) the consumption at
  each candidate count follows the trainer's GPUs;
- **down** when the trainer does not wait (idle below ``idle_low``) while the buffer holds
  ``buffer_high`` batches or more and the trained groups' staleness is ``stale_high`` x eta or more
  (generation runs ahead and its groups go stale): by ``down_fraction`` of the servers (one at
  least), never below the count that the last measured rate per server says is needed
  (x ``keep``), while that rate is current (measured at a generation length within 25 % of now);
  none while answers have grown past that length since (the need grew, it did not shrink).
  With ``shared_gpus`` ``headroom`` and ``keep`` are 1: a spare server is a GPU the trainer lacks;
- **never flaps**: a change waits until the pool holds its target (servers started and joined,
  removed ones gone) and then ``settle_steps`` full steps measured after it; a load that swings
  faster than that averages out inside the window. The dead band between ``idle_low`` and
  ``idle_high``, and ``keep`` below ``headroom``, keep a change from undoing the last one;
- **gives up on a start**: servers added but still not in the pool after ``start_timeout_s`` seconds of
  trainer steps (a slot that cannot start: no GPU, a broken node) are taken back (the target drops to
  the pool), and no increase follows for as long again;
- **bounds**: ``min_servers`` .. ``max_servers`` of the config, narrowed by a person's bound
  (``areal-fast scale RUN N`` pins both to N; :meth:`AutoscalePolicy.set_hand_bound`). A target outside
  the bounds moves inside at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# a rate per server measured at a generation length within this factor of now is still used to size a
# removal (longer answers mean fewer tokens per second per server: KV room, attention)
RATE_LENGTH_TOLERANCE = 0.25


@dataclass(frozen=True)
class Reading:
    """What one trainer step measured (the controller's step record; the simulator's step)."""

    step: int
    servers: int
    """Servers in the pool now (taking requests)."""
    changing: bool
    """Servers starting, joining or leaving: the pool is not at the launcher's target yet."""
    wait_s: float
    """Trainer seconds waiting for the batch."""
    train_s: float
    sync_s: float
    """Pause, weight sync and resume of the step."""
    tokens: int
    """Tokens the step trained (prompt and answer: what the trainer consumed)."""
    buffer_groups: int
    """Finished groups waiting when the trainer asked for its batch."""
    batch_groups: int
    eta: int
    staleness_mean: float
    gen_len_mean: float
    """Mean answer tokens of a trained sample."""
    gen_tokens_per_s: float = 0.0
    """Tokens the servers generated per second since the last step (0: not measured)."""

    @classmethod
    def from_record(cls, m: dict, *, servers: int, changing: bool, batch_groups: int, eta: int) -> Reading:
        """A reading from a controller train record ``m`` (the simulator's steps use the same keys)."""
        return cls(step=int(m["step"]), servers=servers, changing=changing, wait_s=float(m["wait_s"]),
                   train_s=float(m["train_s"]), sync_s=float(m["sync_s"]), tokens=int(m["tokens"]),
                   buffer_groups=int(m.get("buffer_at_ask", m.get("buffer", 0))), batch_groups=batch_groups,
                   eta=eta, staleness_mean=float(m["staleness_mean"]), gen_len_mean=float(m["gen_len_mean"]),
                   gen_tokens_per_s=float(m.get("gen_tokens_per_s", 0.0)))

    @property
    def seconds(self) -> float:
        """The step's wall time: waiting, training and the weight sync."""
        return self.wait_s + self.train_s + self.sync_s


@dataclass(frozen=True)
class Decision:
    """What :meth:`AutoscalePolicy.step` decided; ``change`` 0 is a hold, with its reason."""

    step: int
    servers: int
    target: int
    change: int
    reason: str
    idle: float | None = None
    buffer_batches: float | None = None
    staleness_fraction: float | None = None
    gen_tokens_per_s_per_server: float | None = None
    gen_len_mean: float | None = None
    window_steps: int = 0
    lo: int = 0
    hi: int = 0

    def record(self) -> dict:
        """The decision as a metrics record (``kind: autoscale``): every sink, the Prometheus endpoint."""
        d = asdict(self)
        out = {"kind": "autoscale", "step": d.pop("step"), "reason": d.pop("reason")}
        out.update({f"autoscale/{k}": v for k, v in d.items() if v is not None})
        return out


class AutoscalePolicy:
    """See the module docstring. ``cfg``: a :class:`~areal_fast.rollout.config.AutoscaleConfig` (or
    anything with its fields); ``servers``: the count the run starts with; ``shared_gpus``: the GPUs
    servers and trainer share (the simulator's model: the trainer takes what servers leave), None
    for a run whose trainer keeps its GPUs."""

    def __init__(self, cfg, servers: int, shared_gpus: int | None = None):
        self.cfg = cfg
        self.shared_gpus = shared_gpus
        self.hand: tuple[int, int] | None = None
        self.target = self._clamp(servers)
        self.window: list[Reading] = []
        self.rate: tuple[float, float] | None = None  # (tokens/s per server, gen length) when gen was the bottleneck
        self.changes = 0
        self.waited_s = 0.0  # step seconds the pool has been short of (below) the target
        self.no_up_s = 0.0  # step seconds left before an increase may follow a start given up

    # ------------------------------------------------------------- bounds
    def bounds(self) -> tuple[int, int]:
        lo, hi = self.cfg.min_servers, self.cfg.max_servers
        if self.hand is not None:  # a person's bound narrows the config's, inside it
            lo, hi = min(max(self.hand[0], lo), hi), max(min(self.hand[1], hi), lo)
        return lo, hi

    def _clamp(self, n: int) -> int:
        lo, hi = self.bounds()
        return min(max(n, lo), hi)

    def set_hand_bound(self, lo: int | None, hi: int | None = None) -> None:
        """A person's bound (``areal-fast scale``): ``lo``..``hi`` (one number pins both); None clears
        it. Applied at the next :meth:`step` (a target outside it moves inside at once)."""
        if lo is None and hi is None:
            self.hand = None
            return
        lo = self.cfg.min_servers if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"scale bound: min {lo} > max {hi}")
        self.hand = (lo, hi)

    # ------------------------------------------------------------- the decision
    def into_bounds(self, step: int, servers: int, why: str = "") -> Decision | None:
        """A target outside the bounds moved inside them at once (the decision), else None."""
        lo, hi = self.bounds()
        if lo <= self.target <= hi:
            return None
        return self._change(self._clamp(self.target), f"bound {lo}..{hi}{why}",
                            {"step": step, "servers": servers, "lo": lo, "hi": hi}, {})

    def step(self, r: Reading) -> Decision:
        moved = self.into_bounds(r.step, r.servers)
        if moved is not None:
            return moved
        lo, hi = self.bounds()
        base = {"step": r.step, "servers": r.servers, "lo": lo, "hi": hi}
        self.no_up_s = max(0.0, self.no_up_s - r.seconds)
        if r.changing or r.servers != self.target:
            self.window.clear()
            self.waited_s = self.waited_s + r.seconds if r.servers < self.target else 0.0
            timeout = self.cfg.start_timeout_s
            if self.waited_s > timeout:
                self.waited_s, self.no_up_s = 0.0, timeout
                return self._change(max(r.servers, lo), f"gave up: {self.target - r.servers} added server(s) not in "
                                    f"the pool after {timeout:g} s; no increase for {timeout:g} s", base, {})
            return Decision(**base, target=self.target, change=0,
                            reason=f"waiting: {r.servers} of {self.target} servers in the pool")
        self.waited_s = 0.0
        self.window.append(r)
        if len(self.window) <= self.cfg.settle_steps:  # the first step may have begun before the change
            return Decision(**base, target=self.target, change=0,
                            reason=f"measuring: {len(self.window)} of {self.cfg.settle_steps + 1} steps")
        w = self.window[1:]
        W, T, S = (sum(getattr(x, k) for x in w) for k in ("wait_s", "train_s", "sync_s"))
        total = max(W + T + S, 1e-12)
        idle = W / total
        tokens = sum(x.tokens for x in w)
        buf = sum(x.buffer_groups for x in w) / max(sum(x.batch_groups for x in w), 1)
        stale = sum(x.staleness_mean for x in w) / len(w) / max(r.eta, 1)
        glen = sum(x.gen_len_mean for x in w) / len(w)
        n = self.target
        if idle > self.cfg.idle_high:  # generation is the bottleneck: its rate is the servers' own
            g = max(tokens / total / n, sum(x.gen_tokens_per_s for x in w) / len(w) / n)
            self.rate = (g, glen)
        else:
            g = self.rate[0] if self.rate and abs(glen / self.rate[1] - 1) <= RATE_LENGTH_TOLERANCE else None
        read = {"idle": idle, "buffer_batches": buf, "staleness_fraction": stale,
                "gen_tokens_per_s_per_server": g, "gen_len_mean": glen, "window_steps": len(w)}
        if idle > self.cfg.idle_high and n < hi:
            if self.no_up_s > 0:
                return Decision(**base, target=n, change=0, reason=f"hold: trainer idle {idle:.0%}, but no increase "
                                f"for {self.no_up_s:.0f} s more (a start was given up)", **read)
            want = self._balanced(g, tokens, T, S, n, hi)
            cap = n + max(1, math.ceil(n * self.cfg.max_step_fraction))
            new = min(max(want, n + 1), cap, hi)
            return self._change(new, f"trainer idle {idle:.0%} > {self.cfg.idle_high:.0%}: generation is short", base,
                                read)
        full = buf >= self.cfg.buffer_high
        stale_hit = r.eta == 0 or stale >= self.cfg.stale_high
        if idle < self.cfg.idle_low and full and stale_hit and n > lo:
            if g is None and self.rate is not None and glen > self.rate[1] * (1 + RATE_LENGTH_TOLERANCE):
                return Decision(**base, target=n, change=0, reason=f"hold: answers grew from {self.rate[1]:.0f} to "
                                f"{glen:.0f} tokens since the rate was measured: no removal", **read)
            new = n - max(1, math.ceil(n * self.cfg.down_fraction))
            if g is not None:  # never below what the last measured rate says is needed
                new = max(new, self._needed(g, tokens, T, S, n, hi, self._factor(self.cfg.keep)))
            new = max(new, lo)
            why = f"buffer {buf:.1f} batches >= {self.cfg.buffer_high:g}, staleness {stale:.0%} of eta"
            if new < n:
                return self._change(new, f"trainer idle {idle:.0%}, {why}: generation runs ahead", base, read)
            return Decision(**base, target=n, change=0, reason=f"hold: {why}, but the measured rate needs {n}",
                            **read)
        return Decision(**base, target=n, change=0, reason=f"hold: trainer idle {idle:.0%}", **read)

    def _factor(self, f: float) -> float:
        """``headroom`` / ``keep`` where spare servers cost nothing but their GPUs; 1 where the trainer
        shares the GPUs (``shared_gpus``): a spare server there is a GPU the trainer lacks."""
        return 1.0 if self.shared_gpus is not None else f

    def _train_rate(self, tokens: float, T: float, S: float, n: int, m: int) -> float:
        """Tokens/s the trainer consumes with ``m`` servers (its GPUs follow with ``shared_gpus``)."""
        if self.shared_gpus is None:
            return tokens / max(T + S, 1e-12)
        g_now, g_then = self.shared_gpus - n, self.shared_gpus - m
        if g_then <= 0:
            return 0.0
        return tokens / max(T * g_now / g_then + S, 1e-12)

    def _balanced(self, g: float, tokens: float, T: float, S: float, n: int, hi: int) -> int:
        """The smallest count whose generation (at ``g`` per server, less ``headroom``) reaches the most
        throughput the trainer allows."""
        best, best_rate = n, -1.0
        for m in range(n, hi + 1):
            rate = min(g * m / self._factor(self.cfg.headroom), self._train_rate(tokens, T, S, n, m))
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = m, rate
        return best

    def _needed(self, g: float, tokens: float, T: float, S: float, n: int, hi: int, factor: float) -> int:
        """The fewest servers that generate ``factor`` x what the trainer would consume with them."""
        for m in range(1, hi + 1):
            if g * m >= factor * self._train_rate(tokens, T, S, n, m):
                return m
        return hi

    def _change(self, new: int, reason: str, base: dict, read: dict) -> Decision:
        old = self.target
        self.target = new
        self.window.clear()
        if new != old:
            self.changes += 1
        return Decision(**base, target=new, change=new - old, reason=reason, **read)
