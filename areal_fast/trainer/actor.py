"""The FSDP2 PPO actor: one ``train_batch`` call = one trainer version.

Per batch: broadcast the samples from rank 0 -> group advantages (whole batch) -> split into
``ppo_n_minibatches`` token-balanced minibatches -> plan each into packed micro-batches over the
data-parallel ranks (equal counts everywhere, FSDP2 collectives need it) -> optional batch
normalisation of advantages (all-reduced) -> proximal (and reference) log-prob recompute for
the whole batch before any update -> per minibatch: loss and backward per micro-batch with the
global loss-token count as normalizer, global-norm clipping, AdamW step -> LR schedule step.

Gradient invariance: each rank's loss is ``sum_local / D_global``; FSDP2 averages gradients
over ranks, so the loss is multiplied by the world size to turn that mean into the sum. Under
context parallelism (``train.parallel.cp``, ``parallel/context.py``) the ranks of a group take the
same micro-batches and each computes the loss, the recomputed log-probs and the statistics of its
share of their tokens: every token is on one rank, so the same sums hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from areal_fast import ops
from areal_fast.moe_routing import replay_indices, replay_routing, routing_agreement
from areal_fast.packing import ContextSplit, plan_microbatches
from areal_fast.trainer import advantages as adv_mod
from areal_fast.trainer.batch import Packed, Seq, as_sample, dummy_seq, pack, split_minibatches, to_seq
from areal_fast.trainer.config import OptimConfig, TrainerConfig
from areal_fast.trainer.model import build_policy, hf_name, init_process_group_if_needed
from areal_fast.trainer.parallel import context

# Dense bf16 peak FLOP/s by device name (datasheet numbers, no sparsity).
_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}

_MEAN_STATS = ("ratio_mean", "clip_fraction", "dual_clip_fraction", "approx_kl", "behav_kl",
               "behav_weight_mean", "tis_truncated_fraction", "token_mis_masked_fraction",
               "seq_mis_masked_fraction", "m2po_masked_fraction", "entropy_mean", "kl_mean")


@dataclasses.dataclass
class _Recomputed:
    """The log-probs recomputed before a step's update, keyed by sample index (None: not used)."""

    prox: dict | None
    ref: dict | None
    agree: dict = dataclasses.field(default_factory=lambda: {"differ": 0, "recorded": 0})
    """The servers' MoE routing against the trainer's own in the proximal forward."""
    seconds: float = 0.0
    first_in_forward: bool = False
    """The first minibatch's proximal log-probs are taken in its own training forward (not recomputed)."""


@dataclasses.dataclass
class _StepSums:
    """What the micro-batches of one step add up on this rank (device float64 sums: no host sync)."""

    totals: dict = dataclasses.field(default_factory=dict)
    losses: list = dataclasses.field(default_factory=list)
    grad_norms: list = dataclasses.field(default_factory=list)
    dash: list = dataclasses.field(default_factory=list)
    """(b, p, l, mask) of each micro-batch: the mismatch dashboard."""
    n_tokens: int = 0


def _staleness(seqs: list[Seq], theta_version: int) -> dict[str, float]:
    """Staleness of the trained tokens: versions behind the weights before this step."""
    ages = torch.cat([theta_version - s.versions[s.loss_mask] for s in seqs]).float()
    if not ages.numel():
        return {}
    return dict(staleness_mean=float(ages.mean()), staleness_max=float(ages.max()),
                staleness_p50=float(ages.quantile(0.5, interpolation="lower")),
                staleness_p90=float(ages.quantile(0.9, interpolation="lower")))


