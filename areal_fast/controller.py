"""The asynchronous RL controller: one asyncio loop that keeps the inference servers busy and
trains whenever a batch is ready (AReaL-style), with the staleness bound of decoupled PPO
(``docs/staleness.md``).

::

      PromptStream (position p)        requeue (positions to regenerate: resume, strict drops)
             |                                  |
             v                                  v
    +-------------------+   gate.try_admit()  (running < max_concurrent and
    |  admission loop   |<----- wake -------   accepted + running < (eta + v + 1) * B)
    +-------------------+
             | one task per prompt (a *group* of n episodes)
             v
    +-------------------+  n x workflow(row, engine): each episode makes one or more model
    |   group task      |  turns through rollout.generate (interruptible; every token keeps the
    |  (x max_concurrent)|  version that made it), calls tools and rewards (reward process pool)
    |                   |  and returns trajectories (tokens, loss mask, logprobs, versions, reward)
    +-------------------+  finished episodes wait for the rest of their group under the
             |                 buffer's bound (park / unpark: in memory or its spill file)
             | finished group (gate.finish)
             v
        buffer (FIFO of finished groups; past rollout.buffer_memory_mb  +
             |  they wait in a spill file: areal_fast.buffer)           |
             |  when >= B groups                                        |
             v                                                          | checkpoint: version,
    +-------------------+   trainer.train(samples)   (a thread; rollouts go on meanwhile)
    |    train loop     |   rollout.pause() -> syncer.sync(v+1) -> rollout.resume()
    |                   |   version v -> v+1, gate.set_version(v+1), wake admission
    |                   |   every K steps: greedy eval (no version change while it runs)
    |                   |   every K steps: checkpoint (trainer + controller state) ----+
    +-------------------+

The episode logic is the workflow's (``areal_fast.workflow``, ``docs/workflows.md``; the default
is one completion and one reward): this loop only schedules episodes, in groups of n per task.
An episode that raises ``EpisodeFailed`` is counted and its group trains on the others (a group
left with no trajectory frees its slot); any other exception stops the run.

eta = 0 is the synchronous baseline with the same code: capacity (v + 1) * B admits exactly
one batch per version, so generation stops until the trainer has stepped and synced.

Checkpoints hold the controller state: data position, version, counters, the finished groups
still in the buffer (streamed to ``buffer.bin``, see ``areal_fast.buffer``), and the positions
of groups still generating (they are regenerated after a
restart: nothing is lost, and nothing trained twice because a checkpoint is written only at a
step boundary, atomically, together with the trainer state). After a restore at version v the
gate is restored with ``accepted = v * B + len(buffer)``, so the bound holds as before.
A checkpoint also records what the data order depends on (``ControllerSettings.resume_key``);
resuming with different values is refused with the changed keys named. A newest checkpoint that
cannot be read is moved aside (``step_N.corrupt``) with a warning and the previous one is used.

This module does no tensor math. Its collaborators are narrow ports (see :class:`RolloutPort`,
:class:`TrainerPort`, :class:`SyncPort`, :class:`RewardPort`, :class:`Gate`, which
``areal_fast.rollout.staleness.StalenessManager`` implements); ``areal_fast.launch.runtime``
builds them from the real parts, tests use fakes for all but the gate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import secrets
import shutil
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from areal_fast.buffer import DEFAULT_MEMORY_MB as DEFAULT_BUFFER_MEMORY_MB
from areal_fast.buffer import MB, GroupBuffer
from areal_fast.buffer import read_records as _read_records
from areal_fast.diskutil import write_failed
from areal_fast.heap import HeapTrimmer
from areal_fast.sample import Generation  # noqa: F401 - re-exported: the rollout port's record
from areal_fast.workflow import (
    DEFAULT_WORKFLOW,
    EpisodeEngine,
    EpisodeFailed,
    check_trajectories,
    columns,
    load_workflow,
)

log = logging.getLogger(__name__)

STATE_FILE = "controller.json"
BUFFER_FILE = "buffer.bin"  # the buffered groups of a checkpoint, as records (``areal_fast.buffer``)
# Groups admitted between two yields to the event loop. Admitting 1,024 groups of 16 at once made
# one loop iteration start 16,384 requests (~10 s without a break at 256 servers); 4 groups (64
# requests) keep each slice to milliseconds.
ADMIT_SLICE = 4
COMPLETE_MARKER = "COMPLETE"


# ----------------------------------------------------------------------------- ports


class RolloutPort(Protocol):
    async def generate(self, input_ids: list[int], sampling: dict, rid: str) -> Generation: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...


class TrainerPort(Protocol):
    # blocking; run in a thread. Sample dicts as ``areal_fast.trainer.batch.Sample``, per-token fields
    # as arrays (Group.samples)
    def train(self, samples: list[dict]) -> dict: ...
    def save(self, path: Path) -> None: ...
    # optional: raise if the checkpoint at path cannot be loaded; may return the trainer version it holds
    def check(self, path: Path) -> int | None: ...
    def load(self, path: Path) -> None: ...  # raises CorruptCheckpoint for a damaged file


class SyncPort(Protocol):
    async def sync(self, version: int) -> dict: ...


class RewardPort(Protocol):
    async def score(self, task: Any, completion: str) -> Any: ...  # .value, .status


class Gate(Protocol):
    """The staleness gate (``docs/staleness.md``); ``StalenessManager`` is the implementation."""

    def try_admit(self) -> bool: ...
    def finish(self, accepted: bool) -> None: ...
    # strict mode: False = drop. The decision depends only on the oldest version, so the controller
    # passes ``[oldest model-token version]`` (``[]`` for a group without model tokens), not every token's
    def check_consumed(self, token_versions: list[int]) -> bool: ...
    def set_version(self, version: int) -> None: ...
    def restore(self, version: int, accepted: int | None = None) -> None: ...
    def stats(self) -> dict: ...


# ----------------------------------------------------------------------------- state


_GROUP_COLUMNS = {"outputs": columns.TOKEN_ARRAY, "behav_logprobs": columns.LOGPROB_ARRAY,
                  "versions": columns.TOKEN_ARRAY, "prompts": columns.TOKEN_ARRAY, "loss_masks": columns.MASK_ARRAY}


@dataclass
class Group:
    """The trajectories of the n episodes of one prompt, finished and scored. ``prompts`` and
    ``loss_masks`` are per trajectory when the workflow made them (empty: every trajectory starts
    with ``prompt_ids`` and all its output tokens are model tokens).

    Per-token data are compact columns, one per trajectory (``areal_fast.workflow.columns``):
    ``prompt_ids``, ``prompts``, ``outputs``, ``versions`` ``array('i')``, ``behav_logprobs``
    ``array('f')``, ``loss_masks`` ``array('B')``; lists given to the constructor are converted.
    ``min_versions`` holds each trajectory's oldest model-token version (None: no model token),
    computed from the columns when not given. A buffered group is never changed: the checkpoint
    writer and the trainer read its arrays from their threads."""

    position: int
    row: int
    admitted_version: int
    prompt_ids: array
    outputs: list[array]
    behav_logprobs: list[array]
    versions: list[array]
    rewards: list[float]
    finish_reasons: list[str]
    gen_seconds: float = 0.0
    prompts: list[array] = field(default_factory=list)
    loss_masks: list[array] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    episodes_failed: int = 0
    min_versions: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = columns.tokens(self.prompt_ids, "Group.prompt_ids")
        for name, code in _GROUP_COLUMNS.items():
            cols = getattr(self, name)
            if any(type(c) is not array or c.typecode != code for c in cols):
                setattr(self, name, [columns.column(c, code, f"Group.{name}[{i}]") for i, c in enumerate(cols)])
        if len(self.min_versions) != len(self.versions):
            masks = self.loss_masks or [None] * len(self.versions)
            self.min_versions = [columns.min_model_version(v, m) for v, m in zip(self.versions, masks)]

    @classmethod
    def from_state(cls, g: dict) -> Group:
        """A group from its dict in the controller.json of checkpoints written before ``buffer.bin``:
        columns encoded compactly (``columns.encode_column``), or the lists (and the ``logprobs``
        name) of still older ones."""
        g = dict(g)
        if "logprobs" in g:  # checkpoints written before the behaviour log-probs got their one name
            g["behav_logprobs"] = g.pop("logprobs")
        pos = g.get("position")
        g["prompt_ids"] = columns.decode_column(g["prompt_ids"], columns.TOKEN_ARRAY, f"group {pos}: prompt_ids")
        for name, code in _GROUP_COLUMNS.items():
            if name in g:
                g[name] = [columns.decode_column(c, code, f"group {pos}: {name}[{i}]") for i, c in enumerate(g[name])]
        return cls(**g)

    @property
    def n_tokens(self) -> int:
        """Model tokens (the trained ones; tool and environment text excluded)."""
        return sum(self.model_token_counts())

    def model_token_counts(self) -> list[int]:
        """Model tokens of each trajectory."""
        if self.loss_masks:
            return [len(m) - bytes(m).count(0) for m in self.loss_masks]
        return [len(o) for o in self.outputs]

    def min_model_version(self) -> int | None:
        """The oldest version of any model token of the group (None: no model token)."""
        return min((v for v in self.min_versions if v is not None), default=None)

    def min_version(self) -> int:
        """The oldest model-token version; the admission version for a group without model tokens."""
        m = self.min_model_version()
        return self.admitted_version if m is None else m

    def samples(self) -> list[dict]:
        """The trainer's sample dicts. They share this group's arrays (no copy): the trainer reads them
        (``areal_fast.trainer.batch``), never changes them."""
        out = []
        for i, (o, lp, v, r) in enumerate(zip(self.outputs, self.behav_logprobs, self.versions, self.rewards)):
            s = dict(prompt_ids=self.prompts[i] if self.prompts else self.prompt_ids, output_ids=o,
                     behav_logprobs=lp, output_versions=v, reward=r, group_id=self.position)
            if self.loss_masks:
                s["loss_mask"] = self.loss_masks[i]
            out.append(s)
        return out


@dataclass
class ControllerSettings:
    """What the loop needs from the config (kept flat so tests can build it directly). The
    staleness bound and strict mode belong to the gate, not here."""

    batch_size: int
    group_size: int
    total_steps: int
    sampling: dict
    eval_sampling: dict
    eval_every: int = 0
    eval_at_start: bool = True
    checkpoint_every: int = 0
    keep_last: int = 2
    output_dir: Path = Path("runs/run")
    dump_samples: bool = False
    eval_reward: str | None = None  # reward name for evaluation (None = the training reward)
    resume_key: dict = field(default_factory=dict)
    """What the data order and the meaning of a saved position depend on (seed, data source and
    fingerprint, batch and group sizes...): stored in every checkpoint, compared on resume."""
    workflow: Any = DEFAULT_WORKFLOW
    """The episode: 'package.module:function' (or the async function itself)."""
    workflow_args: dict = field(default_factory=dict)
    """Keyword arguments of every workflow call."""
    tool_timeout: float = 10.0
    """Seconds per tool call (``EpisodeEngine.tool``)."""
    buffer_memory_mb: float | None = DEFAULT_BUFFER_MEMORY_MB
    """MB of columns the buffer of finished groups keeps in memory; more is spilled to a file in
    ``output_dir`` (``areal_fast.buffer``). None = no bound."""


@dataclass
class Counters:
    admitted: int = 0
    finished: int = 0
    trained_groups: int = 0
    trained_tokens: int = 0
    trained_samples: int = 0  # trajectories (a workflow may return any number per episode)
    dropped_stale: int = 0
    regenerated: int = 0
    reward_status: dict = field(default_factory=dict)
    episodes_failed: int = 0
    groups_failed: int = 0  # every episode of the group failed: nothing to train on, slot freed
    tool_status: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- controller


class Controller:
    """See the module docstring. ``run()`` trains until ``total_steps`` versions exist."""

    def __init__(self, settings: ControllerSettings, prompts, tokenizer, rollout: RolloutPort,
                 reward: RewardPort, trainer: TrainerPort, syncer: SyncPort, gate: Gate,
                 eval_prompts=(), callbacks: list[Callable[[dict], None]] | None = None):
        self.s = settings
        self.prompts, self.eval_prompts, self.tok = prompts, list(eval_prompts), tokenizer
        self.rollout, self.reward, self.trainer, self.syncer, self.gate = rollout, reward, trainer, syncer, gate
        self.callbacks = list(callbacks or [])
        wf = settings.workflow
        self.workflow = load_workflow(wf) if isinstance(wf, str) else wf
        self._workflow_name = wf if isinstance(wf, str) else getattr(wf, "__qualname__", repr(wf))
        self._tool_counts: Counter = Counter()
        self._reward_counts: Counter = Counter()
        self.version = 0
        self.position = 0
        self.requeue: deque[int] = deque()
        self.buffer = self._new_buffer()
        self.running: dict[int, asyncio.Task] = {}
        self.counters = Counters()
        self.incarnation = secrets.token_hex(4)  # makes rids unique across restarts
        self.ckpt_dir = Path(settings.output_dir) / "checkpoints"
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._wake = asyncio.Event()
        self._buffer_ready = asyncio.Event()
        self._failure: BaseException | None = None
        self._t_start = 0.0
        self._elapsed_before = 0.0  # wall seconds of earlier incarnations (resume)
        self._timers = Counter()
        self._last_batch_dump: list = []
        # freed column memory back to the OS while the run goes on (glibc; AREAL_FAST_HEAP_TRIM_S)
        self.heap = HeapTrimmer()

    def _new_buffer(self) -> GroupBuffer:
        mb = self.s.buffer_memory_mb
        return GroupBuffer(None if mb is None else int(mb * MB), Path(self.s.output_dir), Group)

    # ------------------------------------------------------------- admission and groups
    def _next_position(self) -> int | None:
        if self.requeue:
            self.counters.regenerated += 1
            return self.requeue.popleft()
        p = self.position
        self.position += 1
        return p

    async def _admission_loop(self) -> None:
        while True:
            admitted = 0
            while self.gate.try_admit():
                pos = self._next_position()
                self.counters.admitted += 1
                self.running[pos] = asyncio.create_task(self._run_group(pos), name=f"group-{pos}")
                admitted += 1
                if admitted % ADMIT_SLICE == 0:  # let the new groups send, and everything else run
                    await asyncio.sleep(0)
            self._wake.clear()
            await self._wake.wait()

    def _engine(self, episode_id: str, sampling: dict, training: bool = True) -> EpisodeEngine:
        return EpisodeEngine(self.rollout, self.reward, self.tok, sampling, episode_id, training=training,
                             eval_reward=self.s.eval_reward, tool_timeout_s=self.s.tool_timeout,
                             tool_counts=self._tool_counts, version=lambda: self.version,
                             reward_counts=self._reward_counts if training else Counter())

    async def _episode(self, row, engine: EpisodeEngine) -> list:
        """One workflow call; its trajectories, or None when it gave up (``EpisodeFailed``, counted)."""
        try:
            out = await self.workflow(row, engine, **self.s.workflow_args)
        except EpisodeFailed as e:
            self.counters.episodes_failed += 1
            log.warning("episode %s failed: %s", engine.episode_id, e)
            return None
        return check_trajectories(out, f"workflow {self._workflow_name} (episode {engine.episode_id})")

    async def _run_group(self, pos: int) -> None:
        ok = False
        parked: list[tuple[int, Any]] = []  # (episode, handle): finished episodes wait in the buffer's bound
        try:
            row = self.prompts.at(pos)
            v0 = self.version
            t0 = time.perf_counter()

            async def episode(k: int) -> bool:
                trajs = await self._episode(row, self._engine(f"{self.incarnation}-{pos}-{k}", self.s.sampling))
                if trajs:  # a long-tailed group waits for its longest sample: the others wait here
                    parked.append((k, self.buffer.park(_group_of(pos, row.index, v0, trajs))))
                return trajs is None

            failed = sum(await asyncio.gather(*[episode(k) for k in range(self.s.group_size)]))
            self._count_tools()
            parked.sort(key=lambda kh: kh[0])  # episode order, as they were launched
            parts = []
            while parked:
                parts.append(self.buffer.unpark(parked.pop(0)[1]))
            if not parts:  # nothing to train on: the slot goes back to admission (counted)
                self.counters.groups_failed += 1
                log.warning("group at position %d: no trajectory (%d of %d episodes failed)", pos, failed,
                            self.s.group_size)
                return
            # the group takes the trajectories' arrays as they are (no per-token work here)
            group = _merge_parts(parts, gen_seconds=time.perf_counter() - t0, episodes_failed=failed)
            del parts
            self.buffer.append(group)
            self.counters.finished += 1
            ok = True
            self._buffer_ready.set()
        except asyncio.CancelledError:  # shutdown: the prompt was not trained, keep it pending
            self.requeue.append(pos)
            raise
        except BaseException as e:  # a failed group stops the run with its error (never silently)
            log.error("group at position %d failed: %r", pos, e)
            if self._failure is None:
                self._failure = e
            self._buffer_ready.set()
        finally:
            for _, h in parked:
                self.buffer.discard(h)
            self.running.pop(pos, None)
            self.gate.finish(ok)
            self._wake.set()

    def _count_tools(self) -> None:
        """Move the engines' tool and reward outcome counts into the checkpointed counters."""
        for counts, into in ((self._tool_counts, self.counters.tool_status),
                             (self._reward_counts, self.counters.reward_status)):
            for k, v in counts.items():
                into[k] = into.get(k, 0) + v
            counts.clear()

    # ------------------------------------------------------------- training
    def _take_batch(self) -> tuple[list, list[int]]:
        """B buffer slots FIFO (groups, or spilled groups still to read: :meth:`GroupBuffer.load`); in
        strict mode groups with a token older than version - eta are dropped and their prompts
        regenerated (counted). The oldest version of a spilled group is in memory: no read to drop it."""
        batch, dropped = [], []
        while self.buffer and len(batch) < self.s.batch_size:
            g = self.buffer.take()
            oldest = g.min_model_version()
            if not self.gate.check_consumed([] if oldest is None else [oldest]):  # strict mode only
                dropped.append(g)  # the gate gave its slot back
                continue
            batch.append(g)
        if dropped:
            self.buffer.release(dropped)
            self.counters.dropped_stale += len(dropped)
            self.requeue.extendleft(reversed([g.position for g in dropped]))
            self._wake.set()
        if len(batch) < self.s.batch_size:  # not enough after drops: put back, wait for more
            self.buffer.put_back(batch)
            batch = []
        return batch, [g.position for g in dropped]

    async def _wait_batch(self) -> list[Group]:
        while True:
            if self._failure is not None:
                raise self._failure
            if len(self.buffer) >= self.s.batch_size:
                slots, _ = self._take_batch()
                if slots:  # spilled groups are read back in a thread (~1 MB each at 16 x 6k tokens)
                    try:
                        batch = await asyncio.to_thread(self.buffer.load, slots)
                    except BaseException:  # cancelled (shutdown) or unreadable: the slots stay buffered
                        self.buffer.put_back(slots)
                        raise
                    self.buffer.release(slots)
                    return batch
            self._buffer_ready.clear()
            await self._buffer_ready.wait()

    async def _train_step(self) -> dict:
        t0 = time.perf_counter()
        batch = await self._wait_batch()
        t1 = time.perf_counter()
        samples = [s for g in batch for s in g.samples()]
        tmetrics = await asyncio.to_thread(self.trainer.train, samples)
        t2 = time.perf_counter()
        # what the metrics need, then the batch's columns go (at full lengths ~0.65 GB for 8k samples):
        # the pause, sync and resume below must not hold them while answers keep arriving
        stats = self._batch_stats(batch)
        del batch, samples
        await self.rollout.pause()
        # the version moves only after every server has the new weights (sync raises otherwise)
        smetrics = await self.syncer.sync(self.version + 1) or {}
        self.version += 1
        self.gate.set_version(self.version)
        await self.rollout.resume()
        self._wake.set()
        t3 = time.perf_counter()
        self._timers.update(wait_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2)
        staleness, rewards, ntok, infos = (stats[k] for k in ("staleness", "rewards", "tokens", "infos"))
        self.counters.trained_groups += len(staleness)
        self.counters.trained_samples += len(rewards)
        self.counters.trained_tokens += ntok
        elapsed = self.elapsed()
        m = {
            "step": self.version, "time": elapsed,
            "reward": sum(rewards) / max(len(rewards), 1),
            "tokens": ntok, "gen_len_mean": ntok / max(len(rewards), 1),
            "gen_len_max": stats["gen_len_max"],
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            # of the groups this step consumed (trained), not of those admitted
            **_staleness_quantiles(staleness),
            "staleness": staleness, "positions": stats["positions"],
            "wait_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
            "buffer": len(self.buffer), "buffer_spilled": self.buffer.spilled, "running": len(self.running),
            "parked_spilled": self.buffer.parked_spilled,
            "trained_tokens_per_s": self.counters.trained_tokens / max(elapsed, 1e-9),
            "trained_samples_per_s": self.counters.trained_samples / max(elapsed, 1e-9),
            "dropped_stale": self.counters.dropped_stale,
            "episodes_failed": self.counters.episodes_failed,
            **{f"tool/{k}": v for k, v in self.counters.tool_status.items()},
            **{f"episode/{k}": v for k, v in _means(infos).items()},
            **{f"gate/{k}": v for k, v in self.gate.stats().items()},
            **{f"train/{k}": v for k, v in (tmetrics or {}).items() if isinstance(v, int | float)},
            **{f"sync/{k}": v for k, v in smetrics.items() if isinstance(v, int | float)},
        }
        return m

    def _batch_stats(self, batch: list[Group]) -> dict:
        """What a step's metrics (and ``dump_samples``) need of its batch, taken before the batch is
        dropped. Staleness is counted against the version the batch trained (the current one)."""
        if self.s.dump_samples:
            self._last_batch_dump = [
                {"position": g.position, "prompt": self.tok.decode(g.prompt_ids),
                 "admitted_version": g.admitted_version,
                 "samples": [{"text": self.tok.decode(o), "reward": r, "versions": v.tolist(), "finish": f}
                             for o, r, v, f in zip(g.outputs, g.rewards, g.versions, g.finish_reasons)]}
                for g in batch]
        return {"staleness": [self.version - g.min_version() for g in batch],
                "rewards": [r for g in batch for r in g.rewards],
                "tokens": sum(g.n_tokens for g in batch),
                "infos": [i for g in batch for i in g.infos],
                "gen_len_max": max((n for g in batch for n in g.model_token_counts()), default=0),
                "positions": [g.position for g in batch]}

    def elapsed(self) -> float:
        return self._elapsed_before + (time.perf_counter() - self._t_start)

    # ------------------------------------------------------------- evaluation
    async def evaluate(self) -> dict:
        """Greedy generation on the held-out prompts at the current version; mean reward."""
        if not self.eval_prompts:
            return {}
        t0 = time.perf_counter()

        async def one(i, row):
            """One episode of the workflow, greedy; its trajectories' mean reward (0 when it failed)."""
            engine = self._engine(f"{self.incarnation}-eval{self.version}-{i}", self.s.eval_sampling, training=False)
            trajs = await self._episode(row, engine) or []
            if not trajs:
                return 0.0, 0, {}
            n = sum(tr.n_model_tokens for tr in trajs) / len(trajs)
            return sum(float(tr.reward) for tr in trajs) / len(trajs), n, _means([_numbers(tr.info) for tr in trajs])

        res = await asyncio.gather(*[one(i, r) for i, r in enumerate(self.eval_prompts)])
        self._count_tools()
        out = {"step": self.version, "time": self.elapsed(), "eval_reward": sum(r for r, _, _ in res) / len(res),
               "eval_len_mean": sum(n for _, n, _ in res) / len(res), "eval_s": time.perf_counter() - t0,
               "eval_n": len(res), **{f"eval_{k}": v for k, v in _means([i for _, _, i in res]).items()}}
        self._timers.update(eval_s=out["eval_s"])
        self.eval_history.append(out)
        return out

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Controller state at this instant (called synchronously at a step boundary). ``buffer`` holds
        the buffer's slots (groups, and spilled groups with their ``position``), which
        :meth:`_write_checkpoint` streams to ``buffer.bin``; every other entry is JSON."""
        return {
            "version": self.version, "position": self.position,
            "pending": sorted(self.running) + list(self.requeue),
            "buffer": self.buffer.snapshot(),
            "counters": asdict(self.counters), "elapsed": self.elapsed(),
            "timers": dict(self._timers), "eval_history": self.eval_history,
            "resume_key": self.s.resume_key,
        }

    def load_state_dict(self, st: dict) -> None:
        """Load a state: ``buffer`` a :class:`GroupBuffer` (what :meth:`restore` reads), or groups (or
        their dicts, as controller.json held them before ``buffer.bin``)."""
        self.version = int(st["version"])
        self.position = int(st["position"])
        self.requeue = deque(int(p) for p in st["pending"])
        buf = st["buffer"]
        if not isinstance(buf, GroupBuffer):
            groups, buf = buf, self._new_buffer()
            buf.extend(g if isinstance(g, Group) else Group.from_state(g) for g in groups)
        self.buffer.close()
        self.buffer = buf
        self.counters = Counters(**st["counters"])
        self._elapsed_before = float(st.get("elapsed", 0.0))
        self._timers = Counter(st.get("timers", {}))
        self.eval_history = list(st.get("eval_history", []))
        self.gate.restore(self.version, self.version * self.s.batch_size + len(self.buffer))

    async def save_checkpoint(self) -> Path:
        """Snapshot the state now (groups finishing during the write stay "pending" in it), then
        write it in a thread so rollouts go on."""
        state = self.state_dict()
        self.buffer.pin()  # the spilled groups of the snapshot stay in the spill file until copied
        try:
            return await asyncio.to_thread(self._write_checkpoint, state)
        finally:
            self.buffer.unpin()

    def _write_checkpoint(self, state: dict) -> Path:
        """Atomic: write step_N.tmp (trainer + buffer.bin + controller.json + COMPLETE), then rename.
        The buffered groups are streamed to buffer.bin group by group (a spilled one copied from the
        spill file as it is), so the write holds no second copy of the buffer; controller.json
        records their count and bytes."""
        final = self.ckpt_dir / f"step_{state['version']:08d}"
        tmp = final.with_name(final.name + ".tmp")
        slots = state["buffer"]
        state = {k: v for k, v in state.items() if k != "buffer"}
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            self.trainer.save(tmp / "trainer")
            with open(tmp / BUFFER_FILE, "wb") as f:
                nbytes = self.buffer.write(slots, f)
            state["buffer_file"] = {"name": BUFFER_FILE, "groups": len(slots), "bytes": nbytes}
            _write_json(tmp / STATE_FILE, state)
            _fsync_tree(tmp)  # everything COMPLETE promises is on disk before the marker is
            _write_json(tmp / COMPLETE_MARKER, "ok")
            _fsync_dir(tmp)
        except (OSError, RuntimeError) as e:  # a full disk shows up as torch's "unexpected pos"
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failed(tmp, e) from e
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(self.ckpt_dir)
        for old in list_checkpoints(self.ckpt_dir)[: -self.s.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        _failpoint_after_checkpoint(state["version"])
        return final

    def restore(self, path: Path) -> None:
        """Restore the trainer and this controller from the checkpoint at ``path``.

        Raises :class:`ResumeMismatch` when the checkpoint was written with another ``resume_key``,
        :class:`CorruptCheckpoint` when it cannot be read or does not agree with itself (the trainer's
        version against controller.json's, the data position against what it accounts for), or when
        the trainer's load fails on a damaged file; the controller's state is loaded last."""
        st = read_state(path)
        self.check_resume_key(st, path)
        # the buffered groups first: a damaged one makes the checkpoint corrupt, found before any load
        buf = self._read_buffer(st, path)
        try:
            self._check_consistent(st, len(buf), path)
            check = getattr(self.trainer, "check", None)  # optional: a trainer without it is trusted
            try:
                trainer_version = check(path / "trainer") if check is not None else None
            except Exception as e:  # noqa: BLE001 - whatever the trainer's reader raised, named with the path
                raise CorruptCheckpoint(f"checkpoint {path}: trainer state unreadable: {e!r}") from e
            if trainer_version is not None and trainer_version != st["version"]:
                raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} says version {st['version']}, the "
                                        f"trainer state in it version {trainer_version!r}")
            self.trainer.load(path / "trainer")  # a damaged shard raises CorruptCheckpoint (TrainerPort)
        except BaseException:
            buf.close()
            raise
        self.load_state_dict({**st, "buffer": buf})
        log.info("resumed from %s: version %d, position %d, %d buffered, %d to regenerate", path,
                 self.version, self.position, len(self.buffer), len(self.requeue))

    def _check_consistent(self, st: dict, n_buffered: int, path: Path) -> None:
        """Every trained, buffered and pending group has its own position below ``position``: a
        controller.json whose position is smaller than what it accounts for (an edited or mixed-up
        file) would hand out positions again, training prompts twice."""
        accounted = st["version"] * self.s.batch_size + n_buffered + len(st["pending"])
        if st["position"] < accounted:
            raise CorruptCheckpoint(
                f"checkpoint {path}: {STATE_FILE} says position {st['position']}, but its version {st['version']} "
                f"x batch size {self.s.batch_size} + {n_buffered} buffered + {len(st['pending'])} pending groups "
                f"need {accounted} positions")

    def _read_buffer(self, st: dict, path: Path) -> GroupBuffer:
        """The checkpoint's buffered groups in a new buffer (spilling past the bound as they are
        read, group by group): from buffer.bin, or from controller.json as older checkpoints held
        them. CorruptCheckpoint when a group is unreadable or the file is short or too long."""
        buf = self._new_buffer()
        try:
            buf.extend(checkpoint_groups(path, st))
        except CorruptCheckpoint:
            buf.close()
            raise
        return buf

    def restore_newest(self) -> Path | None:
        """Restore from the newest readable checkpoint (None when there is none). An unreadable one
        is moved aside to ``<name>.corrupt`` with a warning naming it, and the previous is tried.
        When checkpoints exist (or were moved aside before) and none is readable, this raises
        :class:`CorruptCheckpoint`: starting again at step 0 is the user's decision
        (``experiment.resume=false``), never a silent one."""
        tried = []
        for path in reversed(list_checkpoints(self.ckpt_dir)):
            try:
                self.restore(path)
                return path
            except CorruptCheckpoint as e:
                aside = path.with_name(path.name + ".corrupt")
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(path, aside)
                tried.append(aside)
                log.warning("%s; moved it to %s and falling back to the previous checkpoint", e, aside)
        corrupt = sorted(self.ckpt_dir.glob("step_*.corrupt")) if self.ckpt_dir.is_dir() else []
        if corrupt:
            raise CorruptCheckpoint(
                f"no readable checkpoint in {self.ckpt_dir}: {', '.join(p.name for p in corrupt)} could not be "
                f"read (moved aside; the reasons are in the log). Refusing to start again at step 0 silently: "
                f"restore a checkpoint by renaming it back to step_N, or start over with "
                f"experiment.resume=false (the previous run is moved aside, nothing is deleted)")
        return None

    def check_resume_key(self, st: dict, path: Path) -> None:
        check_resume_key(st, self.s.resume_key, path)

    # ------------------------------------------------------------- main loop
    def _emit(self, m: dict) -> None:
        for cb in self.callbacks:
            cb(m)

    async def run(self, resume_from: Path | None = None) -> dict:
        """Train until ``total_steps``. ``resume_from`` restores that checkpoint first; a controller
        already restored (:meth:`restore_newest`) goes on from its version."""
        self._t_start = time.perf_counter()
        if resume_from is not None:
            self.restore(resume_from)
        if self.version > 0:
            # the servers start from the initial weights: bring them to the restored version
            await self.rollout.pause()
            await self.syncer.sync(self.version)
            await self.rollout.resume()
        self.gate.set_version(self.version)
        admission = asyncio.create_task(self._admission_loop(), name="admission")
        self.heap.start()
        try:
            if self.s.eval_at_start and self.version == 0 and self.s.eval_every >= 0:
                ev = await self.evaluate()
                if ev:
                    self._emit({"kind": "eval", **ev})
            while self.version < self.s.total_steps:
                m = await self._train_step()
                if self.s.dump_samples:
                    self._emit({"kind": "samples", "step": m["step"], "groups": self._last_batch_dump})
                self.history.append(m)
                self._emit({"kind": "train", **m})
                last = self.version >= self.s.total_steps
                if (self.s.eval_every and self.version % self.s.eval_every == 0) or last:
                    ev = await self.evaluate()
                    if ev:
                        self._emit({"kind": "eval", **ev})
                if (self.s.checkpoint_every and self.version % self.s.checkpoint_every == 0) or last:
                    t0 = time.perf_counter()
                    path = await self.save_checkpoint()
                    self._timers.update(checkpoint_s=time.perf_counter() - t0)
                    self._emit({"kind": "checkpoint", "step": self.version, "path": str(path)})
        finally:
            admission.cancel()
            for t in list(self.running.values()):
                t.cancel()
            await asyncio.gather(admission, *self.running.values(), return_exceptions=True)
            self.heap.stop()
        return self.summary()

    def summary(self) -> dict:
        stal = Counter(s for m in self.history for s in m["staleness"])
        return {
            "steps": self.version, "elapsed_s": self.elapsed(), "counters": asdict(self.counters),
            "timers": dict(self._timers), "heap_trim": self.heap.stats(),
            "staleness_hist": {str(k): v for k, v in sorted(stal.items())},
            "eval": self.eval_history[-1] if self.eval_history else None,
            "eval_first": self.eval_history[0] if self.eval_history else None,
        }


# ----------------------------------------------------------------------------- helpers


def _group_of(pos: int, row: int, admitted_version: int, trajs: list, **fields) -> Group:
    """A group (or a part of one: some of its episodes) from trajectories, sharing their arrays;
    the oldest version of each was kept as its turns were added (no per-token work here)."""
    return Group(position=pos, row=row, admitted_version=admitted_version, prompt_ids=trajs[0].prompt_ids,
                 outputs=[tr.output_ids for tr in trajs], behav_logprobs=[tr.behav_logprobs for tr in trajs],
                 versions=[tr.output_versions for tr in trajs], rewards=[float(tr.reward) for tr in trajs],
                 finish_reasons=[tr.finish_reason for tr in trajs], prompts=[tr.prompt_ids for tr in trajs],
                 loss_masks=[tr.loss_mask for tr in trajs], infos=[_numbers(tr.info) for tr in trajs],
                 min_versions=[tr.min_model_version() for tr in trajs], **fields)


def _merge_parts(parts: list[Group], **fields) -> Group:
    """One group from its parts (each some of its episodes, in episode order), their arrays as they are."""
    first = parts[0]

    def cat(name: str) -> list:
        return [x for p in parts for x in getattr(p, name)]

    return Group(position=first.position, row=first.row, admitted_version=first.admitted_version,
                 prompt_ids=first.prompt_ids, **{n: cat(n) for n in _PART_LISTS}, **fields)


_PART_LISTS = ("outputs", "behav_logprobs", "versions", "rewards", "finish_reasons", "prompts", "loss_masks",
               "infos", "min_versions")


class ResumeMismatch(RuntimeError):
    """The checkpoint was written by a run whose data order differs from this one."""


class CorruptCheckpoint(RuntimeError):
    """A checkpoint marked complete cannot be read; the message names its path."""


def check_resume_key(st: dict, key: dict, path: Path) -> None:
    """Refuse the checkpoint state ``st`` (at ``path``) when its data order (resume key) differs from
    ``key``; the message names every changed key with both values."""
    saved = st.get("resume_key")
    if saved is None:
        log.warning("checkpoint %s records no resume key (written by an older version); resuming "
                    "without checking that the data order is unchanged", path)
        return
    changed = sorted(k for k in set(saved) | set(key) if saved.get(k) != key.get(k))
    if changed:
        diff = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {key.get(k)!r} now" for k in changed)
        raise ResumeMismatch(
            f"cannot resume from {path}: the data order depends on {', '.join(changed)}, which changed "
            f"({diff}). Resuming would train some prompts twice and skip others. Put the old values "
            f"back, or start over with experiment.resume=false (the previous run is moved aside).")


def _numbers(info: dict) -> dict:
    """The numeric entries of a trajectory's info (what metrics can average)."""
    return {str(k): float(v) for k, v in (info or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _staleness_quantiles(staleness: list[int]) -> dict[str, int]:
    """p50 and p90 (nearest rank below) of the consumed groups' staleness."""
    srt = sorted(staleness)
    return {f"staleness_p{q}": srt[(q * (len(srt) - 1)) // 100] for q in (50, 90)}


def _means(infos: list[dict]) -> dict:
    """Mean of each key over the dicts that have it."""
    sums, counts = Counter(), Counter()
    for d in infos:
        for k, v in d.items():
            sums[k] += v
            counts[k] += 1
    return {k: sums[k] / counts[k] for k in sums}


def read_state(path: Path) -> dict:
    """The controller state of the checkpoint at ``path``, every entry checked (types, ranges, no
    unknown entry: :func:`check_state`); CorruptCheckpoint names the file and the entry otherwise."""
    f = path / STATE_FILE
    try:
        st = json.loads(f.read_text())
        check_state(st)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: {f.name} unreadable: {e!r}") from e
    return st


def _is_int(v, low: int = 0) -> bool:
    return type(v) is int and v >= low


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_count_map(name: str, d) -> None:
    if not isinstance(d, dict) or not all(isinstance(k, str) and _is_int(v) for k, v in d.items()):
        raise ValueError(f"{name}: expected a mapping of names to counts >= 0, got {d!r:.200}")


_COUNTER_FIELDS = {f.name: f.type for f in fields(Counters)}
_STATE_ENTRIES = ("version", "position", "pending", "counters", "elapsed", "timers", "eval_history", "resume_key",
                  "buffer_file", "buffer")


def check_state(st) -> None:
    """Raise ValueError naming the entry when ``st`` (a parsed controller.json) is not a controller
    state as :meth:`Controller.state_dict` and ``_write_checkpoint`` write it: required entries
    present, counts integers >= 0 (never booleans), pending positions distinct and below
    ``position``, the buffer file named ``buffer.bin`` in the checkpoint, no unknown entry. Older
    checkpoints (groups in controller.json, fewer counters) pass."""
    if not isinstance(st, dict):
        raise ValueError(f"expected a JSON object, got {type(st).__name__}")
    unknown = sorted(set(st) - set(_STATE_ENTRIES))
    if unknown:
        raise ValueError(f"unknown entries {unknown}")
    for key in ("version", "position"):
        if not _is_int(st[key]):
            raise ValueError(f"{key}: expected an integer >= 0, got {st[key]!r:.100}")
    pending = st["pending"]
    if not isinstance(pending, list) or not all(_is_int(p) for p in pending):
        raise ValueError(f"pending: expected a list of positions >= 0, got {pending!r:.200}")
    if len(set(pending)) != len(pending) or any(p >= st["position"] for p in pending):
        raise ValueError(f"pending: positions must be distinct and below position {st['position']}, got "
                         f"{pending!r:.200}")
    counters = st["counters"]
    if not isinstance(counters, dict) or set(counters) - set(_COUNTER_FIELDS):
        raise ValueError(f"counters: expected a mapping of {sorted(_COUNTER_FIELDS)}, got {counters!r:.200}")
    for k, v in counters.items():
        if _COUNTER_FIELDS[k] == "dict":
            _check_count_map(f"counters.{k}", v)
        elif not _is_int(v):
            raise ValueError(f"counters.{k}: expected an integer >= 0, got {v!r:.100}")
    if "elapsed" in st and not (_is_number(st["elapsed"]) and st["elapsed"] >= 0):
        raise ValueError(f"elapsed: expected a number of seconds >= 0, got {st['elapsed']!r:.100}")
    timers = st.get("timers", {})
    if not isinstance(timers, dict) or not all(isinstance(k, str) and _is_number(v) for k, v in timers.items()):
        raise ValueError(f"timers: expected a mapping of names to seconds, got {timers!r:.200}")
    evals = st.get("eval_history", [])
    if not isinstance(evals, list) or not all(isinstance(e, dict) for e in evals):
        raise ValueError(f"eval_history: expected a list of objects, got {evals!r:.200}")
    if st.get("resume_key") is not None and not isinstance(st["resume_key"], dict):
        raise ValueError(f"resume_key: expected an object, got {st['resume_key']!r:.200}")
    ref = st.get("buffer_file")
    if ref is None:  # checkpoints before buffer.bin held the groups in this file
        if not isinstance(st["buffer"], list):
            raise ValueError(f"buffer: expected a list of groups, got {type(st['buffer']).__name__}")
    elif not (isinstance(ref, dict) and set(ref) == {"name", "groups", "bytes"} and ref["name"] == BUFFER_FILE
              and _is_int(ref["groups"]) and _is_int(ref["bytes"])):
        raise ValueError(f"buffer_file: expected {{'name': {BUFFER_FILE!r}, 'groups': N, 'bytes': N}}, "
                         f"got {ref!r:.200}")
    elif "buffer" in st:
        raise ValueError("buffer: not expected beside buffer_file")


def checkpoint_groups(path: Path, st: dict | None = None) -> Iterator[Group]:
    """The buffered groups of the checkpoint at ``path`` (``st``: its controller state, read when not
    given), one at a time, FIFO: from ``buffer.bin``, or from controller.json as checkpoints before
    buffer.bin held them. CorruptCheckpoint names the file when a group is unreadable or the file is
    short or too long."""
    st = read_state(path) if st is None else st
    ref, where = st.get("buffer_file"), STATE_FILE
    try:
        if ref is None:
            for g in st["buffer"]:
                yield Group.from_state(g)
            return
        where = str(ref["name"])
        f = path / where
        if f.stat().st_size != int(ref["bytes"]):
            raise ValueError(f"{f.stat().st_size} bytes, {STATE_FILE} says {ref['bytes']}")
        with open(f, "rb") as fh:
            for kw in _read_records(fh, int(ref["groups"]), where):
                yield Group(**kw)
    except (OSError, ValueError, TypeError, KeyError, OverflowError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: a buffered group in {where} is unreadable: {e!r}") from e


HANG_AFTER_CHECKPOINT_ENV = "AREAL_FAST_TEST_HANG_AFTER_CHECKPOINT"


def _failpoint_after_checkpoint(version: int) -> None:
    """Test hook: with ``AREAL_FAST_TEST_HANG_AFTER_CHECKPOINT=N`` the run stops making progress
    right after checkpoint N is complete, so a crash test can kill it at a point it controls (a run
    that may finish, or whose retention may delete checkpoint N, before the kill makes tests flaky)."""
    if os.environ.get(HANG_AFTER_CHECKPOINT_ENV) == str(version):
        log.warning("%s=%d: holding the run after this checkpoint (test hook)", HANG_AFTER_CHECKPOINT_ENV, version)
        threading.Event().wait()


_CKPT_NAME = re.compile(r"step_\d{8}")


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``step_N.tmp``, ``step_N.corrupt`` and a directory
    without COMPLETE are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    out = [p for p in ckpt_dir.iterdir()
           if p.is_dir() and _CKPT_NAME.fullmatch(p.name) and (p / COMPLETE_MARKER).is_file()]
    return sorted(out, key=lambda p: p.name)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    cks = list_checkpoints(ckpt_dir)
    return cks[-1] if cks else None


def _write_json(path: Path, obj) -> None:
    # one shot: the C encoder (json.dump streams through the Python one); arrays as compact columns
    text = json.dumps(obj, default=columns.json_default)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
