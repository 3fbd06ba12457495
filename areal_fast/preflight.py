"""What a run config asks of this machine, checked before any process starts (:func:`check_machine`):
the model and tokenizer directories, the data files, the output directory, CUDA devices and the GPU
indices asked for, and the optional packages the config needs.

``areal-fast train``, ``eval`` and ``config --check`` call :func:`check_machine` right after
:func:`areal_fast.config.load_config`, which checks everything that does not depend on the
machine. Nothing here imports torch or initialises CUDA (GPUs are counted from the driver's files).
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_fast.config import AppConfig
from areal_fast.configutil import ConfigError, device_indices

__all__ = ["check_machine", "gpu_count"]


def gpu_count() -> int:
    """NVIDIA devices on this machine, counted without importing torch or initialising CUDA (the
    driver lists one directory per device under /proc/driver/nvidia/gpus; device nodes otherwise)."""
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    return sum(1 for d in Path("/dev").glob("nvidia[0-9]*") if d.name[len("nvidia"):].isdigit())


def _visible(physical: int) -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return physical
    entries = [e for e in env.split(",") if e.strip()]
    if any(e.strip().startswith("-") for e in entries):  # '-1' hides every device
        return 0
    return min(len(entries), physical)


def check_machine(cfg: AppConfig, *, gpus: int | None = None) -> None:
    """What the config asks of this machine, checked before any process starts: the model and
    tokenizer directories, the data files (read once: encoding, JSON, row shape, the prompt field),
    CUDA devices and the GPU indices in ``train.gpus`` / ``rollout.gpus``, and optional packages.
    ``gpus`` overrides the detected device count (tests). With ``launcher: ray`` the servers and
    ranks run on other machines: only the Ray package is checked here."""
    import importlib.util

    def need(module: str, key: str, why: str) -> None:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}: {why} needs the `{module}` package, which is not installed")

    if cfg.launcher == "ray":
        need("ray", "launcher", "launcher 'ray'")
        return
    if cfg.launcher == "slurm":  # the steps run on the allocation's nodes: Slurm's own programs are checked
        import shutil

        for prog in ("srun", "scancel"):
            if shutil.which(prog) is None:
                raise ConfigError(f"launcher: 'slurm' needs Slurm's `{prog}` on PATH, which is not found here")
        return
    _check_writable_dir("experiment.output_dir", cfg.experiment.out)
    if not cfg.model.warm_start.enabled:
        _check_model_dir("model.path", cfg.model.path)
    if cfg.model.tokenizer:
        _check_model_dir("model.tokenizer", cfg.model.tokenizer, weights=False)
    for key in ("train", "eval"):
        source = getattr(cfg.data, key)
        if source and source.startswith("hf:"):
            need("datasets", f"data.{key}", f"source {source!r}")
        elif source and not source.startswith("synthetic:"):
            from areal_fast.data.datasets import build_prompts, read_rows

            try:
                rows = build_prompts(read_rows(source, cfg.data, key, cfg.experiment.seed), cfg.data, None, source)
            except (ValueError, KeyError, OSError) as e:
                raise ConfigError(f"data.{key}: {e.args[0] if isinstance(e, KeyError) else e}") from None
            _check_row_rewards(f"data.{key}", source, rows)
    physical = gpu_count() if gpus is None else gpus
    visible = physical if gpus is not None else _visible(physical)
    r, t = cfg.rollout, cfg.train
    launching = not r.servers
    server_gpus = physical if r.gpus else visible  # rollout.gpus replaces what the servers inherit
    if launching and r.server == "sglang":
        need("sglang", "rollout.server", "server 'sglang'")
        if server_gpus == 0:
            raise ConfigError("rollout.server: 'sglang' servers need a CUDA device and this machine has none "
                              "(use rollout.server=embedded)")
    if launching and r.server == "embedded" and r.device.startswith("cuda") and server_gpus == 0:
        raise ConfigError(f"rollout.device: {r.device!r} asked for, but this machine has no CUDA device")
    train_gpus = physical if t.gpus else visible
    if t.device and t.device.startswith("cuda") and train_gpus == 0:
        raise ConfigError(f"train.device: {t.device!r} asked for, but this machine has no CUDA device "
                          "(use train.device=cpu)")
    for key, lists in (("rollout.gpus", r.gpus if launching else []), ("train.gpus", t.gpus)):
        for i, text in enumerate(lists):
            indices = device_indices(text) or []
            bad = [g for g in indices if g >= physical]
            if bad:
                where = f"{key}[{i}]"
                raise ConfigError(f"{where}: GPU {bad[0]} asked for, but this machine has {physical} GPU(s) "
                                  f"(indices 0..{physical - 1})" if physical else
                                  f"{where}: GPU {bad[0]} asked for, but this machine has no GPU")
    uses_cuda = (t.device or "").startswith("cuda") or (t.device is None and train_gpus > 0)
    if uses_cuda and t.world_size > 1:
        have = len(t.gpus) if t.gpus else train_gpus
        if have < t.world_size:
            raise ConfigError(f"train.world_size: {t.world_size} GPU ranks asked for, but "
                              f"{'train.gpus lists' if t.gpus else 'this machine has'} {have} GPU(s)")


def _check_row_rewards(key: str, source: str, rows) -> None:
    """A row may name its own reward ('reward' field); each distinct name must resolve like reward.name."""
    from areal_fast.reward.registry import get_reward_fn

    first: dict = {}
    for row in rows:
        name = row.task.get("reward")
        if name is not None and name not in first:
            first[name] = row.index
    for name, index in first.items():
        try:
            get_reward_fn(name)
        except Exception as e:  # noqa: BLE001 - ValueError from the registry, anything from a user module
            raise ConfigError(f"{key}: {source} row {index}: field 'reward' = {name!r} does not resolve: {e}") from None


def _check_writable_dir(key: str, path: Path) -> None:
    """``path`` is a directory we can write in, or can be created (its nearest existing ancestor is)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} cannot be a directory: {str(p)!r} is a file")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {str(path)!r} is not writable (no write permission on {str(p)!r})")


def _check_model_dir(key: str, path: str | None, weights: bool = True) -> None:
    p = Path(path or "")
    if not p.exists():
        raise ConfigError(f"{key}: local directory {str(p)!r} does not exist (models are loaded from a local "
                          f"directory, not downloaded by name)")
    if not p.is_dir():
        raise ConfigError(f"{key}: {str(p)!r} is not a directory")
    if weights and not (p / "config.json").is_file():
        raise ConfigError(f"{key}: {str(p)!r} has no config.json (expected a Hugging Face model directory)")
