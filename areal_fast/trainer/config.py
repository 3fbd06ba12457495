"""The trainer's whole configuration: one dataclass per concern, validated on construction.

:class:`TrainerConfig` is the ONE trainer configuration: the run config's ``train`` section is
this class, so every trainer setting is reachable from YAML (``train.*``) and is checked when the
config is loaded, before any process starts. Importing this module does not import torch.

YAML layout (dotted keys of a run config)::

    train.batch_size / world_size / threads / gpus / device / max_tokens_per_mb / min_mbs /
          packing_cost / param_dtype / gradient_checkpointing / attn_impl / loss_chunk_size /
          loss_backend / broadcast_batch / peak_flops
    train.lora.*          a LoRA adapter on the frozen base (LoRAConfig, docs/lora.md)
    train.ppo.prox_mode / ppo_n_minibatches / adv_estimator / adv_std_norm / adv_std_unbiased /
              adv_batch_norm / adv_eps / reward_scale / reward_bias
    train.ppo.loss.*      the objective's options (PPOLossConfig, docs/objective.md)
    train.optim.*         AdamW and the learning-rate schedule

``model_path``, ``seed`` and ``sampling_temperature`` are filled by the launcher (from
``model.path`` or the warm-start cache, ``experiment.seed`` and ``rollout.temperature``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from areal_fast.ops.loss_config import PPOLossConfig, check_finite, migrate_deprecated_options
from areal_fast.trainer.lora_config import LoRAConfig

ADV_ESTIMATORS = ("grpo", "rloo")
PROX_MODES = ("recompute", "approx", "none")
LR_SCHEDULES = ("constant", "linear", "cosine")
ATTN_IMPLS = ("auto", "flash_attn", "torch_varlen", "sdpa_loop")
PARAM_DTYPES = ("bfloat16", "float16", "float32")
PACKING_COSTS = ("tokens", "attention")
LOSS_BACKENDS = ("triton", "interpret", "reference")
_DEVICE_RE = re.compile(r"(cpu|cuda(:\d+)?)")
_GPU_ID = r"(\d+|GPU-[\w-]+|MIG-[\w/-]+)"  # what CUDA_VISIBLE_DEVICES accepts
_GPUS_RE = re.compile(rf"{_GPU_ID}(,{_GPU_ID})*")


def _section(cls, value, name: str):
    """A sub-config from a dict (errors prefixed with the section name), or the value itself."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a {cls.__name__} or a mapping, got {value!r}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown key (valid keys under {name!r}: {', '.join(names)})")
    try:
        return cls(**value)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(name + ".") else f"{name}.{msg}") from None


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warmup-then-decay learning rate."""

    lr: float = 1e-6
    """Peak learning rate (>= 0)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon (> 0)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables clipping, the norm is still logged)."""
    warmup_steps: int = 0
    """Linear warmup to ``lr`` over this many trainer steps (``train_batch`` calls; the LR is
    constant across the ppo_n_minibatches optimizer steps of one batch)."""
    total_steps: int = 0
    """Trainer steps of the whole run, for the decaying schedules (0 = constant after warmup; the
    launcher fills it from ``experiment.total_steps`` when a decaying schedule leaves it at 0)."""
    lr_schedule: str = "constant"
    """'constant', 'linear' or 'cosine' decay after warmup."""
    min_lr_ratio: float = 0.0
    """Floor of the decayed learning rate as a fraction of ``lr``, in [0, 1]."""

    def __post_init__(self):
        for name in ("lr", "weight_decay", "eps", "grad_clip", "min_lr_ratio"):
            check_finite(f"optim.{name}", getattr(self, name))
        if not self.lr >= 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.eps > 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps!r}")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(isinstance(b, int | float) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.total_steps < 0:
            raise ValueError(f"optim.total_steps must be >= 0, got {self.total_steps!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    """The PPO update: the objective's options (``loss``), the proximal policy, the advantages."""

    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    """Options of the decoupled-PPO objective (``docs/objective.md``). Leave ``loss.temperature``
    unset: the loss uses the rollout's sampling temperature (``TrainerConfig.sampling_temperature``)."""
    prox_mode: str = "recompute"
    """Proximal policy: 'recompute' (a no-grad forward before the update), 'approx' (log-linear
    interpolation between behaviour and current log-probs by weight version, no extra forward) or
    'none' (p = b: standard PPO on the behaviour policy)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch; the batch is split into this many token-balanced minibatches."""
    adv_estimator: str = "grpo"
    """'grpo' or 'rloo' (per group of samples of one prompt; a group of one gets advantage 0)."""
    adv_std_norm: bool = True
    """GRPO divides by the group std (False = Dr. GRPO: mean-centred only)."""
    adv_std_unbiased: bool = True
    """Standard deviations of the group (GRPO) and batch normalisations: True = unbiased (divide by
    n - 1, as AReaL does), False = population (divide by n)."""
    adv_batch_norm: bool = False
    """Normalise the advantages over the whole batch (token-weighted, all-reduced in float64)."""
    adv_eps: float = 1e-5
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
        if isinstance(self.loss, dict):  # run configs written with behav_weight_cap still load
            self.loss = migrate_deprecated_options(self.loss, "ppo.loss.")
        self.loss = _section(PPOLossConfig, self.loss, "ppo.loss")
        if self.prox_mode not in PROX_MODES:
            raise ValueError(f"ppo.prox_mode must be one of {PROX_MODES}, got {self.prox_mode!r}")
        if self.ppo_n_minibatches < 1:
            raise ValueError(f"ppo.ppo_n_minibatches must be >= 1, got {self.ppo_n_minibatches!r}")
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(f"ppo.adv_estimator must be one of {ADV_ESTIMATORS}, got {self.adv_estimator!r}")
        for name in ("adv_eps", "reward_scale", "reward_bias"):
            check_finite(f"ppo.{name}", getattr(self, name))
        if not self.adv_eps > 0:
            raise ValueError(f"ppo.adv_eps must be > 0, got {self.adv_eps!r}")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Everything the trainer needs, and the run config's ``train`` section.

    The PPO actor needs ``model_path``: a local HF directory (config.json and optionally
    *.safetensors; without weights the model is randomly initialised from ``seed``)."""

    model_path: str | None = None
    """Local directory with config.json (+ safetensors). Filled by the launcher (from ``model.path``
    or the warm-start cache); required by the actor."""
    sampling_temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0). Filled by the launcher from ``rollout.temperature``;
    the recomputed log-probs and the loss use it (the one temperature of a run)."""
    seed: int = 1
    """Seed of the random initialisation (when the directory has no weights) and the RNG. Filled by
    the launcher from ``experiment.seed``."""
    batch_size: int = 8
    """B: groups (prompts) per trainer step (read by the controller)."""
    world_size: int = 1
    """Trainer ranks (torchrun); 1 = the trainer runs inside the controller process (read by the launcher)."""
    threads: int = 1
    """torch CPU threads per trainer rank (read by the launcher)."""
    gpus: str | None = None
    """CUDA_VISIBLE_DEVICES of the trainer ranks, e.g. "4,5,6,7" (None: inherit; may share the
    servers' GPUs). Read by the launcher."""
    device: str | None = None
    """'cpu', 'cuda', 'cuda:N' or None (cuda when available)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The PPO update: objective, proximal policy, advantages."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    max_tokens_per_mb: int = 16384
    """Token budget of one packed micro-batch (>= 2; a sequence longer than this is an error)."""
    min_mbs: int = 1
    """Minimum micro-batches per rank and minibatch (>= 1)."""
    packing_cost: str = "attention"
    """Balance ranks by 'tokens' or by 'attention' cost (len + len^2 / (12 d))."""
    param_dtype: str = "bfloat16"
    """Compute dtype of the FSDP2 mixed-precision policy on GPU: 'bfloat16', 'float16' or
    'float32' (master weights and the gradient reduction stay fp32). CPU always computes in float32."""
    gradient_checkpointing: bool = False
    """Activation checkpointing per decoder block."""
    attn_impl: str = "auto"
    """'auto' (flash-attn varlen if installed, else torch varlen on CUDA, else a per-sequence
    SDPA loop), or one of 'flash_attn', 'torch_varlen', 'sdpa_loop'."""
    loss_chunk_size: int | None = None
    """Token rows per chunk of the fused-linear loss (None = the op's default, ~ T * H logits)."""
    loss_backend: str | None = None
    """``backend=`` of the loss ops: 'triton', 'interpret', 'reference' or None (automatic: the
    Triton kernels on GPU, the reference on CPU)."""
    broadcast_batch: bool = True
    """In a multi-rank run only rank 0 needs to pass the samples; they are broadcast. With False
    every rank must pass the same full batch (the actor splits it over the ranks itself)."""
    peak_flops: float | None = None
    """Peak dense FLOP/s of one device for the MFU metric (None = looked up from the device name)."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter on the frozen base (``rank``, ``alpha``, ``dropout``, ``target_modules``,
    ``name``, ``save_merged``; docs/lora.md); null: the whole model is trained."""

    def __post_init__(self):
        if self.model_path is not None and not (isinstance(self.model_path, str) and self.model_path):
            raise ValueError(f"model_path must name a local HF model directory, got {self.model_path!r}")
        check_finite("sampling_temperature", self.sampling_temperature)
        if not self.sampling_temperature > 0:
            raise ValueError(f"sampling_temperature must be > 0, got {self.sampling_temperature!r}")
        for name in ("batch_size", "world_size", "threads", "max_tokens_per_mb", "min_mbs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name, low in (("batch_size", 1), ("world_size", 1), ("threads", 1), ("max_tokens_per_mb", 2),
                          ("min_mbs", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)!r}")
        if self.gpus is not None and not _GPUS_RE.fullmatch(str(self.gpus)):
            raise ValueError(f"gpus must be a comma-separated list of GPU indices (or GPU-/MIG- UUIDs) like "
                             f"'0,1', got {self.gpus!r}")
        if self.device is not None and not _DEVICE_RE.fullmatch(str(self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or null, got {self.device!r}")
        if self.packing_cost not in PACKING_COSTS:
            raise ValueError(f"packing_cost must be one of {PACKING_COSTS}, got {self.packing_cost!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be >= 1 or null, got {self.loss_chunk_size!r}")
        if self.loss_backend is not None and self.loss_backend not in LOSS_BACKENDS:
            raise ValueError(f"loss_backend must be one of {LOSS_BACKENDS} or null, got {self.loss_backend!r}")
        if self.peak_flops is not None:
            check_finite("peak_flops", self.peak_flops)
            if not self.peak_flops > 0:
                raise ValueError(f"peak_flops must be > 0 or null, got {self.peak_flops!r}")
        self.ppo = _section(PPOConfig, self.ppo, "ppo")
        self.optim = _section(OptimConfig, self.optim, "optim")
        if self.lora is not None:
            self.lora = _section(LoRAConfig, self.lora, "lora")
        lt = self.ppo.loss.temperature
        if lt != 1.0 and lt != self.sampling_temperature:
            raise ValueError(
                f"ppo.loss.temperature ({lt}) differs from sampling_temperature ({self.sampling_temperature}): "
                "the loss uses the rollout's sampling temperature; set rollout.temperature instead")

    @property
    def loss(self) -> PPOLossConfig:
        """The objective's options as the loss ops take them, at the sampling temperature."""
        return dataclasses.replace(self.ppo.loss, temperature=self.sampling_temperature)
