"""The run's autoscaler: the server-count policy (``areal_fast.rollout.autoscale``) fed with each trainer
step of the run, acting through the launcher's target (``servers/target.json``, as ``areal-fast servers
set`` does), and a person's bound (``areal-fast scale RUN N``) read from ``servers/scale.json``.

Rank 0 (``launch.rank``) runs it beside the controller when ``rollout.autoscale.enabled``:

- :meth:`Autoscaler.on_record` is a controller callback: a train record becomes a
  :class:`~areal_fast.rollout.autoscale.Reading` (the step's wait, train and sync time, tokens, the
  buffer when the trainer asked, staleness, generation length, generated tokens/s, the pool and
  whether it is at its target); the decision goes back through the controller's callbacks as a
  ``kind: autoscale`` record (``metrics.jsonl``, TensorBoard, W&B, MLflow, the Prometheus endpoint,
  the progress line) and to the run's log; a change writes the new target, and the launcher starts
  or stops servers (``elastic.supervisor``: a new server joins after a full weight update, a removed
  one leaves the pool first, its requests failing over with their tokens kept, and is stopped once
  out of it);
- :meth:`Autoscaler.watch` reads ``servers/scale.json`` every 0.5 s: a new bound applies at once
  (a target outside it is moved inside and written), not only at the next step;
- ``servers/autoscale.json`` (this module's file) holds the policy's state: on, its bounds, its
  target and the last decision, for ``areal-fast scale`` and a person to read.

``areal-fast scale RUN N`` (:func:`scale_command`) pins the count: it writes the bound N..N and the
target N, so the launcher acts at once whether the policy runs or not; ``areal-fast scale RUN auto``
gives the bounds back to the config; ``--min``/``--max`` set a range.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from areal_fast.elastic.members import (
    MAX_SERVERS,
    Target,
    read_json,
    read_members,
    read_starting,
    read_target,
    servers_dir,
    write_json,
    write_target,
)
from areal_fast.rollout.autoscale import AutoscalePolicy, Decision, Reading

log = logging.getLogger(__name__)
SCALE_FILE, STATE_FILE = "scale.json", "autoscale.json"
WATCH_S = 0.5


def read_scale(out) -> tuple[int, int] | None:
    """A person's bound from ``servers/scale.json``: (min, max), or None (no bound, or unreadable)."""
    d = read_json(servers_dir(out) / SCALE_FILE)
    if not isinstance(d, dict) or not isinstance(d.get("min"), int) or not isinstance(d.get("max"), int):
        return None
    return d["min"], d["max"]


class Autoscaler:
    """See the module docstring. ``cfg``: ``rollout.autoscale``; ``emit``: the controller's callbacks
    (``Controller._emit``); ``rollout``: the pool (``urls``); ``syncer``: its ``membership`` (joining)."""

    def __init__(self, cfg, out: Path, rollout, syncer, emit, *, servers: int, eta: int, batch_groups: int):
        self.cfg, self.out, self.rollout, self.syncer, self.emit = cfg, Path(out), rollout, syncer, emit
        self.eta, self.batch_groups = eta, batch_groups
        self.policy = AutoscalePolicy(cfg, servers)
        self.last: Decision | None = None
        self._hand_seen: tuple[int, int] | None = None
        self._written: int | None = None  # the target this autoscaler wrote last
        self._apply_hand(step=0)
        self._write_state()

    # ------------------------------------------------------------- readings
    def _changing(self) -> bool:
        membership = getattr(self.syncer, "membership", None)
        members = read_members(self.out) or []
        return bool(getattr(membership, "joining", ())) or bool(read_starting(self.out)) or \
            len(members) != self.policy.target

    def reading(self, m: dict) -> Reading:
        return Reading.from_record(m, servers=len(self.rollout.urls), changing=self._changing(),
                                   batch_groups=self.batch_groups, eta=self.eta)

    # ------------------------------------------------------------- decisions
    def on_record(self, m: dict) -> None:
        """A controller callback: one decision per train record."""
        if m.get("kind") != "train":
            return
        self._apply_hand(step=int(m["step"]))
        t = read_target(self.out)  # `areal-fast servers set/add/remove` moved the target: the policy starts from it
        if t is not None and t.n_servers != self._written and t.n_servers != self.policy.target:
            log.warning("autoscale: the target was set to %d by hand (areal-fast servers); the policy goes on from it",
                        t.n_servers)
            self.policy.target, self._written = t.n_servers, t.n_servers
            self.policy.window.clear()
        self._act(self.policy.step(self.reading(m)))

    def _act(self, d: Decision) -> None:
        self.last = d
        if d.change:
            write_target(self.out, Target(d.target))
            self._written = d.target
            log.warning("autoscale: servers %d -> %d at step %d: %s (%s)", d.target - d.change, d.target, d.step,
                        d.reason, _numbers(d))
        else:
            log.info("autoscale: %d servers at step %d: %s (%s)", d.target, d.step, d.reason, _numbers(d))
        self._write_state()
        self.emit(d.record())

    def _apply_hand(self, step: int) -> None:
        hand = read_scale(self.out)
        if hand == self._hand_seen:
            return
        self._hand_seen = hand
        self.policy.set_hand_bound(*(hand or (None, None)))
        lo, hi = self.policy.bounds()
        log.warning("autoscale: bound %s (servers %d..%d)", f"{hand[0]}..{hand[1]} by hand" if hand else "cleared",
                    lo, hi)
        moved = self.policy.into_bounds(step, len(self.rollout.urls), " by hand")
        if moved is not None:
            self._act(moved)

    async def watch(self, every_s: float = WATCH_S) -> None:
        """Apply a person's bound as soon as ``servers/scale.json`` changes (until cancelled)."""
        while True:
            try:
                self._apply_hand(step=self.last.step if self.last else 0)
            except Exception:  # noqa: BLE001 - the next look tries again
                log.exception("autoscale: reading %s failed", SCALE_FILE)
            await asyncio.sleep(every_s)

    def _write_state(self) -> None:
        lo, hi = self.policy.bounds()
        last = self.last
        write_json(servers_dir(self.out) / STATE_FILE, {
            "enabled": True, "min": lo, "max": hi, "target": self.policy.target, "hand": self._hand_seen,
            "last": None if last is None else {"step": last.step, "change": last.change, "reason": last.reason},
            "time": time.time()})


