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
    +-------------------+   trainer.train(samples, v)   (a thread; rollouts go on meanwhile)
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

The weight version has one owner: ``Controller.version``. The controller decides the next one
and tells the others: the trainer (``trainer.train(samples, v)`` trains the weights of version v
into v + 1; ``trainer.save(path, v)``) and the servers (``syncer.sync(v + 1)``, down through the
trainer's ranks to the transports, which label the servers' weights with it; the tokens they
generate carry it back as data). Nobody else counts versions.

Checkpoints hold the controller state: data position, version, counters, the finished groups
still in the buffer, and the positions of groups still generating (they are regenerated after a
restart: nothing is lost, and nothing trained twice because a checkpoint is written only at a
step boundary, atomically, together with the trainer state). After a restore at version v the
gate is restored with ``accepted = v * B + len(buffer)``, so the bound holds as before. The
format (layout, names, atomic write, validation, the data-order check, moving aside a checkpoint
that cannot be read) is ``areal_fast.checkpoint``'s.

This module does no tensor math. Its collaborators are narrow ports (see :class:`RolloutPort`,
:class:`TrainerPort`, :class:`SyncPort`, :class:`RewardPort`, :class:`Gate`, which
``areal_fast.rollout.staleness.StalenessManager`` implements); ``areal_fast.launch.runtime``
builds them from the real parts, tests use fakes for all but the gate.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from areal_fast import checkpoint
from areal_fast.agent.client import AgentClient
from areal_fast.buffer import MB, GroupBuffer, checkpoint_groups
from areal_fast.checkpoint import Counters
from areal_fast.group import Group, group_of, merge_parts, numbers
from areal_fast.heap import HeapTrimmer
from areal_fast.rollout.config import DEFAULT_BUFFER_MEMORY_MB
from areal_fast.rollout.staleness import ADMISSION_ORDER
from areal_fast.sample import Sample
from areal_fast.workflow import DEFAULT_WORKFLOW, EpisodeEngine, EpisodeFailed, check_trajectories, load_workflow

log = logging.getLogger(__name__)

# Groups admitted between two yields to the event loop. Admitting 1,024 groups of 16 at once made
# one loop iteration start 16,384 requests (~10 s without a break at 256 servers); 4 groups (64
# requests) keep each slice to milliseconds.
ADMIT_SLICE = 4


# ----------------------------------------------------------------------------- ports


class RolloutPort(Protocol):
    # the one sample record (``areal_fast.sample``), filled by the client: the workflow returns it or
    # extends another with it, the buffer holds it, the trainer reads it
    async def generate(self, input_ids, sampling: dict, rid: str) -> Sample: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...


