"""Trainer configuration: one dataclass per concern, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

_ADV_ESTIMATORS = ("grpo", "rloo")
_PROX_MODES = ("recompute", "approx", "none")
_LR_SCHEDULES = ("constant", "linear", "cosine")
_ATTN_IMPLS = ("auto", "flash_attn", "torch_varlen", "sdpa_loop")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warmup-then-decay learning rate."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables clipping, the norm is still logged)."""
    warmup_steps: int = 0
    """Linear warmup to ``lr`` over this many trainer steps (``train_batch`` calls; the LR is
    constant across the ppo_n_minibatches optimizer steps of one batch)."""
    total_steps: int = 0
    """Trainer steps of the whole run, for the decaying schedules (0 = constant after warmup)."""
    lr_schedule: str = "constant"
    """'constant', 'linear' or 'cosine' decay after warmup."""
    min_lr_ratio: float = 0.0
    """Floor of the decayed learning rate as a fraction of ``lr``."""

    def __post_init__(self):
        if not self.lr >= 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("optim.warmup_steps and optim.total_steps must be >= 0")
        if self.lr_schedule not in _LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {_LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


_LOSS_FIELDS = ("temperature", "eps_clip", "eps_clip_higher", "dual_clip", "behav_weight_cap", "behav_weight_mode",
                "importance_level", "kl_coef", "kl_estimator", "entropy_coef", "loss_agg")


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    """The decoupled PPO objective (names follow ``shared/spec/decoupled_ppo.md``)."""

    temperature: float = 1.0
    """Sampling temperature; the recomputed log-probs and the loss use the same one."""
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    dual_clip: float | None = None
    behav_weight_cap: float | None = None
    """Cap U on the behaviour weight exp(p - b); None = no cap."""
    behav_weight_mode: str = "mask"
    importance_level: str = "token"
    kl_coef: float = 0.0
    """> 0 loads a frozen reference copy of the initial weights and adds the KL term."""
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    prox_mode: str = "recompute"
    """'recompute' (no-grad forward before the update), 'approx' (version interpolation of the
    spec, no extra forward pass) or 'none' (p = b: standard PPO)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch; the batch is split into this many token-balanced minibatches."""
    adv_estimator: str = "grpo"
    """'grpo' or 'rloo' (per group of samples of one prompt)."""
    adv_std_norm: bool = True
    """GRPO divides by the group std (False = Dr. GRPO)."""
    adv_batch_norm: bool = False
    """Normalise the advantages over the whole batch (token-weighted, all-reduced in float64)."""
    adv_eps: float = 1e-5
    reward_scale: float = 1.0
    reward_bias: float = 0.0

    def __post_init__(self):
        self.loss_options()  # the objective's own checks, with the key named under "ppo."
        if self.prox_mode not in _PROX_MODES:
            raise ValueError(f"ppo.prox_mode must be one of {_PROX_MODES}, got {self.prox_mode!r}")
        if self.ppo_n_minibatches < 1:
            raise ValueError(f"ppo.ppo_n_minibatches must be >= 1, got {self.ppo_n_minibatches!r}")
        if self.adv_estimator not in _ADV_ESTIMATORS:
            raise ValueError(f"ppo.adv_estimator must be one of {_ADV_ESTIMATORS}, got {self.adv_estimator!r}")
        if not self.adv_eps > 0:
            raise ValueError(f"ppo.adv_eps must be > 0, got {self.adv_eps!r}")

    def loss_options(self) -> dict:
        """The keyword arguments of ``areal_fast.ops.*decoupled_ppo_loss``, validated by the
        objective's own :class:`~areal_fast.ops.PPOLossConfig` (one definition of what is legal)."""
        from areal_fast.ops.ppo_objective import PPOLossConfig

        opts = {f: getattr(self, f) for f in _LOSS_FIELDS}
        try:
            PPOLossConfig(**opts)
        except ValueError as e:
            raise ValueError(f"ppo.{e}") from None
        return opts


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Everything the PPO actor needs. ``model_path`` is a local HF directory (config.json and
    optionally *.safetensors; without weights the model is randomly initialised from ``seed``)."""

    model_path: str
    """Local directory with config.json (+ safetensors)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_tokens_per_mb: int = 16384
    """Token budget of one packed micro-batch (a sequence longer than this is an error)."""
    min_mbs: int = 1
    """Minimum micro-batches per rank and minibatch."""
    packing_cost: str = "attention"
    """Balance ranks by 'tokens' or by 'attention' cost (len + len^2 / (12 d))."""
    param_dtype: str = "bfloat16"
    """Compute dtype of the FSDP2 mixed-precision policy on GPU (master weights and the
    gradient reduction stay fp32). CPU always computes in float32."""
    gradient_checkpointing: bool = False
    """Activation checkpointing per decoder block."""
    attn_impl: str = "auto"
    """'auto' (flash-attn varlen if installed, else torch varlen on CUDA, else a per-sequence
    SDPA loop), or one of 'flash_attn', 'torch_varlen', 'sdpa_loop'."""
    loss_chunk_size: int | None = None
    """Token chunk of the fused-linear loss (None = the op's default)."""
    loss_backend: str | None = None
    """``backend=`` of the areal_fast.ops calls (None: auto on GPU, the reference on CPU)."""
    seed: int = 1
    """Seed for the random initialisation (when the directory has no weights) and the RNG."""
    broadcast_batch: bool = True
    """In a multi-rank run only rank 0 needs to pass the samples; they are broadcast. With False
    every rank must pass the same full batch (the actor splits it over the ranks itself)."""
    peak_flops: float | None = None
    """Peak dense FLOP/s of one device for MFU (None = looked up from the device name)."""
    device: str | None = None
    """'cuda' / 'cpu' / None (cuda when available)."""

    def __post_init__(self):
        if not self.model_path:
            raise ValueError("model_path must name a local HF model directory")
        if self.max_tokens_per_mb < 2:
            raise ValueError(f"max_tokens_per_mb must be >= 2, got {self.max_tokens_per_mb!r}")
        if self.min_mbs < 1:
            raise ValueError(f"min_mbs must be >= 1, got {self.min_mbs!r}")
        if self.packing_cost not in ("tokens", "attention"):
            raise ValueError(f"packing_cost must be 'tokens' or 'attention', got {self.packing_cost!r}")
        if self.param_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"param_dtype must be bfloat16, float16 or float32, got {self.param_dtype!r}")
        if self.attn_impl not in _ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {_ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be >= 1 or None, got {self.loss_chunk_size!r}")
        if isinstance(self.ppo, dict):
            self.ppo = PPOConfig(**self.ppo)
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
