"""Build a Hugging Face causal LM for training: meta-device init, FSDP2, local safetensors.

Order (torchtitan's): activation checkpointing per decoder block, ``fully_shard`` per block,
then the root (which then owns embeddings, final norm and lm_head), ``to_empty`` on the
device, load the weights. The root is :class:`PolicyModule`, a thin wrapper whose forward
runs the decoder and then the loss/log-prob head *inside* the root's FSDP2 forward, so the
lm_head weight is unsharded there (the fused-linear ops need the full ``[V, H]`` weight).
"""

from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist
from torch import nn

from areal_fast.trainer import attention


class PolicyModule(nn.Module):
    """Root module: ``forward(fn, input_ids, position_ids, cu_seqlens, max_seqlen, **kw)`` runs
    the decoder over one packed row and returns ``fn(hidden [T, H], weight [V, H], bias, **kw)``."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, fn, input_ids, position_ids, cu_seqlens, max_seqlen, **kw):
        out = self.lm.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
            use_cache=False,
        )
        hidden = out.last_hidden_state[0]
        head = self.lm.lm_head
        return fn(hidden, head.weight, head.bias, **kw)




def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _reinit_rotary(lm: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (RoPE inv_freq) are garbage after meta init + to_empty: rebuild them."""
    for mod in lm.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "config"):
            with torch.device(device):
                fresh = type(mod)(mod.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(mod, name, buf.to(device))
            if hasattr(fresh, "attention_scaling"):
                mod.attention_scaling = fresh.attention_scaling


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor] | None:
    """All tensors of the ``*.safetensors`` files in ``path`` (None when there are none)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def random_hf_state_dict(config, seed: int) -> dict[str, torch.Tensor]:
    """The state dict of a freshly initialised model (same on every rank for the same seed)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return lm.state_dict()


def build_policy(
    model_path: str,
    *,
    device: torch.device,
    mesh=None,
    param_dtype: str = "bfloat16",
    gradient_checkpointing: bool = False,
    attn_impl: str = "auto",
    seed: int = 1,
    lora=None,
    expert_parallel: bool = False,
) -> PolicyModule:
    """A sharded :class:`PolicyModule` with the weights of ``model_path`` (fp32 master weights).

    ``mesh`` is a 1-D DeviceMesh, or a ``parallel.TrainerMesh`` (its ``fsdp_mesh`` shards the dense
    parameters; with ``ep`` > 1 each rank keeps its own experts, ``parallel/expert.py``), or None (no
    sharding: a plain module, for world size 1 without torch.distributed). ``expert_parallel``: the
    expert-parallel code path even with ``ep`` 1 (one rank, no exchange; the GPU check runs it).
    On CUDA the compute runs in ``param_dtype`` with fp32 gradient reduction.
    ``lora`` (a ``LoRAConfig``): PEFT's adapters on the frozen base (``trainer/lora.py``), sharded
    with their blocks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model_path {model_path!r} has no config.json (a local HF model directory is needed)")
    config = AutoConfig.from_pretrained(model_path)
    from areal_fast.trainer.parallel.mesh import TrainerMesh

    tmesh = mesh if isinstance(mesh, TrainerMesh) else None
    if tmesh is not None:
        from areal_fast.trainer.config import check_parallel_model

        text = getattr(config, "get_text_config", lambda: config)()
        check_parallel_model(tmesh, num_experts=getattr(text, "num_experts", None)
                             or getattr(text, "num_local_experts", None),
                             num_heads=getattr(text, "num_attention_heads", None),
                             where=os.path.join(model_path, "config.json"))
        mesh = tmesh.fsdp_mesh
    attn_name = attention.register(attn_impl)
    attention.resolve_impl(attn_impl, device)  # fail early on an impossible explicit choice
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn_name, dtype=torch.float32)
    lm.config.use_cache = False
    if lora is not None:
        from areal_fast.trainer import lora as lora_mod

        lm = lora_mod.inject(lm, lora)
    from areal_fast.trainer.parallel.expert import apply_expert_parallel, expert_slices

    local_experts = set(apply_expert_parallel(lm, tmesh, force=expert_parallel))  # kept out of FSDP2
    if gradient_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = lm.model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    policy = PolicyModule(lm)
    if mesh is not None:
        mp = None
        if device.type == "cuda" and param_dtype != "float32":
            mp = MixedPrecisionPolicy(param_dtype=_dtype(param_dtype), reduce_dtype=torch.float32)
        kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        if local_experts:
            kw["ignored_params"] = local_experts
        for layer in lm.model.layers:
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
    policy.to_empty(device=device)
    _reinit_rotary(lm, device)

    full = load_hf_state_dict(model_path)
    if full is None:
        full = random_hf_state_dict(config, seed)
    if getattr(config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)
    expected = set(_hf_names(policy))
    from areal_fast.weights.experts import to_model_layout

    full = to_model_layout(full, expected)  # MoE checkpoints: per-expert tensors -> the model's fused ones
    if lora is not None:  # the base's names at .base_layer., the adapters initialised (not in the checkpoint)
        full = {**lora_mod.policy_state(full, sorted(expected), seed), **lora_mod.adapter_init(policy, hf_name, seed)}
    missing = expected - set(full)
    if missing:
        raise ValueError(f"{model_path}: safetensors lack {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    full = {"lm." + k: v for k, v in full.items() if k in expected}
    for qual, (first, n, total) in expert_slices(policy).items():  # this rank's experts of the full tensors
        key = "lm." + hf_name(qual)
        if full[key].shape[0] != total:
            raise ValueError(f"{model_path}: {hf_name(qual)} has {full[key].shape[0]} experts, the model {total}")
        full[key] = full[key][first: first + n]
    set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, strict=False))
    return policy


def _hf_names(policy: PolicyModule) -> list[str]:
    """HF names of the parameters (tied ones once) and persistent buffers."""
    names = [hf_name(k) for k, _ in policy.named_parameters()]
    for mod_name, mod in policy.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set:
                names.append(hf_name(f"{mod_name}.{b}" if mod_name else b))
    return names


def hf_name(key: str) -> str:
    """Map a PolicyModule state-dict key to the HF checkpoint name."""
    key = key.replace("_checkpoint_wrapped_module.", "")
    return key[3:] if key.startswith("lm.") else key


def init_process_group_if_needed(device: torch.device) -> None:
    """Single-process callers (a controller with world size 1) get a gloo/nccl group over an
    in-process ``HashStore``: no TCP store (a ``tcp://`` init hosts an unauthenticated store on every
    interface), and gloo's pair listener on loopback only. Under torchrun: its ``env://`` rendezvous
    (torchrun's agent hosts that store; see docs/security.md)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # gloo's own listener on loopback, for this group only (a later weight group may need another interface)
        old = os.environ.get("GLOO_SOCKET_IFNAME")
        if backend == "gloo" and old is None:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        try:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        finally:
            if backend == "gloo" and old is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def shutdown_process_group(barrier: bool = True) -> None:
    """The end of a trainer rank: with ``barrier`` every rank reaches a barrier (all of its own
    collectives and the other ranks' last writes are done) before any tears its group down. A rank
    that destroyed its gloo group while a peer still worked on the last collective, or left it to
    interpreter exit, could end in ``terminate called without an active exception`` (SIGABRT) after
    the work was done. ``barrier=False`` where the caller's last collective already was the end
    (the run's ``stop`` announcement: a barrier there would hang the followers of a failed rank 0)."""
    if not dist.is_initialized():
        return
    if barrier and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