def _numbers(d: Decision) -> str:
    parts = []
    for k, fmt in (("idle", "trainer idle {:.1%}"), ("buffer_batches", "buffer {:.2f} batches"),
                   ("staleness_fraction", "staleness {:.0%} of eta"), ("gen_len_mean", "gen length {:.0f}"),
                   ("gen_tokens_per_s_per_server", "{:.0f} tokens/s a server")):
        v = getattr(d, k)
        if v is not None:
            parts.append(fmt.format(v))
    return ", ".join(parts) or "no window yet"


def scale_command(run_dir, arg: str | None, lo: int | None = None, hi: int | None = None) -> dict:
    """``areal-fast scale RUN N | auto`` or ``--min A --max B``: write a person's bound (and with N the
    target N, at once); returns the bound, the target and the policy's state. ValueError names a bad
    value; nothing is written then."""
    if read_members(run_dir) is None:
        raise ValueError(f"RUN {run_dir}: no {servers_dir(run_dir).name}/members.json; is it the output_dir of a "
                         "running run whose servers the launcher started?")
    path = servers_dir(run_dir) / SCALE_FILE
    if arg == "auto":
        if lo is not None or hi is not None:
            raise ValueError("scale auto: --min/--max cannot go with auto (it clears the bound)")
        write_json(path, {"min": None, "max": None, "time": time.time()})
    else:
        if arg is not None:
            if lo is not None or hi is not None:
                raise ValueError("scale N: pins the count; give N, or --min/--max, not both")
            try:
                lo = hi = int(arg)
            except ValueError:
                raise ValueError(f"scale: expected a number of servers or 'auto', got {arg!r}") from None
        if lo is None and hi is None:
            raise ValueError("scale: give N, 'auto', or --min and/or --max")
        lo = 1 if lo is None else lo
        hi = MAX_SERVERS if hi is None else hi
        for name, v in (("N" if arg is not None else "--min", lo), ("N" if arg is not None else "--max", hi)):
            if not 1 <= v <= MAX_SERVERS:
                raise ValueError(f"scale: {name} must be in 1..{MAX_SERVERS} (elastic.members.MAX_SERVERS), got {v}")
        if lo > hi:
            raise ValueError(f"scale: --min {lo} is above --max {hi}")
        write_json(path, {"min": lo, "max": hi, "time": time.time()})
        if arg is not None:  # the launcher acts at once, whether the policy runs or not
            write_target(run_dir, Target(lo))
    state = read_json(servers_dir(run_dir) / STATE_FILE)
    target = read_target(run_dir)
    return {"bound": read_scale(run_dir), "target": target.n_servers if target else None,
            "autoscale": state if isinstance(state, dict) else {"enabled": False}}
