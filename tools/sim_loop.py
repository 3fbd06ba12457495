"""The RL loop as events in simulated GPU time, in one process, for the server-count policy's sweep
(``bench/bench_autoscale.py``, ``docs/autoscale.md``).

Servers decode with a batching model (a step costs a + b x batch + c x context tokens; at most what a
server's KV cache holds runs at once), the trainer trains with the caller's ``train_seconds`` on the GPUs
the servers leave, the weight sync pauses generation, and admission follows the staleness gate (groups
admitted < (eta + v + 1) x B). Every request is its own event and every server shares the load evenly
(the client's least-loaded routing, as a fluid). With a policy, a server it adds starts after
``server_start_s`` and joins at the next weight update; one it removes leaves at once (its requests go on
elsewhere, tokens kept); either way the trainer's GPUs change at its next step, paying ``trainer_resize_s``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from areal_fast.rollout.autoscale import Reading


@dataclass
class Scenario:
    name: str
    cap_start: int  # answer cap at the first step, grown linearly to cap_end at the last
    cap_end: int

    def cap(self, version: int, steps: int) -> int:
        f = min(1.0, version / max(steps - 1, 1))
        return round(self.cap_start + f * (self.cap_end - self.cap_start))


SCENARIOS = {"constant": Scenario("constant", 32768, 32768), "growing": Scenario("growing", 8192, 32768)}


class Loop:
    """The simulated loop (module docstring). ``model``: weight and KV bytes (``tools.gpu_model.ModelSpec``);
    ``decode``: a server's step model (``sim_sglang.SimConfig``: a, b, c); ``train_seconds(model, lens, gpus)``;
    ``k``: the constants by name (``kv_mem_fraction``, ``len_sigma``, ``prompt_tokens``, ``group_size``, ``eta``,
    ``sync_fixed_s``, ``nccl_bytes_per_s``, ``server_start_s``, ``trainer_resize_s``, ``len_ratio``); ``n_gen``:
    servers at the start; ``policy``: None (a fixed split) or the
    :class:`~areal_fast.rollout.autoscale.AutoscalePolicy` that sets the count after each step."""

    def __init__(self, model, decode, train_seconds, k: dict, gpus: int, batch: int, scenario: Scenario, steps: int,
                 n_gen: int, seed: int, policy=None):
        self.model, self.cfg, self.train_seconds, self.k = model, decode, train_seconds, k
        self.kv_tokens = (80e9 * self.k["kv_mem_fraction"] - self.model.weight_bytes) / self.model.kv_bytes_per_token
        self.G, self.B, self.sc, self.steps, self.policy = gpus, batch, scenario, steps, policy
        self.g, self.P, self.eta = self.k["group_size"], self.k["prompt_tokens"], self.k["eta"]
        self.rng = np.random.default_rng(seed)
        self.pool = n_gen
        self.starting: list[float] = []  # ready times of servers starting
        self.n_train = gpus - n_gen
        self.trainer_gpus_changed = False
        self.t = 0.0
        self.version = 0
        self.admitted = 0
        self.clock = 0.0  # tokens each running request has decoded since t = 0 (all run at one pace)
        self.running: list[tuple[float, float, int]] = []  # (clock at which it finishes, its start clock, group)
        self.sum_start = 0.0
        self.waiting: deque = deque()  # (answer length, group)
        self.left: dict[int, int] = {}
        self.lens: dict[int, list[int]] = {}
        self.adm_version: dict[int, int] = {}
        self.buffer: deque = deque()
        self.generated = 0
        self.rows: list[dict] = []

    # ------------------------------------------------------------- generation
    def median(self, version: int) -> float:
        return self.sc.cap(version, self.steps) / self.k["len_ratio"]

    def max_running(self) -> int:
        mean = self.median(self.version) * math.exp(self.k["len_sigma"] ** 2 / 2)
        return max(1, min(1024, int(self.kv_tokens / (self.P + mean))))

    def admit(self) -> None:
        while self.admitted < (self.eta + self.version + 1) * self.B:
            gid = self.admitted
            self.admitted += 1
            cap, med = self.sc.cap(self.version, self.steps), self.median(self.version)
            drawn = self.rng.lognormal(math.log(med), self.k["len_sigma"], self.g)
            lens = np.minimum(cap, np.maximum(1, drawn)).astype(int)
            self.left[gid], self.lens[gid], self.adm_version[gid] = self.g, [int(x) for x in lens], self.version
            for n in lens:
                self.waiting.append((int(n), gid))
        cap = self.pool * self.max_running()
        while self.waiting and len(self.running) < cap:
            n, gid = self.waiting.popleft()
            heapq.heappush(self.running, (self.clock + n, self.clock, gid))
            self.sum_start += self.clock

    def decode_step_s(self) -> float:
        m = len(self.running) / max(self.pool, 1)
        ctx = (len(self.running) * (self.P + self.clock) - self.sum_start) / max(self.pool, 1)
        return self.cfg.decode_a_s + self.cfg.decode_b_s * m + self.cfg.decode_c_s * ctx

    def generate_until(self, t_end: float) -> None:
        """Decode until ``t_end`` (or forever when nothing runs); finished groups go to the buffer."""
        while self.running and self.pool > 0:
            dt_step = self.decode_step_s()
            finish_clock, start_clock, gid = self.running[0]
            t_fin = self.t + (finish_clock - self.clock) * dt_step
            if t_fin > t_end:
                self.clock += (t_end - self.t) / dt_step
                self.generated += len(self.running) * (t_end - self.t) / dt_step
                self.t = t_end
                return
            self.generated += len(self.running) * (finish_clock - self.clock)
            self.clock = finish_clock
            self.t = t_fin
            heapq.heappop(self.running)
            self.sum_start -= start_clock
            self.left[gid] -= 1
            if self.left[gid] == 0:
                self.buffer.append(gid)
                if len(self.buffer) >= self.B and self._waiting_trainer:
                    return
            self.admit()
        self.t = max(self.t, t_end) if math.isfinite(t_end) else self.t

    # ------------------------------------------------------------- the run
    def run(self) -> dict:
        self._waiting_trainer = True
        return self._run()

    def _run(self) -> dict:
        self.admit()
        t_last_end, gen_last = 0.0, 0.0
        for _ in range(self.steps):
            self._waiting_trainer = True
            while len(self.buffer) < self.B:
                if not self.running:
                    raise RuntimeError("the simulated loop stalled: nothing running and no batch")
                self.generate_until(math.inf)
            t_ask = t_last_end
            buffered_at_ask = self._buffer_at_ask
            self._waiting_trainer = False
            wait = self.t - t_ask
            batch = [self.buffer.popleft() for _ in range(self.B)]
            lens = [self.P + n for gid in batch for n in self.lens[gid]]
            tokens = sum(lens)
            train = self.train_seconds(self.model, lens, self.n_train)
            if self.trainer_gpus_changed:
                train += self.k["trainer_resize_s"]
                self.trainer_gpus_changed = False
            self.generate_until(self.t + train)
            sync = self.k["sync_fixed_s"] + self.model.weight_bytes / self.k["nccl_bytes_per_s"]
            self.t += sync  # generation paused for the update
            staleness = [self.version - self.adm_version[gid] for gid in batch]
            self.version += 1
            joined = [r for r in self.starting if r <= self.t]
            self.starting = [r for r in self.starting if r > self.t]
            self.pool += len(joined)
            gen_rate = (self.generated - gen_last) / max(self.t - t_last_end, 1e-9)
            gen_last = self.generated
            row = {"step": self.version, "t": self.t, "wait_s": wait, "train_s": train, "sync_s": sync,
                   "tokens": tokens, "buffer_at_ask": buffered_at_ask, "servers": self.pool,
                   "trainer_gpus": self.n_train, "staleness_mean": sum(staleness) / len(staleness),
                   "staleness_max": max(staleness), "gen_len_mean": sum(lens) / len(lens) - self.P,
                   "gen_tokens_per_s": gen_rate, "idle": wait / max(wait + train + sync, 1e-9)}
            for gid in batch:
                del self.left[gid], self.lens[gid], self.adm_version[gid]
            t_last_end = self.t
            self._buffer_at_ask = len(self.buffer)
            if self.policy is not None:
                self._decide(row)
            self.rows.append(row)
            self.admit()
        return self.summary()

    _buffer_at_ask = 0

    def _decide(self, row: dict) -> None:
        r = Reading.from_record(row, servers=self.pool, changing=bool(self.starting), batch_groups=self.B,
                                eta=self.eta)
        d = self.policy.step(r)
        row.update(target=d.target, change=d.change, reason=d.reason)
        if d.change > 0:  # GPUs leave the trainer at its next step; the servers start now
            self.starting += [self.t + self.k["server_start_s"]] * d.change
            self.n_train -= d.change
            self.trainer_gpus_changed = True
        elif d.change < 0:  # out of the pool at once; their requests go on on the others, tokens kept
            drop = -d.change
            from_starting = min(drop, len(self.starting))
            self.starting = self.starting[from_starting:]
            self.pool -= drop - from_starting
            self.n_train += drop
            self.trainer_gpus_changed = True

    def summary(self) -> dict:
        samples = self.steps * self.B * self.g
        idle = sum(r["wait_s"] for r in self.rows) / self.t
        return {"sim_s": self.t, "samples_per_s": samples / self.t, "trainer_idle_fraction": idle,
                "staleness_max": max(r["staleness_max"] for r in self.rows),
                "changes": sum(1 for r in self.rows if r.get("change")), "steps": self.steps}