class TrainerPort(Protocol):
    # blocking; run in a thread. The buffered groups' samples as they are (``areal_fast.sample.Sample``,
    # per-token fields arrays). ``version``: the controller's; train turns the weights of that
    # version into version + 1, save records it with the weights (the trainer counts nothing)
    def train(self, samples: list[Sample], version: int) -> dict: ...
    def save(self, path: Path, version: int) -> None: ...
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
        self.ckpt_dir = checkpoint.checkpoints_dir(settings.output_dir)
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._wake = asyncio.Event()
        self._buffer_ready = asyncio.Event()
        self.trainer_lock = asyncio.Lock()  # one trainer call (train + sync, save, a refill) at a time
        self._failure: BaseException | None = None
        self._t_start = 0.0
        self._elapsed_before = 0.0  # wall seconds of earlier incarnations (resume)
        self._timers = Counter()
        self._last_batch_dump: list = []
        self.generated_tokens, self._gen_mark = 0, None  # finished groups' model tokens; (time, total) at last step
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
                ADMISSION_ORDER.set(self.counters.admitted)  # the group's task inherits it: its requests' priority
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
                             reward_counts=self._reward_counts if training else Counter(),
                             chat_client=AgentClient.for_engine)

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
            row, v0 = self.prompts.at(pos), self.version
            t0 = time.perf_counter()

            async def episode(k: int) -> bool:
                trajs = await self._episode(row, self._engine(f"{self.incarnation}-{pos}-{k}", self.s.sampling))
                if trajs:  # a long-tailed group waits for its longest sample: the others wait here
                    parked.append((k, self.buffer.park(group_of(pos, row.index, v0, trajs))))
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
            group = merge_parts(parts, gen_seconds=time.perf_counter() - t0, episodes_failed=failed)
            del parts
            self.buffer.append(group)
            self.generated_tokens += group.n_tokens
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

    def _train_boxed(self, box: list, version: int) -> dict:
        return self.trainer.train(box.pop(), version)

    async def _train_step(self) -> dict:
        t0 = time.perf_counter()
        at_ask = len(self.buffer)  # groups waiting when the trainer asks (> B: generation runs ahead)
        batch = await self._wait_batch()
        t1 = time.perf_counter()
        samples = [s for g in batch for s in g.samples]  # the records themselves: no conversion
        # handed over in a box the thread empties: the executor's work item (which holds the call's
        # arguments) can outlive the await by a moment, and must not keep the batch alive then
        async with self.trainer_lock:  # the trainer's weights are version + 1 before self.version is
            tmetrics = await asyncio.to_thread(self._train_boxed, [samples], self.version)
            t2 = time.perf_counter()
            # what the metrics need, then the batch's columns go (at full lengths ~0.65 GB for 8k
            # samples): the pause, sync and resume below must not hold them while answers keep arriving
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
        mark, self._gen_mark = self._gen_mark or (self._t_start, 0), (t3, self.generated_tokens)
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
            "buffer_at_ask": at_ask, "gen_tokens_per_s": (self.generated_tokens - mark[1]) / max(t3 - mark[0], 1e-9),
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
                 "samples": [{"text": self.tok.decode(s.output_ids), "reward": s.reward,
                              "versions": s.output_versions.tolist(), "finish": s.finish_reason}
                             for s in g.samples]}
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
            return sum(float(tr.reward) for tr in trajs) / len(trajs), n, _means([numbers(tr.info) for tr in trajs])

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
        """Load a state: ``buffer`` a :class:`GroupBuffer` (what :meth:`restore` reads) or a list of
        groups."""
        self.version = int(st["version"])
        self.position = int(st["position"])
        self.requeue = deque(int(p) for p in st["pending"])
        buf = st["buffer"]
        if not isinstance(buf, GroupBuffer):
            groups, buf = buf, self._new_buffer()
            buf.extend(groups)
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
            async with self.trainer_lock:
                return await asyncio.to_thread(self._write_checkpoint, state)
        finally:
            self.buffer.unpin()

    async def sync_between_steps(self, still=lambda: True) -> dict | None:
        """Send the current version's weights now if ``still()`` holds once no step's train and sync
        or checkpoint runs (``trainer_lock``): servers that joined an empty pool (``elastic.empty_pool``)
        cannot wait for the next step's update, which needs samples only they can make. None if not."""
        async with self.trainer_lock:
            return (await self.syncer.sync(self.version) or {}) if still() else None

    def _write_checkpoint(self, state: dict) -> Path:
        """Write ``state`` as the checkpoint of its version, atomically (``checkpoint.write``)."""
        return checkpoint.write(self.ckpt_dir, state, self.buffer, self.trainer, self.s.keep_last)

    def restore(self, path: Path) -> None:
        """Restore the trainer and this controller from the checkpoint at ``path``; everything is
        checked before the controller's state is loaded (``checkpoint.load``: ResumeMismatch,
        CorruptCheckpoint)."""
        st = checkpoint.load(path, resume_key=self.s.resume_key, batch_size=self.s.batch_size,
                             new_buffer=self._new_buffer, read_groups=checkpoint_groups,
                             trainer=self.trainer)
        self.load_state_dict(st)
        log.info("resumed from %s: version %d, position %d, %d buffered, %d to regenerate", path,
                 self.version, self.position, len(self.buffer), len(self.requeue))

    def restore_newest(self) -> Path | None:
        """Restore from the newest readable checkpoint (None when there is none); an unreadable one is
        moved aside and the previous tried (``checkpoint.restore_newest``)."""
        return checkpoint.restore_newest(self.ckpt_dir, self.restore)

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
            async with self.trainer_lock:
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
