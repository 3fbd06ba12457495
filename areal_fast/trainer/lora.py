"""The LoRA actor's adapter: PEFT's modules on the frozen base, PEFT's file format (docs/lora.md).

:func:`inject` puts PEFT's LoRA layers into the (meta-device) HF model before FSDP2 shards it, so an
adapter's two matrices are sharded with their block like every other parameter and the base
stays frozen (``requires_grad`` False: no gradient, no optimizer state). :func:`policy_state` maps
the checkpoint's HF names onto the injected model (a target's weight lives at ``.base_layer.``) and
adds the adapter's initial values (A: Kaiming-uniform from the run's seed, the same on every rank;
B: zeros, so step 0 is the base model exactly).

On the wire and on disk an adapter is PEFT's ``save_pretrained`` output: ``adapter_config.json`` and
``adapter_model.safetensors`` with names ``base_model.model.<module>.lora_A.weight`` (no adapter
name), which PEFT, vLLM (``/v1/load_lora_adapter``) and SGLang (``/load_lora_adapter``) load
unchanged; ``areal_fast.weights.adapter`` writes it (the weight sync sends adapters as such files).
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from areal_fast.lora_config import LoRAConfig
from areal_fast.weights.adapter import ADAPTER, file_name, is_adapter_param, peft_config, write_adapter


def inject(lm: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """PEFT's LoRA layers in ``lm`` (in place) on every target module; everything else frozen.
    A target the model lacks is named (PEFT would only fail when none matches)."""
    from peft import inject_adapter_in_model

    present = {name.rsplit(".", 1)[-1] for name, m in lm.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in cfg.target_modules if t not in present]
    if missing:
        raise ValueError(f"lora.target_modules: {type(lm).__name__} has no linear layer named {missing} "
                         f"(it has {sorted(present)})")
    lm = inject_adapter_in_model(peft_config(cfg), lm, adapter_name=ADAPTER)
    for name, p in lm.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    return lm


def base_name(name: str) -> str:
    """The HF checkpoint name of an injected model's base parameter."""
    return name.replace(".base_layer.", ".")


def initial_adapter(name: str, shape, seed: int) -> torch.Tensor:
    """An adapter matrix's initial value (PEFT's default init: A Kaiming-uniform, B zero), seeded by
    the parameter's name so every rank makes the same one."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name)) % (2**63))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


def policy_state(full: dict[str, torch.Tensor], expected: list[str], seed: int) -> dict[str, torch.Tensor]:
    """The full state of an injected model from the base checkpoint ``full`` (HF names): each
    ``expected`` name (the injected model's, HF-style) from its base tensor, or initialised."""
    out = {}
    for name in expected:
        if is_adapter_param(name):
            continue
        src = base_name(name)
        if src in full:
            out[name] = full[src]
    return out


def adapter_init(policy: nn.Module, hf_name, seed: int) -> dict[str, torch.Tensor]:
    """HF-style name -> initial value of every adapter parameter of ``policy``."""
    return {hf_name(k): initial_adapter(hf_name(k), tuple(p.shape), seed)
            for k, p in policy.named_parameters() if is_adapter_param(k)}


def iter_adapter(model: nn.Module, hf_name):
    """(PEFT file name, full tensor) of each adapter matrix, in a fixed order. Collective under FSDP2:
    every rank must iterate it to the end."""
    for k, v in model.state_dict().items():
        if is_adapter_param(k):
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            yield file_name(hf_name(k)), full


def merged_state(named, scaling: float) -> dict[str, torch.Tensor]:
    """HF state dict of the base with each adapter merged in (``W + scaling * B A``), from
    ``(name, tensor)`` pairs of an injected model (HF-style names)."""
    base, a_of, b_of = {}, {}, {}
    for name, t in named:
        if ".lora_A." in name:
            a_of[name.split(".lora_A.")[0]] = t
        elif ".lora_B." in name:
            b_of[name.split(".lora_B.")[0]] = t
        else:
            base[base_name(name)] = t
    for mod, a in a_of.items():
        w = base[f"{mod}.weight"]
        base[f"{mod}.weight"] = (w.float() + scaling * (b_of[mod].float() @ a.float())).to(w.dtype)
    return base


def export_adapter(actor, path: str, dtype: torch.dtype | None = None) -> None:
    """``final/``: the adapter (PEFT's directory) and, with ``lora.save_merged``, the merged model in
    ``path/merged`` (config.json + model.safetensors). Collective; rank 0 writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    rank0 = dist.get_rank() == 0
    cfg = actor.lora
    tensors = actor.adapter_state_dict()  # collective
    if rank0:
        write_adapter(path, tensors, cfg, actor.config.model_path)
    if cfg.save_merged:
        named = [(n, t.detach().cpu()) for n, t in actor.iter_full_params(dtype)]
        if rank0:
            merged = merged_state(named, cfg.scaling)
            out = os.path.join(path, "merged")
            os.makedirs(out, exist_ok=True)
            actor.hf_config.save_pretrained(out)
            save_file({k: v.contiguous() for k, v in merged.items()}, os.path.join(out, "model.safetensors"),
                      metadata={"format": "pt"})
    dist.barrier()
