"""``train.lora``: train a LoRA adapter on the frozen base instead of the whole model (docs/lora.md).

Torch-free, below the trainer and the weight sync that both read it: the run config checks it when it
loads. The adapter modules are PEFT's (``areal_fast.trainer.lora``), and so is their file format
(``areal_fast.weights.adapter``); this section only says what to build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, option

# The linear layers of a decoder block of the models the trainer builds (Qwen2/2.5/3, Llama,
# Mistral: ``model.layers[i].self_attn.*`` and ``model.layers[i].mlp.*``). vLLM and SGLang serve
# adapters on exactly these (their packed qkv / gate_up layers take the per-projection weights).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules a LoRA adapter could name that this trainer refuses, and why.
REFUSED_MODULES = {
    "lm_head": "the fused loss reads the LM head's weight [V, H] directly; an adapter on it would be skipped",
    "embed_tokens": "vLLM and SGLang serve adapters on the decoder's linear layers, not on the embeddings",
}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """A LoRA actor: ``W x + (alpha / rank) B A x`` on each target module, the base frozen."""

    rank: int = option(8, ge=1)
    """r: the inner dimension of each adapter (>= 1; a server needs ``--max-lora-rank`` >= it)."""
    alpha: float = option(16.0, gt=0)
    """The adapter's output is scaled by alpha / rank (> 0)."""
    dropout: float = option(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training, in [0, 1) (the proximal recompute runs without)."""
    target_modules: list[str] = field(default_factory=lambda: list(TARGET_MODULES))
    """Linear layers of every decoder block that get an adapter: any of q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj."""
    name: str = "areal-lora"
    """The adapter's name on the servers: requests name it (vLLM's ``model``, SGLang's ``lora_path``)."""
    save_merged: bool = False
    """With ``checkpoint.save_hf``: ``final/merged/`` also holds the base with the adapter merged in
    (a plain HF model); ``final/`` always holds the adapter."""

    def __post_init__(self):
        check_rules(self)
        self.alpha = float(self.alpha)
        self.dropout = float(self.dropout)
        if isinstance(self.target_modules, str) or not isinstance(self.target_modules, list | tuple):
            raise ValueError(f"target_modules: must be a list of module names, got {self.target_modules!r}")
        mods = [str(m) for m in self.target_modules]
        if not mods:
            raise ValueError(f"target_modules: must name at least one of {', '.join(TARGET_MODULES)}")
        for m in mods:
            if m in REFUSED_MODULES:
                raise ValueError(f"target_modules: {m!r} is not supported ({REFUSED_MODULES[m]})")
            if m not in TARGET_MODULES:
                raise ValueError(f"target_modules: unknown module {m!r} (valid: {', '.join(TARGET_MODULES)})")
        if len(set(mods)) != len(mods):
            raise ValueError(f"target_modules: {mods!r} names a module twice")
        self.target_modules = mods
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name) or self.name == "default":
            raise ValueError(f"name: must be 1-64 characters of letters, digits, '.', '_', '-' (not 'default', "
                             f"the base model's served name), got {self.name!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py MaxLoRARanks, 0.11 .. 0.33)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def server_lora_args(engine: str, cfg: LoRAConfig) -> list[str]:
    """The flags a launched server of ``engine`` ('embedded', 'sglang', 'vllm') needs to serve the
    run's adapter (loaded at run time)."""
    if engine == "vllm":
        rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= cfg.rank), None)
        if rank is None:
            raise ValueError(f"train.lora.rank: {cfg.rank} is above vLLM's largest --max-lora-rank "
                             f"({VLLM_MAX_LORA_RANKS[-1]})")
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    if engine == "sglang":
        return ["--enable-lora", "--max-lora-rank", str(cfg.rank), "--lora-target-modules", *cfg.target_modules,
                "--max-loras-per-batch", "1"]
    return ["--enable-lora", "--max-lora-rank", str(cfg.rank), "--max-loras", "1"]


def check_run(app) -> None:
    """The rest of a run config that a LoRA actor needs (called by ``AppConfig`` at load), and the
    launched servers' LoRA flags added to ``rollout.server_args`` (``server_env`` for vLLM)."""
    r, lora = app.rollout, app.train.lora
    if r.client_processes > 1:
        raise ValueError("train.lora with rollout.client_processes > 1: the sharded client's workers do not name "
                         "the adapter in their requests; use 1")
    if not app.weights.shared_fs:
        raise ValueError("train.lora with weights.shared_fs false: adapters reach the servers as files (a PEFT "
                         "directory each update); the servers must read trainer rank 0's files")
    if app.weights.quantize is not None:
        raise ValueError(f"weights.quantize {app.weights.quantize!r} with train.lora: a LoRA run sends only the "
                         f"adapters, which the servers apply unquantised on top of the base weights; nothing "
                         f"would be quantised on sync. Set weights.quantize null (or serve an FP8 base checkpoint)")
    if app.weights.method != "disk":
        raise ValueError(f"train.lora with weights.method {app.weights.method!r}: an adapter travels as a PEFT "
                         f"directory the servers load (no broadcast group, no weight transfer); set "
                         f"weights.method: disk or leave it null")
    if r.api != "vllm":
        if r.pause_mode in ("in_place", "retract"):
            raise ValueError(f"rollout.pause_mode {r.pause_mode!r} with train.lora on SGLang's API: SGLang replaces an "
                             f"adapter by unloading it, and its unload waits until no request in flight uses it "
                             f"(kept and retracted requests do), so the update would never finish; use 'abort'")
        if r.pause_mode == "auto":
            r.pause_mode = "abort"
    if r.server in ("embedded", "sglang", "vllm") and not r.servers and "--enable-lora" not in r.server_args:
        r.server_args = [*r.server_args, *server_lora_args(r.server, lora)]
        if r.server == "vllm":
            r.server_env = {**r.server_env, VLLM_RUNTIME_LORA_ENV: "1"}
