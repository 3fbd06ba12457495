"""The run's own sections of a run config: ``experiment``, ``model``, ``eval``, ``checkpoint``,
``log``, ``ray``, ``slurm`` and the ``launcher`` names. They are read by the launcher (``areal_fast.launch``):
where the run writes, which policy it starts from, when it evaluates and saves, how it logs and
where Ray places it.

They live here, beside the package rather than in ``launch/``: the launcher imports the loader
(``areal_fast.config``), so a config module inside ``launch/`` would make the loader and the
launcher import each other. Each class validates its own values in ``__post_init__``
(``ValueError`` naming the field); the loader adds the section path. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal_fast.configutil import check_rules, option
from areal_fast.data.config import WarmStartConfig

__all__ = [
    "LAUNCHERS", "MAX_SEED", "CheckpointConfig", "EvalConfig", "ExperimentConfig", "LogConfig", "ModelConfig",
    "RayConfig", "SlurmConfig",
]

MAX_SEED = 2**32 - 1
"""Largest seed: SGLang seeds numpy with the server's seed (``np.random.seed`` takes < 2**32), and
launched server i gets ``experiment.seed + i``."""


@dataclass(kw_only=True, slots=True)
class ExperimentConfig:
    """Where a run writes and how long it lasts."""

    name: str = option("run", nonempty=True)
    """Run name, used in the default output directory."""
    output_dir: str = option("runs/{name}", nonempty=True)
    """Directory for checkpoints, metrics, logs and plots ('{name}' is replaced)."""
    seed: int = 1
    """Seed of the data order, the sampling seeds and the model initialisation."""
    total_steps: int = option(100, ge=1)
    """Trainer steps (= weight versions) of the run."""
    resume: bool = True
    """Continue from the newest complete checkpoint in output_dir when there is one."""

    def __post_init__(self):
        check_rules(self)
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed: must be in [0, {MAX_SEED}] (numpy seeds the servers with it), got {self.seed!r}")

    @property
    def out(self) -> Path:
        return Path(self.output_dir.replace("{name}", self.name))


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy."""

    path: str | None = None
    """Local Hugging Face model directory (config.json + safetensors + tokenizer). None only with
    warm_start.enabled."""
    tokenizer: str | None = None
    """Tokenizer directory when it differs from ``path``."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Build and warm-start a tiny model instead (the shipped example)."""

    def __post_init__(self):
        if not self.path and not self.warm_start.enabled:
            raise ValueError("path: a local model directory is required unless warm_start.enabled is true")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Greedy evaluation on the held-out set."""

    every_steps: int = option(10, ge=0)
    """Evaluate after every this many steps (0 = never); also at the start and the end."""
    size: int | None = option(None, ge=1)
    """Held-out prompts to use (None = all)."""
    max_new_tokens: int | None = option(None, ge=1)
    """Generation budget (None = rollout.max_new_tokens)."""
    at_start: bool = True
    """Evaluate the initial policy before training."""
    reward: str | None = option(None, nonempty=True)
    """Reward of the evaluation when it differs from training (e.g. exact match while training on a
    dense partial-credit reward); None = reward.name. Resolved when the config is loaded."""

    def __post_init__(self):
        check_rules(self)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints that hold the trainer and the controller state (resumable after kill -9)."""

    every_steps: int = option(10, ge=0)
    """Save after every this many steps (0 = only at the end)."""
    keep_last: int = option(2, ge=1)
    """Complete checkpoints kept on disk."""
    save_hf: bool = True
    """Also export the final policy as a Hugging Face directory (<output_dir>/final)."""

    def __post_init__(self):
        check_rules(self)


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """Metrics and progress display."""

    progress: bool = True
    """tqdm progress bar."""
    tensorboard: bool = True
    """Also write TensorBoard events when `tensorboard` (or tensorboardX) is installed."""
    plots: bool = True
    """PNG plots of reward, throughput and staleness at the end (needs matplotlib)."""
    level: str = "INFO"
    """Python logging level of the controller."""
    samples: bool = False
    """Write every trained group (decoded text, rewards, token versions) to samples.jsonl."""

    def __post_init__(self):
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"level: must be DEBUG/INFO/WARNING/ERROR, got {self.level!r}")


_RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(kw_only=True, slots=True)
class RayConfig:
    """Where and how the Ray launcher places the run (``launcher: ray``)."""

    address: str | None = None
    """Cluster to join: 'auto', 'HOST:6379' or 'ray://HOST:10001'. None = the RAY_ADDRESS environment
    variable, or a local single-node Ray started (and stopped) by the launcher."""
    num_cpus: int | None = option(None, ge=1)
    """CPUs of a local Ray started by the launcher (None = all)."""
    server_strategy: str = option("SPREAD", choices=_RAY_STRATEGIES)
    """Placement strategy of the server bundles: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    trainer_strategy: str = option("PACK", choices=_RAY_STRATEGIES)
    """Placement strategy of the trainer-rank bundles (PACK keeps NCCL traffic inside nodes)."""
    cpus_per_server: float | None = option(None, gt=0)
    """Logical CPUs per server bundle (None = rollout.threads_per_server)."""
    gpus_per_server: int | None = option(None, ge=0)
    """GPUs per server bundle (None = the --tp-size of server_args for SGLang, 1 for a CUDA embedded
    engine, 0 otherwise)."""
    cpus_per_rank: float | None = option(None, gt=0)
    """Logical CPUs per trainer-rank bundle (None = train.threads)."""
    server_resources: dict = field(default_factory=dict)
    """Custom Ray resources of each server bundle, e.g. {"inference": 1}: servers go only to nodes
    started with that resource (``ray start --resources '{"inference": 8}'``)."""
    rank_resources: dict = field(default_factory=dict)
    """Custom Ray resources of each trainer-rank bundle, e.g. {"trainer": 1}."""
    host: str | None = None
    """Address servers bind and ranks meet on (None = 127.0.0.1 on a one-node cluster, else the IP
    of each process's own node, as Ray reports it on that node)."""
    placement_timeout: float = option(300.0, gt=0)
    """Seconds to wait for the placement groups (and autoscaled nodes) before failing."""
    grace: float = option(10.0, ge=0)
    """Seconds between SIGTERM and SIGKILL at teardown."""

    def __post_init__(self):
        check_rules(self)
        for key in ("server_resources", "rank_resources"):
            for name, amount in getattr(self, key).items():
                if name in ("CPU", "GPU", "memory") or isinstance(amount, bool) or not (
                        isinstance(amount, int | float) and amount > 0):
                    raise ValueError(f"{key}: expected custom resource names with amounts > 0 (CPU and GPU come "
                                     f"from cpus_per_server / cpus_per_rank and the GPU rules), got {name!r}: "
                                     f"{amount!r}")


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    """Where the Slurm launcher runs the steps of the run (``launcher: slurm``, ``launch/slurm.py``)
    and what ``areal-fast slurm-script`` asks of ``sbatch``."""

    job: str | None = None
    """Job id of the allocation the steps run in (None = $SLURM_JOB_ID: the job the launcher runs in)."""
    server_job: str | None = None
    """Job id of another allocation for the inference servers (None = ``job``): servers and trainer
    ranks in separate allocations."""
    cpus_per_server: int | None = option(None, ge=1)
    """CPUs of each server step (None = rollout.threads_per_server)."""
    gpus_per_server: int | None = option(None, ge=0)
    """GPUs of each server step (None = the tensor-parallel size for SGLang and vLLM, 1 for a CUDA
    embedded engine, 0 otherwise)."""
    cpus_per_rank: int | None = option(None, ge=1)
    """CPUs of each trainer rank (None = train.threads)."""
    gpus_per_rank: int | None = option(None, ge=0)
    """GPUs of each trainer rank (None = 1 with train.device 'cuda', else 0)."""
    server_srun_args: list[str] = field(default_factory=list)
    """Extra srun options of each server step, e.g. ["--mem=32G", "--nodelist=gpu[01-02]"]."""
    rank_srun_args: list[str] = field(default_factory=list)
    """Extra srun options of the trainer step."""
    host: str | None = None
    """Address servers bind and ranks meet on (None = the address each node's hostname resolves to)."""
    start_timeout: float = option(300.0, gt=0)
    """Seconds a step may take to start (waiting for free resources in the allocation included)."""
    grace: float = option(10.0, ge=0)
    """Seconds between SIGTERM and SIGKILL when a step is stopped."""
    nodes: int = option(1, ge=1)
    """slurm-script: ``#SBATCH --nodes``."""
    time: int | str | None = None
    """slurm-script: ``#SBATCH --time`` (e.g. '24:00:00', or YAML's reading of 24:00:00 unquoted:
    seconds; None = the partition's default)."""
    partition: str | None = None
    """slurm-script: ``#SBATCH --partition`` (None = the cluster's default)."""
    sbatch_args: list[str] = field(default_factory=list)
    """slurm-script: more ``#SBATCH`` options, e.g. ["--account=rl", "--mem=0"]."""

    def __post_init__(self):
        check_rules(self)
        for key in ("job", "server_job"):
            v = getattr(self, key)
            if v is not None and not str(v).replace("_", "").isdigit():
                raise ValueError(f"{key}: expected a Slurm job id (digits, or JOB_TASK of an array) or null, "
                                 f"got {v!r}")
            if v is not None:
                setattr(self, key, str(v))
        for key in ("server_srun_args", "rank_srun_args", "sbatch_args"):
            for a in getattr(self, key):
                if not isinstance(a, str) or not a.startswith("-"):
                    raise ValueError(f"{key}: expected options such as '--mem=32G', got {a!r}")
                if key != "sbatch_args" and a.split("=", 1)[0] in _SRUN_TAKEN:
                    raise ValueError(f"{key}: {a.split('=', 1)[0]} is set by the launcher (see docs/multinode.md)")
        if isinstance(self.time, int) and not isinstance(self.time, bool):  # YAML 1.1 reads 1:30:00 as 5400
            if self.time < 1:
                raise ValueError(f"time: must be a positive duration, got {self.time!r}")
            self.time = f"{self.time // 3600}:{self.time // 60 % 60:02d}:{self.time % 60:02d}"


_SRUN_TAKEN = ("--jobid", "--ntasks", "-n", "--nodes", "-N", "--cpus-per-task", "-c", "--gpus-per-task",
               "--job-name", "-J", "--output", "-o", "--error", "-e", "--export")


LAUNCHERS = ("local", "ray", "slurm")
"""Values of the top-level ``launcher`` key (checked by ``AppConfig``): ``launch/local.py``,
``launch/ray_launcher.py`` and ``launch/slurm.py``."""