def lr_factor(o: OptimConfig, step: int) -> float:
    """The LR multiplier at optimizer step ``step``: linear warm-up, then constant, linear or cosine
    decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.lr_schedule == "constant" or o.total_steps <= o.warmup_steps:
        return 1.0
    frac = min(1.0, (step - o.warmup_steps) / max(1, o.total_steps - o.warmup_steps))
    decay = 1.0 - frac if o.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * decay


class PPOActor:
    """See the package docstring for the public API."""

    prox_from_forward = True
    """The first minibatch's proximal log-probs from its training forward (:meth:`_prox_in_forward`);
    False: the reference, a separate no-grad forward for every minibatch."""

    def __init__(self, config: TrainerConfig):
        if config.model_path is None:
            raise ValueError("TrainerConfig.model_path is required by the actor (a local HF model directory)")
        self.config = config
        self.loss_config = config.loss  # the objective's options at the sampling temperature
        if config.device is not None:
            self.device = torch.device(config.device)
        else:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        init_process_group_if_needed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from areal_fast.trainer.parallel import build_mesh

        # parallel ep = cp = 1: a TrainerMesh of today's one-dimensional FSDP2 mesh, nothing else
        self.pmesh = build_mesh(config.parallel, self.world, self.device)
        self.mesh = self.pmesh.fsdp_mesh
        torch.manual_seed(config.seed)
        # build_policy checks the degrees on the model
        kw = dict(device=self.device, mesh=self.pmesh, param_dtype=config.param_dtype, attn_impl=config.attn_impl,
                  seed=config.seed)
        self.lora = config.lora  # a LoRA actor: only the adapters train (trainer/lora.py, docs/lora.md)
        self.model = build_policy(config.model_path, gradient_checkpointing=config.gradient_checkpointing,
                                  lora=config.lora, **kw)
        self.ref = None
        if self.loss_config.kl_coef > 0:
            self.ref = build_policy(config.model_path, **kw)
            self.ref.requires_grad_(False)
            self.ref.eval()
        self.hf_config = self.model.lm.config
        o = config.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # a LoRA actor: the adapters only
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        # A function of the config alone: a bound method here (self._lr_factor) made the cycle
        # actor -> scheduler -> actor, which kept a dropped actor's model, gradients and optimizer
        # state on the device until the cycle collector ran (bench_trainer's second variant OOMed).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(o, step))
        # The version of these weights, as the caller numbers them: the controller owns the version
        # and tells it (train_batch(samples, version), load_checkpoint); the actor keeps what it was
        # last told for a standalone caller that tells it nothing.
        self.version = 0
        self._grad_observer = None
        self.loss_impl = config.loss_impl  # None: areal_fast.dispatch.select decides
        hidden = self.hf_config.hidden_size
        self._attn_coef = 1.0 / (12 * hidden) if config.packing_cost == "attention" else None
        self._matmul_params = self._count_matmul_params()

    # ---------------------------------------------------------------- schedule
    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.config.optim, step)

    # ---------------------------------------------------------------- batch preparation
    def _broadcast(self, samples):
        if self.world == 1 or not self.config.broadcast_batch:
            return samples
        box = [samples if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _plan(self, seqs: list[Seq], idx: list[int]) -> list[tuple[list[int], list[Seq]]]:
        """This rank's micro-batches of the samples ``idx``: (sample indices, seqs) each, -1 = dummy.

        The samples are split over the data-parallel groups; the ``cp`` ranks of a context-parallel
        group take the same micro-batches (each keeps 1 / cp of their tokens: :meth:`_share`), so a
        micro-batch holds up to ``cp * max_tokens_per_mb`` tokens, ``max_tokens_per_mb`` a rank."""
        dp, cp = self.pmesh.dp, self.pmesh.cp
        need = dp * self.config.min_mbs
        ids = list(idx) + [-1] * max(0, need - len(idx))
        items = [seqs[i] if i >= 0 else dummy_seq() for i in ids]
        plan = plan_microbatches([len(s) for s in items], self.config.max_tokens_per_mb * cp, n_ranks=dp,
                                 min_mbs=self.config.min_mbs, cost=self.config.packing_cost,
                                 attn_coef=self._attn_coef)
        mine = plan.microbatches[self.pmesh.index("dp")]
        return [([ids[j] for j in mb], [items[j] for j in mb]) for mb in mine]

    def _share(self, p: Packed) -> tuple[ContextSplit | None, Packed]:
        """This rank's share of the micro-batch ``p`` under context parallelism (the cut and the
        share; ``(None, p)`` without)."""
        if self.pmesh.cp == 1:
            return None, p
        cut = context.split_packed(p, self.pmesh.cp)
        return cut, context.shard_packed(p, cut, self.pmesh.index("cp"))

    def _cp_block(self):
        """The block inside which the attention layers run Ulysses (forward and backward: a
        checkpointed block runs its forward again in the backward)."""
        return context.ulysses(self.pmesh.group("cp")) if self.pmesh.cp > 1 else contextlib.nullcontext()

    # ---------------------------------------------------------------- forward passes
    # The two LM-head ops; a benchmark subclass swaps in the materialised-logits references.
    def _token_logprobs_op(self, hidden, weight, labels, bias):
        return ops.fused_linear_token_logprobs(hidden, weight, labels, bias=bias,
                                               temperature=self.loss_config.temperature,
                                               chunk_size=self.config.loss_chunk_size, backend=self.loss_impl)

    def _loss_op(self, hidden, weight, labels, behav_logprobs, adv, mask, **kw):
        return ops.fused_linear_decoupled_ppo_loss(hidden, weight, labels, behav_logprobs, adv, mask,
                                                   chunk_size=self.config.loss_chunk_size,
                                                   backend=self.loss_impl, **kw)

    def _routing(self, p: Packed, agree: dict | None = None) -> contextlib.ExitStack:
        """The recorded routing of ``p``'s positions over the forward(s) in the block: replayed by the
        trained model's routers with ``ppo.routing_replay``, and with ``agree`` the recorded
        (position, block) pairs its own routers would route elsewhere counted into it
        (``moe_routing.py``); nothing without recorded rows."""
        stack = contextlib.ExitStack()
        if p.routing is None or not (self.config.ppo.routing_replay or agree is not None):
            return stack
        idx = replay_indices(self.model, p.routing, self.device)  # once for both, checked on the CPU
        with stack:  # closed here only if entering one fails; the caller's block closes it otherwise
            if self.config.ppo.routing_replay:
                stack.enter_context(replay_routing(self.model, idx))
            if agree is not None:
                stack.enter_context(routing_agreement(self.model, idx, agree))
            return stack.pop_all()

    @torch.no_grad()
    def _logprobs(self, model, p: Packed, routing: bool = False, agree: dict | None = None) -> torch.Tensor:
        """[T] log-probs of ``p``'s labels, the whole row on every rank of a context-parallel group
        (each computes its share; the shares are all-gathered). ``routing``: the recorded routing
        replayed / compared (:meth:`_routing`)."""
        cut, s = self._share(p)
        labels = s.labels

        def head(h, w, bias):
            return self._token_logprobs_op(h, w, labels, bias)

        with self._routing(s, agree) if routing else contextlib.nullcontext(), self._cp_block():
            out = model(head, *s.model_args()).float()
        return out if cut is None else context.gather_tokens(out, cut, self.pmesh.group("cp"))

    def compute_logprobs(self, samples: list) -> list[torch.Tensor]:
        """Recomputed log-probs of each sample's output tokens under the current weights (fp32, CPU).
        Collective: every rank calls it with the same samples; each rank computes its share."""
        seqs = [to_seq(as_sample(s, i), self.config.ppo.routing_replay) for i, s in enumerate(samples)]
        out: list[torch.Tensor | None] = [None] * len(seqs)
        self.model.eval()
        for ids, mb in self._plan(seqs, list(range(len(seqs)))):
            p = pack(ids, mb, torch.zeros(len(ids)), self.device)
            lps = self._logprobs(self.model, p, routing=True).cpu()
            for i, s, lp in zip(ids, mb, p.split(lps)):
                if i >= 0:
                    out[i] = lp[s.loss_mask]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, out)
            out = [next(g[i] for g in gathered if g[i] is not None) for i in range(len(seqs))]
        return out

    # ---------------------------------------------------------------- the step
    def train_batch(self, samples: list | None, version: int | None = None) -> dict[str, float]:
        """One PPO update (``ppo_n_minibatches`` optimizer steps) on ``samples``; returns metrics.

        ``version``: the version of the weights this update starts from, as the controller numbers
        them (None: ``self.version``, for a caller that tells none); the updated weights are version
        + 1, and ``self.version`` says so afterwards. Collective: every rank calls it (with the same
        version); with ``broadcast_batch`` only rank 0's samples count.

        The steps: read the batch (:meth:`_read_batch`), plan the minibatches and their advantages
        (:meth:`_advantages`), recompute the proximal and reference log-probs before any update
        (:meth:`_recompute`), one optimizer step per minibatch (:meth:`_minibatch_step`), then the
        metrics, reduced over the ranks (:meth:`_step_metrics`)."""
        t0 = time.perf_counter()
        theta_version = self.version if version is None else int(version)
        samples, seqs = self._read_batch(samples)
        minibatches = split_minibatches([len(s) for s in seqs], self.config.ppo.ppo_n_minibatches)
        plans = [self._plan(seqs, mb) for mb in minibatches]
        adv = self._advantages(samples, seqs, plans)

        def packed(ids, mb, prox=None, ref=None):
            a = torch.stack([adv[i] if i >= 0 else adv.new_zeros(()) for i in ids])
            return pack(ids, mb, a, self.device, prox, ref)

        rec = self._recompute(plans, packed, skip_first=self._prox_in_forward(seqs))
        self.model.train()
        acc = _StepSums()
        for j, plan in enumerate(plans):
            prox_here = j == 0 and rec.first_in_forward
            acc.grad_norms.append(self._minibatch_step(plan, packed, rec, theta_version, acc, prox_here))
        self.scheduler.step()
        self.version = theta_version + 1  # what these weights are now, in the caller's numbering
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        return self._step_metrics(acc, rec, samples, seqs, theta_version, elapsed)

    def _read_batch(self, samples: list | None) -> tuple[list, list[Seq]]:
        """The batch as checked samples (rank 0's on every rank with ``broadcast_batch``) and their
        shifted sequences (with the recorded routing: replayed, or compared)."""
        samples = self._broadcast(samples)
        if not samples:
            raise ValueError("train_batch needs at least one sample")
        samples = [as_sample(s, i) for i, s in enumerate(samples)]
        return samples, [to_seq(s, routing=True) for s in samples]

    def _advantages(self, samples: list, seqs: list[Seq], plans: list) -> torch.Tensor:
        """One advantage per sample: scaled rewards, per group (GRPO / RLOO), then optionally
        normalised over this rank's share of the batch (``adv_batch_norm``, all-reduced)."""
        ppo = self.config.ppo
        rewards = [float(s.reward) * ppo.reward_scale + ppo.reward_bias for s in samples]
        adv = adv_mod.group_advantages(rewards, [s.group_id for s in samples], estimator=ppo.adv_estimator,
                                       std_norm=ppo.adv_std_norm, unbiased=ppo.adv_std_unbiased, eps=ppo.adv_eps)
        if ppo.adv_batch_norm:
            mine = sorted({i for plan in plans for ids, _ in plan for i in ids if i >= 0})
            w = torch.tensor([seqs[i].n_gen for i in mine], dtype=torch.float64)
            if self.pmesh.index("cp"):
                w.zero_()  # a context-parallel group holds its samples on every rank: counted once
            adv = adv.clone()
            adv[mine] = adv_mod.batch_normalize(adv[mine], w, unbiased=ppo.adv_std_unbiased, eps=ppo.adv_eps)
        return adv

    def _prox_in_forward(self, seqs: list[Seq]) -> bool:
        """May the first minibatch's proximal log-probs come from its own training forward? They are
        the log-probs under the weights before this step's update, and the first minibatch's forward
        runs on exactly those weights, on the same packed micro-batches: the same numbers as a
        separate no-grad forward (tests/trainer/test_trainer_actor.py compares the two paths bit for
        bit), one forward fewer. Not with MoE routing rows (the proximal forward counts the routing
        agreement) nor under context parallelism (the recompute gathers whole rows)."""
        return (self.config.ppo.prox_mode == "recompute" and self.prox_from_forward and self.pmesh.cp == 1
                and all(s.routing is None for s in seqs))

    def _recompute(self, plans: list, packed, skip_first: bool = False) -> _Recomputed:
        """The proximal (``prox_mode`` 'recompute') and reference log-probs of the whole batch, before
        any update, keyed by sample index; the MoE routing agreement of the proximal forward.
        ``skip_first``: no proximal forward for the first minibatch (:meth:`_prox_in_forward`)."""
        rec = _Recomputed(prox={} if self.config.ppo.prox_mode == "recompute" else None,
                          ref={} if self.ref is not None else None, first_in_forward=skip_first)
        t = time.perf_counter()
        if rec.prox is not None or rec.ref is not None:
            self.model.eval()
            for j, plan in enumerate(plans):
                for ids, mb in plan:
                    if rec.ref is None and j == 0 and skip_first:
                        continue
                    p = packed(ids, mb)
                    if rec.prox is not None and not (j == 0 and skip_first):
                        lps = self._logprobs(self.model, p, routing=True, agree=rec.agree)
                        self._store(rec.prox, ids, p, lps.cpu())
                    if rec.ref is not None:
                        self._store(rec.ref, ids, p, self._logprobs(self.ref, p).cpu())
        rec.seconds = time.perf_counter() - t
        return rec

    @staticmethod
    def _store(store: dict, ids: list[int], p: Packed, lps: torch.Tensor) -> None:
        for i, lp in zip(ids, p.split(lps)):
            if i >= 0:  # -1: a rank's padding sequence
                store[i] = lp

    def _normalizer(self, plan: list) -> float:
        """The loss's denominator for one minibatch over every rank: loss tokens (token-mean) or
        sequences with a loss token (seq-mean-token-mean); at least 1."""
        if self.pmesh.index("cp"):
            local = 0  # the ranks of a context-parallel group hold the same micro-batches: counted once
        elif self.loss_config.loss_agg == "token-mean":
            local = sum(int(s.loss_mask.sum()) for _, mb in plan for s in mb)
        else:
            local = sum(int(s.loss_mask.any()) for _, mb in plan for s in mb)
        return max(float(adv_mod.all_reduce_sum(torch.tensor([local], dtype=torch.float64)).item()), 1.0)

    def _minibatch_step(self, plan: list, packed, rec: _Recomputed, theta_version: int, acc: _StepSums,
                        prox_here: bool = False) -> float:
        """Forward and backward every micro-batch of one minibatch, then one optimizer step; sums
        its statistics into ``acc`` on the device (no host sync per micro-batch). Returns the
        gradient norm. ``prox_here``: the proximal log-probs are this forward's own (detached)."""
        normalizer = self._normalizer(plan)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for ids, mb in plan:
            _, p = self._share(packed(ids, mb, None if prox_here else rec.prox, rec.ref))  # this rank's tokens
            acc.n_tokens += p.n_tokens
            # forward and backward: a checkpointed block routes (and exchanges) again in backward
            with self._routing(p), self._cp_block():
                out = self.model(self._loss_fn(p, normalizer, theta_version, prox_here), *p.model_args())
                loss, stats = out[0], out[3]
                if p.prox_logprobs is not None or prox_here:  # recomputed by the trainer (not approx / none)
                    prox = out[4] if prox_here else p.prox_logprobs
                    acc.dash.append((p.behav_logprobs, prox, out[1].detach(), p.loss_mask))
                (loss * self.world).backward()
            loss_sum += loss.detach().double()
            n = stats["n_tokens"].detach().double()
            self._acc(acc.totals, "n_tokens", n)
            self._acc(acc.totals, "nonfinite_count", stats["nonfinite_count"].detach().double())
            for k in _MEAN_STATS:
                if k in stats:
                    self._acc(acc.totals, k, stats[k].detach().double() * n)
        acc.losses.append(loss_sum)
        return self._clip_and_step()

    def _step_metrics(self, acc: _StepSums, rec: _Recomputed, samples: list, seqs: list[Seq], theta_version: int,
                      elapsed: float) -> dict[str, float]:
        """The step's metrics: sums all-reduced in one call, means per loss token, the mismatch
        dashboard, the staleness of the trained tokens, MoE routing shares and MFU."""
        keys = sorted(acc.totals)
        n_tok = torch.tensor(float(acc.n_tokens), dtype=torch.float64, device=self.device)
        red = adv_mod.all_reduce_sum(torch.stack([acc.totals[k] for k in keys] + acc.losses + [n_tok])).tolist()
        tot = dict(zip(keys, red[: len(keys)]))
        n_loss = max(tot.get("n_tokens", 0.0), 1.0)
        metrics = {k: tot[k] / n_loss for k in keys if k in _MEAN_STATS}
        metrics.update(
            loss=sum(red[len(keys): len(keys) + len(acc.losses)]) / len(acc.losses),
            n_loss_tokens=tot.get("n_tokens", 0.0),
            nonfinite_count=tot.get("nonfinite_count", 0.0),
            grad_norm=sum(acc.grad_norms) / len(acc.grad_norms),
            lr=self.optimizer.param_groups[0]["lr"],
            version=float(self.version),
            n_samples=float(len(samples)),
            n_tokens=red[-1],
            step_time_s=elapsed,
            recompute_time_s=rec.seconds,
            tokens_per_s=red[-1] / elapsed,
        )
        if acc.dash:  # this rank's loss tokens (rank 0's on a multi-rank run; docs/objective.md, "Dashboard")
            metrics.update(ops.mismatch_stats(*(torch.cat([x[i] for x in acc.dash]) for i in range(4))))
        metrics.update(_staleness(seqs, theta_version))
        if self.config.ppo.routing_replay:  # the share of the trained positions whose routing the servers recorded
            rows = sum(len(s) for s in seqs)
            recorded = sum(int((s.routing >= 0).all(-1).sum()) for s in seqs if s.routing is not None)
            metrics["routing_replayed_fraction"] = recorded / max(rows, 1)
        if rec.agree["recorded"]:  # this rank's recompute: recorded (position, block) pairs routed elsewhere
            metrics["routing_differ_fraction"] = rec.agree["differ"] / rec.agree["recorded"]
        mfu = self._mfu(seqs, elapsed, recompute=(rec.prox is not None) + (rec.ref is not None))
        if mfu is not None:
            metrics["mfu"] = mfu
        return metrics

    @staticmethod
    def _acc(totals: dict, key: str, value: torch.Tensor) -> None:
        totals[key] = value if key not in totals else totals[key] + value

    def _loss_fn(self, p: Packed, normalizer: float, theta_version: int, prox_here: bool = False):
        ppo = self.config.ppo

        def head(h, w, bias):
            prox = p.prox_logprobs
            if prox_here:  # the recompute's head on this forward's hidden states (no gradient)
                prox = self._token_logprobs_op(h.detach(), w.detach(), p.labels, bias).float()
            if ppo.prox_mode == "approx":
                cur = self._token_logprobs_op(h.detach(), w.detach(), p.labels, bias)
                prox = adv_mod.approx_prox_logprobs(p.behav_logprobs, cur, p.versions.clamp(min=0), theta_version)
            out = self._loss_op(
                h, w, p.labels, p.behav_logprobs, p.advantages, p.loss_mask, bias=bias,
                prox_logprobs=prox, ref_logprobs=p.ref_logprobs, cu_seqlens=p.cu_seqlens,
                normalizer=normalizer, config=self.loss_config,
            )
            # a tuple (not the dataclass) so FSDP2 sees the loss and hooks its backward
            return out.loss, out.logprobs, out.entropy, dict(out.stats), prox

        return head

    def _clip_and_step(self) -> float:
        params = [q for q in self.model.parameters() if q.grad is not None]
        clip = self.config.optim.grad_clip
        if self.pmesh.ep > 1:  # experts outside FSDP2: gradients reduced here, one global norm (parallel/expert.py)
            from areal_fast.trainer.parallel.expert import clip_grad_norm, finalize_expert_grads

            finalize_expert_grads(self.model, self.pmesh)
            norm = clip_grad_norm(self.model, params, clip if clip > 0 else float("inf"), self.pmesh)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"), foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self._grad_observer is not None:  # tests: look at the (clipped) gradients before the step
            self._grad_observer(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---------------------------------------------------------------- metrics
    def _count_matmul_params(self) -> int:
        embed = self.model.lm.get_input_embeddings().weight
        tied = self.model.lm.lm_head.weight is embed
        return sum(p.numel() for p in self.model.parameters() if p is not embed or tied)

    def _mfu(self, seqs: list[Seq], elapsed: float, recompute: int) -> float | None:
        if self.device.type != "cuda":
            return None
        peak = self.config.peak_flops
        if peak is None:
            name = torch.cuda.get_device_name(self.device)
            peak = next((v for k, v in _PEAK_BF16.items() if k in name), None)
        if peak is None:
            return None
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        tokens = sum(len(s) for s in seqs)
        sq = sum(len(s) ** 2 for s in seqs)
        # forward: 2 N per token + causal attention 2 * 2 * layers * heads * d * L^2 / 2; backward 2x forward
        fwd = 2 * self._matmul_params * tokens + 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * sq
        flops = fwd * (3 + recompute)
        return flops / (elapsed * peak * self.world)

    # ---------------------------------------------------------------- weights for sync / export
    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """HF name -> this rank's FSDP2 DTensor shard (no communication); with expert parallelism
        an expert tensor is this rank's experts as a ``Shard(0)`` DTensor over its expert-parallel group."""
        from areal_fast.trainer.parallel.expert import global_state

        return {hf_name(k): v for k, v in global_state(self.model, self.model.state_dict(), self.pmesh).items()}

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full unsharded tensor on this rank's device) one at a time, in a fixed
        order; tied weights once. Collective: every rank must iterate it to the end."""
        from areal_fast.trainer.parallel.expert import global_state

        seen = set()
        for k, v in global_state(self.model, self.model.state_dict(), self.pmesh).items():
            name = hf_name(k)
            if id(v) in seen or (name == "lm_head.weight" and getattr(self.hf_config, "tie_word_embeddings", False)):
                continue
            seen.add(id(v))
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            yield name, full if dtype is None else full.to(dtype)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """A LoRA actor's adapter: PEFT file name -> full CPU tensor (every rank gets it; collective).
        Only the adapter is gathered, never the frozen base."""
        from areal_fast.trainer.lora import iter_adapter

        if self.lora is None:
            raise ValueError("adapter_state_dict: this actor trains the whole model (train.lora is not set)")
        return {k: v.detach().cpu() for k, v in iter_adapter(self.model, hf_name)}

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """HF-named unsharded CPU state dict (every rank gets it; collective)."""
        return {k: v.cpu() for k, v in self.iter_full_params(dtype)}
