"""The trainer's whole configuration: one dataclass per concern, validated on construction.

:class:`TrainerConfig` is the ONE trainer configuration: the run config's ``train`` section is
this class, so every trainer setting is reachable from YAML (``train.*``) and is checked when the
config is loaded, before any process starts. Importing this module does not import torch.

YAML layout (dotted keys of a run config)::

    train.batch_size / world_size / threads / gpus / device / max_tokens_per_mb / min_mbs /
          packing_cost / param_dtype / gradient_checkpointing / attn_impl / loss_chunk_size /
          loss_impl / broadcast_batch / peak_flops
    train.lora.*          a LoRA adapter on the frozen base (LoRAConfig, docs/lora.md)
    train.ppo.prox_mode / ppo_n_minibatches / adv_estimator / adv_std_norm / adv_std_unbiased /
              adv_batch_norm / adv_eps / reward_scale / reward_bias
    train.ppo.loss.*      the objective's options (PPOLossConfig, docs/objective.md)
    train.optim.*         AdamW and the learning-rate schedule
    train.parallel.ep / cp  expert- and context-parallel degrees (ParallelConfig, docs/parallelism.md)

``model_path``, ``seed`` and ``sampling_temperature`` are filled by the launcher (from
``model.path`` or the warm-start cache, ``experiment.seed`` and ``rollout.temperature``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, device_indices, option
from areal_fast.lora_config import LoRAConfig
from areal_fast.ops.loss_config import PPOLossConfig

ADV_ESTIMATORS = ("grpo", "rloo")
PROX_MODES = ("recompute", "approx", "none")
LR_SCHEDULES = ("constant", "linear", "cosine")
ATTN_IMPLS = ("auto", "flash_attn", "torch_varlen", "sdpa_loop")
PARAM_DTYPES = ("bfloat16", "float16", "float32")
PACKING_COSTS = ("tokens", "attention")
LOSS_IMPLS = ("triton", "interpret", "reference")
_DEVICE_RE = re.compile(r"(cpu|cuda(:\d+)?)")


def _sections(obj, **classes) -> None:
    """Refuse a sub-section that is not its dataclass (a mapping goes through the loader:
    ``areal_fast.configutil.from_dict(TrainerConfig, {...})``)."""
    for name, cls in classes.items():
        value = getattr(obj, name)
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name}: expected a {cls.__name__}, got {type(value).__name__} (build a config from "
                            f"plain data with areal_fast.configutil.from_dict)")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warmup-then-decay learning rate."""

    lr: float = option(1e-6, ge=0)
    """Peak learning rate (>= 0)."""
    weight_decay: float = option(0.0, ge=0)
    """Decoupled (AdamW) weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    eps: float = option(1e-8, gt=0)
    """Adam epsilon (> 0)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables clipping, the norm is still logged)."""
    warmup_steps: int = option(0, ge=0)
    """Linear warmup to ``lr`` over this many trainer steps (``train_batch`` calls; the LR is
    constant across the ppo_n_minibatches optimizer steps of one batch)."""
    total_steps: int = option(0, ge=0)
    """Trainer steps of the whole run, for the decaying schedules (0 = constant after warmup; the
    launcher fills it from ``experiment.total_steps`` when a decaying schedule leaves it at 0)."""
    lr_schedule: str = option("constant", choices=LR_SCHEDULES)
    """'constant', 'linear' or 'cosine' decay after warmup."""
    min_lr_ratio: float = option(0.0, ge=0, le=1)
    """Floor of the decayed learning rate as a fraction of ``lr``, in [0, 1]."""

    def __post_init__(self):
        check_rules(self)
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(isinstance(b, int | float) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: must be two numbers in [0, 1), got {self.betas!r}")


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    """The PPO update: the objective's options (``loss``), the proximal policy, the advantages."""

    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    """Options of the decoupled-PPO objective (``docs/objective.md``). Leave ``loss.temperature``
    unset: the loss uses the rollout's sampling temperature (``TrainerConfig.sampling_temperature``)."""
    prox_mode: str = option("recompute", choices=PROX_MODES)
    """Proximal policy: 'recompute' (a no-grad forward before the update), 'approx' (log-linear
    interpolation between behaviour and current log-probs by weight version, no extra forward) or
    'none' (p = b: standard PPO on the behaviour policy)."""
    ppo_n_minibatches: int = option(1, ge=1)
    """Optimizer steps per batch; the batch is split into this many token-balanced minibatches."""
    adv_estimator: str = option("grpo", choices=ADV_ESTIMATORS)
    """'grpo' or 'rloo' (per group of samples of one prompt; a group of one gets advantage 0)."""
    adv_std_norm: bool = True
    """GRPO divides by the group std (False = Dr. GRPO: mean-centred only)."""
    adv_std_unbiased: bool = True
    """Standard deviations of the group (GRPO) and batch normalisations: True = unbiased (divide by
    n - 1, as AReaL does), False = population (divide by n)."""
    adv_batch_norm: bool = False
    """Normalise the advantages over the whole batch (token-weighted, all-reduced in float64)."""
    adv_eps: float = option(1e-5, gt=0)
    """Added to the std before dividing (> 0)."""
    reward_scale: float = 1.0
    """Rewards are ``reward * reward_scale + reward_bias`` before the advantages."""
    reward_bias: float = 0.0
    """See ``reward_scale``."""
    routing_replay: bool = False
    """MoE models: the proximal recompute's and the loss's forward route every position to the experts
    the server recorded for it (``Sample.routed_experts``, asked for with ``rollout.return_routed_experts``)
    instead of the trainer's own top-k; positions without a record are routed by the trainer
    (``docs/moe.md``). The reference model's forward is not replayed."""

    def __post_init__(self):
        _sections(self, loss=PPOLossConfig)
        check_rules(self)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the trainer ranks split the work past data parallelism (``docs/parallelism.md``). The
    data-parallel degree is ``world_size // cp``; expert parallelism borrows its ranks from the
    data-parallel x context-parallel ranks (as torchtitan's does). Both 1: today's FSDP2 data
    parallelism, unchanged."""

    ep: int = option(1, ge=1)
    """Expert-parallel degree: each group of ``ep`` consecutive ranks splits every MoE block's experts
    (``num_experts / ep`` whole experts a rank); tokens travel to their experts and back by
    all-to-all. Divides ``world_size`` and the model's expert count; a dense model is refused."""
    cp: int = option(1, ge=1)
    """Context-parallel degree (Ulysses): the tokens of a micro-batch are split over ``cp``
    consecutive ranks, an all-to-all swaps sequence shards for head shards around attention.
    Divides ``world_size`` and the model's query head count (key/value heads it does not divide are
    repeated on each rank); the loss options that read whole sequences are refused with it."""

    def __post_init__(self):
        check_rules(self)

    @property
    def trivial(self) -> bool:
        """No expert or context parallelism: the data-parallel trainer of world size ranks."""
        return self.ep == 1 and self.cp == 1


def check_parallel_model(parallel: ParallelConfig, *, num_experts: int | None, num_heads: int | None,
                         where: str) -> None:
    """Refuse degrees the model cannot take: ``ep`` must divide the expert count (and needs a
    mixture-of-experts model: ``num_experts`` None or 0 is a dense one), ``cp`` the query head
    count (None: not known here; key/value heads ``cp`` does not divide are repeated on each rank's
    share before the all-to-all, ``parallel/context.py``). ``where`` names the source of the model's sizes."""
    if parallel.ep > 1:
        if not num_experts:
            raise ValueError(f"train.parallel.ep: {parallel.ep} needs a mixture-of-experts model; {where} is dense "
                             f"(no experts to split): use ep 1")
        if num_experts % parallel.ep:
            raise ValueError(f"train.parallel.ep: {parallel.ep} does not divide the {num_experts} experts of "
                             f"{where} (each rank holds num_experts / ep whole experts)")
    if parallel.cp > 1:
        if num_heads is not None and num_heads % parallel.cp:
            raise ValueError(f"train.parallel.cp: {parallel.cp} does not divide the {num_heads} attention heads of "
                             f"{where} (Ulysses gives each rank heads / cp whole heads)")


def local_model_config(model_path: str | None) -> tuple[str | None, dict | None]:
    """(path, the text model's config) from ``model_path/config.json`` when that is a local, readable
    file; (path, None) otherwise (the trainer's build names a bad file)."""
    import json
    import os

    path = os.path.join(str(model_path), "config.json") if model_path else None
    if path is None or not os.path.isfile(path):
        return path, None
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return path, None
    return path, (cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg)


def check_parallel_run(parallel: ParallelConfig, warm_start=None, model_path: str | None = None) -> None:
    """The degrees against the model a run will train, as far as the run config knows it: the warm-start
    keys (``model.warm_start``, when enabled), else the ``config.json`` of ``model_path`` when that is a
    local directory (otherwise the trainer checks the model when it builds it)."""
    if parallel.trivial:
        return
    if warm_start is not None and warm_start.enabled:
        moe = warm_start.arch == "qwen3_moe"
        check_parallel_model(parallel, num_experts=warm_start.num_experts if moe else 0,
                             num_heads=warm_start.num_attention_heads,
                             where=f"the warm-started model (model.warm_start.arch {warm_start.arch!r})")
        return
    path, cfg = local_model_config(model_path)
    if cfg is None:
        return
    check_parallel_model(parallel, num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
                         num_heads=cfg.get("num_attention_heads"), where=path)


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Everything the trainer needs, and the run config's ``train`` section.

    The PPO actor needs ``model_path``: a local HF directory (config.json and optionally
    *.safetensors; without weights the model is randomly initialised from ``seed``)."""

    model_path: str | None = option(None, nonempty=True)
    """Local directory with config.json (+ safetensors). Filled by the launcher (from ``model.path``
    or the warm-start cache); required by the actor."""
    sampling_temperature: float = option(1.0, gt=0)
    """Sampling temperature of the rollouts (> 0). Filled by the launcher from ``rollout.temperature``;
    the recomputed log-probs and the loss use it (the one temperature of a run)."""
    seed: int = 1
    """Seed of the random initialisation (when the directory has no weights) and the RNG. Filled by
    the launcher from ``experiment.seed``."""
    batch_size: int = option(8, ge=1)
    """B: groups (prompts) per trainer step (read by the controller)."""
    world_size: int = option(1, ge=1)
    """Trainer ranks (torchrun); 1 = the trainer runs inside the controller process (read by the launcher)."""
    threads: int = option(1, ge=1)
    """torch CPU threads per trainer rank (read by the launcher)."""
    gpus: list[str] = field(default_factory=list)
    """The GPUs of the trainer ranks, one device each (an index or a GPU-/MIG- UUID), e.g. ["4", "5"]
    (empty: inherit CUDA_VISIBLE_DEVICES; may share the servers' GPUs). The same type as
    ``rollout.gpus``, whose entries are one server's devices each. Read by the launcher."""
    device: str | None = None
    """'cpu', 'cuda', 'cuda:N' or None (cuda when available)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The PPO update: objective, proximal policy, advantages."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    max_tokens_per_mb: int = option(16384, ge=2)
    """Token budget of one packed micro-batch (>= 2; a sequence longer than this is an error). Under
    context parallelism (``parallel.cp``) the budget of a rank's share: a micro-batch, and so one
    sequence, may hold up to ``cp`` times this."""
    min_mbs: int = option(1, ge=1)
    """Minimum micro-batches per rank and minibatch (>= 1)."""
    packing_cost: str = option("attention", choices=PACKING_COSTS)
    """Balance ranks by 'tokens' or by 'attention' cost (len + len^2 / (12 d))."""
    param_dtype: str = option("bfloat16", choices=PARAM_DTYPES)
    """Compute dtype of the FSDP2 mixed-precision policy on GPU: 'bfloat16', 'float16' or
    'float32' (master weights and the gradient reduction stay fp32). CPU always computes in float32."""
    gradient_checkpointing: bool = False
    """Activation checkpointing per decoder block."""
    attn_impl: str = option("auto", choices=ATTN_IMPLS)
    """'auto' (flash-attn varlen if installed, else torch varlen on CUDA, else a per-sequence
    SDPA loop), or one of 'flash_attn', 'torch_varlen', 'sdpa_loop'."""
    loss_chunk_size: int | None = option(None, ge=1)
    """Token rows per chunk of the fused-linear loss (None = the op's default, ~ T * H logits)."""
    loss_impl: str | None = option(None, choices=LOSS_IMPLS)
    """Which implementation of the loss ops runs (their ``backend=``, ``areal_fast/dispatch.py``):
    'triton', 'interpret', 'reference' or None (automatic: the Triton kernels on GPU, the reference on
    CPU)."""
    broadcast_batch: bool = True
    """In a multi-rank run only rank 0 needs to pass the samples; they are broadcast. With False
    every rank must pass the same full batch (the actor splits it over the ranks itself)."""
    peak_flops: float | None = option(None, gt=0)
    """Peak dense FLOP/s of one device for the MFU metric (None = looked up from the device name)."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter on the frozen base (``rank``, ``alpha``, ``dropout``, ``target_modules``,
    ``name``, ``save_merged``; docs/lora.md); null: the whole model is trained."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Expert- and context-parallel degrees (``ep``, ``cp``; both 1: data parallelism only)."""

    def __post_init__(self):
        _sections(self, ppo=PPOConfig, optim=OptimConfig, lora=LoRAConfig, parallel=ParallelConfig)
        check_rules(self)
        self._check_parallel()
        for i, g in enumerate(self.gpus):
            try:
                one = device_indices(g) is None or len(device_indices(g)) == 1
            except ValueError as e:
                raise ValueError(f"gpus[{i}]: {e}") from None
            if not one or "," in str(g):
                raise ValueError(f"gpus[{i}]: one device per trainer rank, got {g!r} (write a list: ['0', '1'])")
        if self.device is not None and not _DEVICE_RE.fullmatch(str(self.device)):
            raise ValueError(f"device: must be 'cpu', 'cuda', 'cuda:N' or null, got {self.device!r}")
        lt = self.ppo.loss.temperature
        if lt != 1.0 and lt != self.sampling_temperature:
            raise ValueError(
                f"ppo.loss.temperature ({lt}) differs from sampling_temperature ({self.sampling_temperature}): "
                "the loss uses the rollout's sampling temperature; set rollout.temperature instead")

    def _check_parallel(self) -> None:
        par = self.parallel
        for key in ("ep", "cp"):
            n = getattr(par, key)
            if self.world_size % n:
                raise ValueError(f"train.parallel.{key}: {n} does not divide train.world_size ({self.world_size})")
        if par.ep > 1 and self.lora is not None:
            raise ValueError("train.parallel.ep: expert parallelism with train.lora is not supported (the adapters "
                             "wrap nn.Linear modules, the fused experts are none, and the expert-parallel "
                             "gradient path is tested for full training only); use ep 1 with LoRA")
        if par.cp > 1:  # each context-parallel rank computes the loss of its share of the tokens
            lc = self.ppo.loss
            whole = [k for k, on in (("importance_level: sequence", lc.importance_level == "sequence"),
                                     ("loss_agg: seq-mean-token-mean", lc.loss_agg == "seq-mean-token-mean"),
                                     ("seq_mis_lower / seq_mis_upper", lc.seq_mis),
                                     ("m2po_tau", lc.m2po_tau is not None)) if on]
            if whole:
                raise ValueError(f"train.parallel.cp: {par.cp} with train.ppo.loss.{whole[0]} is not supported: that "
                                 f"option reads whole sequences (M2PO: the whole micro-batch) in one loss call, while "
                                 f"under context parallelism each rank's loss sees its share of the tokens only; "
                                 f"use cp 1, or the token-level options")

    @property
    def loss(self) -> PPOLossConfig:
        """The objective's options as the loss ops take them, at the sampling temperature."""
        return dataclasses.replace(self.ppo.loss, temperature=self.sampling_temperature)
