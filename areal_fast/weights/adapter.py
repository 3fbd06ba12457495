"""A LoRA adapter on the wire and on disk: PEFT's ``save_pretrained`` output (docs/lora.md).

``adapter_config.json`` and ``adapter_model.safetensors`` with names
``base_model.model.<module>.lora_A.weight`` (no adapter name), which PEFT, vLLM
(``/v1/load_lora_adapter``) and SGLang (``/load_lora_adapter``) load unchanged. The trainer's LoRA
actor (``areal_fast.trainer.lora``) names its adapter matrices this way and exports them with
:func:`write_adapter`; the adapter-only weight update (``weights/lora_sync.py``) sends them as such a
directory.
"""

from __future__ import annotations

import json
import os

import torch

from areal_fast.lora_config import LoRAConfig

ADAPTER = "default"  # PEFT's adapter name inside the trainer's model (it never reaches a file)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def peft_config(cfg: LoRAConfig, base_model: str | None = None):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_model)


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def file_name(name: str) -> str:
    """An adapter parameter's name in PEFT's file (``...q_proj.lora_A.default.weight`` ->
    ``base_model.model....q_proj.lora_A.weight``)."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def write_adapter(path: str, tensors: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str | None = None,
                  metadata: dict | None = None) -> int:
    """Write a PEFT adapter directory (config + safetensors, fsynced); returns the bytes written."""
    from safetensors.torch import save_file

    bad = [k for k in tensors if not (k.startswith(_PEFT_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))
                                      and f".{ADAPTER}." not in k)]
    if bad:
        raise ValueError(f"write_adapter: {bad[0]!r} is not a PEFT adapter name (base_model.model.<module>."
                         f"lora_A.weight / lora_B.weight)")
    os.makedirs(path, exist_ok=True)
    conf = peft_config(cfg, base_model).to_dict()
    conf = {k: (sorted(v) if isinstance(v, set) else v) for k, v in conf.items()}
    conf["peft_type"] = "LORA"
    conf["task_type"] = "CAUSAL_LM"
    wpath, cpath = os.path.join(path, WEIGHTS_FILE), os.path.join(path, CONFIG_FILE)
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, wpath,
              metadata={"format": "pt", **(metadata or {})})
    with open(cpath, "w") as f:
        json.dump(conf, f, indent=1, default=str)
    for p in (wpath, cpath):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return os.path.getsize(wpath) + os.path.getsize(cpath)
