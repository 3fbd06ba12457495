"""Continuous-batching scheduler of the embedded engine (one thread owns the model).

Why our own loop and not transformers' continuous-batching manager: that manager (paged cache,
``generate_batch`` / ``init_continuous_batching``) returns neither SGLang's logprobs of the *sampled*
token at the request's temperature nor a cancellation that hands back the partial output at a step
boundary, and it cannot stop for an in-place weight load. This loop is ~300 lines and does exactly that.

Each iteration of the scheduler thread:
  1. run queued control commands (abort, pause, continue, weight loads) -- they touch the model, so
     they run here, between two steps, never concurrently with a forward pass;
  2. admit waiting requests (up to ``max_running``), in vLLM's order (``policy``: ``fcfs``, first
     come first served, or ``priority``, the lowest ``priority`` first and arrival among equals,
     as vLLM's ``--scheduling-policy``): prefill them in groups of equal length
     (prompt plus any output kept from before a ``retract`` pause, which is recomputed)
     (no padding inside a prefill, so no attention row is ever fully masked), sample their first
     token, then merge their KV cache into the running batch by left padding (pad keys/values are
     zero and masked out);
  3. one decode step for every running request: input [B, 1], 2-D attention mask [B, L + 1],
     explicit position ids (left padding shifts positions, so they are tracked per row);
  4. finished rows leave the batch (``batch_select_indices``) and leading all-pad columns are cut.

With ``routing`` set (``--enable-return-routed-experts``, ``engine/routing_capture.py``) every
prefill and decode forward that holds a request asking for its routed experts records them per
request and position.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from areal_fast.backends.vllm.compat import SCHEDULING_POLICIES  # the twin queues as vLLM does
from areal_fast.embedded.sampling import SamplingParams, sample_batch
from areal_fast.rollout.config import PAUSE_MODES  # the SGLang modes the engine imitates: the client's names

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """One /generate call inside the engine."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_finish: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: dict | None = None
    error: str | None = None  # the model failed while serving this request (HTTP 500)
    aborted_in_waiting: bool = False  # aborted from the waiting queue (SGLang 0.5.6-0.5.8: no weight_version)
    retractions: int = 0  # times a retract pause dropped its KV (recomputed on continue)
    delivered: bool = False
    created: float = field(default_factory=time.monotonic)
    next_input: int = -1  # last sampled token, not yet in the KV cache
    position: int = 0  # position id of next_input
    lora: str | None = None  # the adapter it names (engine/lora.py); None: the base model
    routing_start: int | None = None  # routed experts asked for, from this position (None: not asked)
    routing: object = None  # np.ndarray [positions, layers, top_k] int16 (engine/routing_capture.py)
    routing_end: int = 0  # positions [0, routing_end) recorded
    priority: int = 0  # vLLM's request priority: lower runs first under the priority policy
    arrival: int = 0  # the order of submission (set by Scheduler.submit): the tie-break among equal priorities

    def prefill_ids(self) -> list[int]:
        """What a prefill computes KV for: the prompt, plus the output kept over a retract."""
        return self.input_ids + self.output_ids


class DuplicateRid(ValueError):
    """A /generate whose rid is already waiting or running (SGLang >= 0.5.15 answers 400)."""


class SchedulerDown(RuntimeError):
    """The scheduler thread has stopped (shut down, or crashed the way SGLang's scheduler does)."""




class Scheduler:
    """Owns the HF model; everything that touches it runs on this object's thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        max_running: int = 256,
        seed: int = 0,
        weight_version: str = "default",
        tokenizer=None,
        policy: str = "fcfs",
    ):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._arrivals = 0
        self.model = model
        self.device = next(model.parameters()).device
        self.eos_token_ids = set(eos_token_ids)
        self.max_running = max_running
        self.weight_version = weight_version
        self.tokenizer = tokenizer
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.paused = False
        self.pause_mode: str | None = None
        self.crash_reason: str | None = None  # set when the scheduler died (as SGLang's does on some errors)
        self.last_output = time.monotonic()  # last time any request made progress (health probes read it)
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._commands: collections.deque[tuple[Callable[[], object], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._rids: set[str] = set()
        self._stop = False
        # running batch state
        self._rows: list[Request] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = left padding
        self.steps = 0
        self.lora = None  # engine/lora.py's LoRAServing when the engine serves adapters
        self.routing = None  # engine/routing_capture.py's RoutingCapture with --enable-return-routed-experts
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ------------------------------------------------------------------ public, thread-safe
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Request) -> None:
        """Queue a request; raise DuplicateRid if its rid is in flight, SchedulerDown if stopped."""
        with self._cv:
            if self._stop:
                raise SchedulerDown(self.crash_reason or "the engine is shutting down")
            if req.rid in self._rids:
                raise DuplicateRid(f"rid {req.rid!r} is already running or waiting")
            self._rids.add(req.rid)
            self._arrivals += 1
            req.arrival = self._arrivals
            self._waiting.append(req)
            self._cv.notify_all()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the scheduler thread between two steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stop:
                fut.set_exception(SchedulerDown(self.crash_reason or "the engine is shutting down"))
                return fut
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    def num_in_flight(self) -> int:
        with self._cv:
            return len(self._rids)

    # ------------------------------------------------------------------ commands (scheduler thread)
    def abort(self, rid: str | None, message: str) -> int:
        """Abort every request whose rid STARTS WITH ``rid`` (SGLang's rule), or everything when None.

        Returns how many requests were aborted.
        """
        n = 0
        with self._cv:
            keep = collections.deque()
            for req in self._waiting:
                if rid is None or req.rid.startswith(rid):
                    req.aborted_in_waiting = True
                    self._finish_waiting(req, {"type": "abort", "message": "Abort in waiting queue"})
                    n += 1
                else:
                    keep.append(req)
            self._waiting = keep
        drop = [i for i, r in enumerate(self._rows) if rid is None or r.rid.startswith(rid)]
        for i in drop:
            self._rows[i].finish_reason = {"type": "abort", "message": message}
        n += len(drop)
        if drop:
            self._retire_finished()
        return n

    def pause(self, mode: str = "abort") -> None:
        """SGLang's three pause modes.

        - abort: every request (running and waiting) ends with finish_reason abort;
        - in_place: running requests stay in the batch with their KV cache (computed by the weights of
          before any update made while paused) and continue from there;
        - retract: running requests go back to the front of the waiting queue and their KV cache is
          dropped; after continue their prompt + output so far is prefilled again, by the weights
          current then.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused, self.pause_mode = True, mode
        if mode == "abort":
            self.abort(None, "Abort by pause_generation")
        elif mode == "retract" and self._rows:
            rows, self._rows, self._cache, self._mask = self._rows, [], None, None
            for r in rows:
                r.retractions += 1
            with self._cv:
                self._waiting.extendleft(reversed(rows))

    def resume(self) -> None:
        self.paused, self.pause_mode = False, None

    def is_idle(self) -> bool:
        """SGLang's flush condition: nothing running, and nothing waiting unless generation is paused."""
        with self._cv:
            return not self._rows and (self.paused or not self._waiting)

    def has_running(self) -> bool:
        return bool(self._rows)

    def uses_adapter(self, name: str) -> bool:
        """Whether a running or waiting request names LoRA adapter ``name``."""
        with self._cv:
            return any(r.lora == name for r in [*self._rows, *self._waiting])

    def crash(self, reason: str) -> None:
        """Stop serving for good, as SGLang's scheduler process does when an assertion fails."""
        log.error("scheduler crashed: %s", reason)
        self.crash_reason = reason
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._commands or (self._runnable() and (self._waiting or self._rows))):
                    self._cv.wait()
                if self._stop:
                    break
                cmds = list(self._commands)
                self._commands.clear()
            for fn, fut in cmds:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - delivered to the HTTP handler
                    fut.set_exception(e)
            if self._stop:  # a command crashed the scheduler
                break
            if not self._runnable():
                continue
            try:
                with torch.inference_mode():
                    self._admit()
                    if self._rows:
                        self._decode_step()
            except Exception as e:  # noqa: BLE001 - fail the batch (HTTP 500, clients fail over), keep serving
                log.exception("engine step failed; failing %d running requests", len(self._rows))
                self._fail_running(f"{type(e).__name__}: {e}")
        # shutting down: nobody must hang on a future or a request
        reason = self.crash_reason or "server shutting down"
        with self._cv:
            cmds = list(self._commands)
            self._commands.clear()
        for _, fut in cmds:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(SchedulerDown(reason))
        rows, self._rows, self._cache, self._mask = self._rows, [], None, None
        for r in rows:
            r.error = reason if self.crash_reason else None
            r.finish_reason = {"type": "abort", "message": f"Abort: {reason}"}
            self._deliver(r)
        self.abort(None, f"Abort: {reason}")

    def _runnable(self) -> bool:
        return not self.paused

    def _admit(self) -> None:
        admitted: list[Request] = []
        with self._cv:
            room = self.max_running - len(self._rows)
            if self.policy == "priority" and 0 < room < len(self._waiting):  # vLLM's heap: (priority, arrival)
                ranked = sorted(self._waiting, key=lambda r: (r.priority, r.arrival))
                admitted, self._waiting = ranked[:room], collections.deque(ranked[room:])
            else:  # first come first served (a retract pause put its requests back at the front)
                while self._waiting and len(self._rows) + len(admitted) < self.max_running:
                    admitted.append(self._waiting.popleft())
        # prompts of equal length prefill together without padding (GRPO groups share a prompt):
        # 64 prompts of 32 tokens prefill in one forward instead of 64
        groups: dict[int, list[Request]] = {}
        for req in admitted:
            if req.params.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
                self._deliver(req)
            else:
                groups.setdefault(len(req.prefill_ids()), []).append(req)
        try:
            for length, reqs in groups.items():
                self._prefill_group(length, reqs)
        except Exception as e:
            for r in admitted:  # nobody may wait forever for a request that was popped from the queue
                if not r.delivered and r not in self._rows:
                    r.error = f"{type(e).__name__}: {e}"
                    r.finish_reason = {"type": "abort", "message": r.error}
                    self._deliver(r)
            raise

    def _prefill_group(self, length: int, reqs: list[Request]) -> None:
        ids = torch.tensor([r.prefill_ids() for r in reqs], device=self.device)
        if self.lora is not None:
            self.lora.activate([r.lora for r in reqs])
        out = self._forward(reqs, [0] * len(reqs), length, input_ids=ids, past_key_values=self._new_cache(),
                            use_cache=True, logits_to_keep=1)
        toks, lps = sample_batch(out.logits[:, -1], [r.params for r in reqs], self.generator)
        for r, t, lp in zip(reqs, toks.tolist(), lps.tolist()):
            r.position = length
            self._append_token(r, t, lp)
        keep = [i for i, r in enumerate(reqs) if r.finish_reason is None]
        for r in reqs:
            if r.finish_reason is not None:
                self._deliver(r)
        if keep:
            cache = out.past_key_values
            if len(keep) < len(reqs):
                cache.batch_select_indices(torch.tensor(keep, device=self.device))
            self._merge([reqs[i] for i in keep], cache, length)

    def _decode_step(self) -> None:
        rows = self._rows
        dev = self.device
        ids = torch.tensor([[r.next_input] for r in rows], device=dev)
        pos = torch.tensor([[r.position] for r in rows], device=dev)
        mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=self._mask.dtype, device=dev)], dim=1)
        if self.lora is not None:
            self.lora.activate([r.lora for r in rows])
        out = self._forward(rows, [r.position for r in rows], 1, input_ids=ids, attention_mask=mask, position_ids=pos,
                            past_key_values=self._cache, use_cache=True)
        self._mask = mask
        self.steps += 1
        toks, lps = sample_batch(out.logits[:, -1], [r.params for r in rows], self.generator)
        for r, t, lp in zip(rows, toks.tolist(), lps.tolist()):
            r.position += 1
            self._append_token(r, t, lp)
        self._retire_finished()

    # ------------------------------------------------------------------ helpers
    def _forward(self, reqs: list[Request], starts: list[int], n: int, **inputs):
        """The model's forward over ``reqs`` (``n`` new tokens each, request i's at positions
        ``starts[i] ..``), recording the routed experts of the requests that asked for them."""
        if self.routing is None or all(r.routing_start is None for r in reqs):
            return self.model(**inputs)
        with self.routing.recording() as got:
            out = self.model(**inputs)
        self.routing.store(reqs, got, starts, n)
        return out

    def _append_token(self, req: Request, tok: int, lp: float) -> None:
        self.last_output = time.monotonic()
        req.output_ids.append(tok)
        req.logprobs.append(lp)
        req.versions.append(self.weight_version)
        req.next_input = tok
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            req.finish_reason = {"type": "stop", "matched": tok}
        elif p.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(req.output_ids[-32:], skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    req.finish_reason = {"type": "stop", "matched": s}
                    break
        if req.finish_reason is None and len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _merge(self, reqs: list[Request], cache, length: int) -> None:
        """Add prefilled rows (all ``length`` long) to the running batch, left padding the shorter side."""
        new_mask = torch.ones(len(reqs), length, dtype=torch.long, device=self.device)
        if self._cache is None:
            self._cache, self._mask, self._rows = cache, new_mask, list(reqs)
            return
        target = max(self._mask.shape[1], length)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, target), _left_pad(new_layer.keys, target)])
            old_layer.values = torch.cat([_left_pad(old_layer.values, target), _left_pad(new_layer.values, target)])
        self._mask = torch.cat([_left_pad(self._mask, target), _left_pad(new_mask, target)], dim=0)
        self._rows.extend(reqs)

    def _retire_finished(self) -> None:
        done = [r for r in self._rows if r.finish_reason is not None]
        if not done:
            return
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        if keep:
            idx = torch.tensor(keep, device=self.device)
            self._cache.batch_select_indices(idx)
            self._mask = self._mask[idx]
            self._rows = [self._rows[i] for i in keep]
            # cut columns that are padding in every remaining row (they only cost attention FLOPs)
            used = self._mask.sum(dim=0) > 0
            first = int(used.nonzero()[0])
            if first > 0:
                for layer in self._cache.layers:
                    layer.keys = layer.keys[:, :, first:]
                    layer.values = layer.values[:, :, first:]
                self._mask = self._mask[:, first:]
        else:
            self._rows, self._cache, self._mask = [], None, None
        for r in done:
            self._deliver(r)

    def _fail_running(self, message: str) -> None:
        rows, self._rows, self._cache, self._mask = self._rows, [], None, None
        for r in rows:
            r.error = message
            r.finish_reason = {"type": "abort", "message": message}
            self._deliver(r)

    def _finish_waiting(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        self._rids.discard(req.rid)
        req.delivered = True
        self.last_output = time.monotonic()
        req.on_finish(req)

    def _deliver(self, req: Request) -> None:
        self.last_output = time.monotonic()
        with self._cv:
            self._rids.discard(req.rid)
        req.delivered = True
        req.on_finish(req)


def _left_pad(t: torch.Tensor, target: int) -> torch.Tensor:
    """Left-pad dim -2 of a KV tensor [B, H, L, D] (or dim -1 of a mask [B, L]) with zeros to ``target``."""
    dim = -1 if t.dim() == 2 else -2
    missing = target - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
