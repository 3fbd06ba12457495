"""Blockwise FP8 weights: what the trainer sends to servers that serve in FP8 (``weights.quantize: fp8``).

The layout is the one of block-quantised FP8 checkpoints (DeepSeek-V3, Qwen3-*-FP8), which SGLang's
and vLLM's ``Fp8LinearMethod`` load when the model's ``quantization_config`` has
``weight_block_size``:

* every linear projection's ``X.weight`` ``[R, C]`` travels as ``X.weight`` in ``torch.float8_e4m3fn``
  plus ``X.weight_scale_inv`` ``[ceil(R/128), ceil(C/128)]`` in float32, one scale per 128 x 128 block
  (a partial block at the bottom or right edge has a scale of its own);
* value = fp8 element x its block's ``weight_scale_inv`` (the servers' dequantisation);
* everything else keeps the send dtype: embeddings, norms, biases, the LM head, the MoE router
  (``mlp.gate``) and the shared-expert gate. The servers keep these unquantised when the config names
  them in ``modules_to_not_convert`` (:func:`quantization_config`): SGLang's FP8 config only
  quantises ``LinearBase`` layers and its Qwen MoE routers never get a quantisation config; vLLM's
  ``GateLinear`` router does unless it is named there, which is why the config lists every router.

Quantisation of one block: the weight is rounded to bf16 first (what the trainer would send
unquantised), ``amax = max(|block|, 1e-4)``, ``scale_inv = amax / 448`` (fp32; the block scale of
DeepGEMM's ``per_block_cast_to_fp8``, which multiplies by ``448 / amax`` where this divides by the
scale), ``q = fp8(clamp(w / scale_inv, +-448))``, rounded to nearest. :func:`quantize_ref` loops over
the blocks; :func:`quantize` is the vectorised twin (bitwise equal, ``tests/weights/test_weights_fp8.py``).

Where the codec runs: :func:`bucket_encoder` turns a gathered bucket of full tensors (checkpoint
layout) into the FP8 bucket, inside :class:`areal_fast.weights.gather.BucketGatherer` just before a
transport consumes it, so the broadcast, the disk writer and vLLM's transfer all send this layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch

from areal_fast.weights.config import FP8_BLOCK

__all__ = ["BLOCK", "FP8_MAX", "SCALE_SUFFIX", "SERVER_FLAGS", "quantize", "quantize_ref",
           "dequantize", "dequantize_ref", "is_quantized", "scale_shape", "quantization_config", "wire_entries",
           "encode_bucket", "bucket_encoder", "transfer_wire", "wire_view", "quantize_state", "dequantize_state",
           "write_fp8_checkpoint"]

BLOCK = FP8_BLOCK
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
AMAX_FLOOR = 1e-4  # an all-zero block gets scale 1e-4 / 448, not 0 (no 0/0)
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv

# The linear projections of the Qwen2/Qwen3(-MoE)/Llama families, per expert in the checkpoint layout.
_PROJ = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_quantized(name: str, shape) -> bool:
    """Does ``name`` travel as FP8? Two-dimensional weights of linear projections only (not the
    embeddings, norms, biases, LM head, routers: see the module docstring)."""
    return len(shape) == 2 and _PROJ.search(name) is not None


def scale_shape(shape) -> tuple[int, int]:
    r, c = (int(s) for s in shape)
    return -(-r // BLOCK[0]), -(-c // BLOCK[1])


def _round_bf16(w: torch.Tensor) -> torch.Tensor:
    return w.detach().to(torch.bfloat16).to(torch.float32)


# ----------------------------------------------------------------------------------- reference
def quantize_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 ``weight_scale_inv``) of a 2-D weight, block by block."""
    if w.dim() != 2:
        raise ValueError(f"quantize: expected a 2-D weight, got shape {tuple(w.shape)}")
    x = _round_bf16(w)
    sr, sc = scale_shape(x.shape)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((sr, sc), dtype=torch.float32, device=x.device)
    for i in range(sr):
        for j in range(sc):
            blk = x[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale = torch.clamp(blk.abs().max(), min=AMAX_FLOOR) / FP8_MAX
            s[i, j] = scale
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = torch.clamp(
                blk / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def dequantize_ref(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            sl = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            out[sl] = q[sl].to(torch.float32) * scale_inv[i, j]
    return out.to(dtype)


# ----------------------------------------------------------------------------------- vectorised
def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` zero-padded to whole blocks, viewed [R/128, 128, C/128, 128]."""
    r, c = x.shape
    sr, sc = scale_shape(x.shape)
    pr, pc = sr * BLOCK[0] - r, sc * BLOCK[1] - c
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.view(sr, BLOCK[0], sc, BLOCK[1]), r, c


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised :func:`quantize_ref` (bitwise equal; the padding zeros never raise a block's amax)."""
    if w.dim() != 2:
        raise ValueError(f"quantize: expected a 2-D weight, got shape {tuple(w.shape)}")
    xb, r, c = _blocks(_round_bf16(w))
    scale = torch.clamp(xb.abs().amax(dim=(1, 3)), min=AMAX_FLOOR) / FP8_MAX  # [sr, sc]
    q = torch.clamp(xb / scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(xb.shape[0] * BLOCK[0], xb.shape[2] * BLOCK[1])[:r, :c].contiguous()
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The servers' value of a block-quantised weight: fp8 x its block's scale, in fp32 (then ``dtype``)."""
    if tuple(scale_inv.shape) != scale_shape(q.shape):
        raise ValueError(f"dequantize: scale of shape {tuple(scale_inv.shape)} does not fit a weight of shape "
                         f"{tuple(q.shape)} in {BLOCK[0]}x{BLOCK[1]} blocks (expected {scale_shape(q.shape)})")
    full = scale_inv.to(torch.float32).repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return (q.to(torch.float32) * full[: q.shape[0], : q.shape[1]]).to(dtype)


# ----------------------------------------------------------------------------------- state dicts
def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint-layout ``{name: tensor}`` dict as FP8 checkpoints hold it (quantised weights and
    their scales; every other tensor unchanged)."""
    out = {}
    for n, t in state.items():
        if is_quantized(n, t.shape):
            out[n], out[n + SCALE_SUFFIX] = quantize(t)
        else:
            out[n] = t
    return out


def dequantize_state(named: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.float32
                     ) -> list[tuple[str, torch.Tensor]]:
    """Received ``(name, tensor)`` pairs with every FP8 weight and its ``_scale_inv`` replaced by the
    dequantised weight (in ``dtype``); other entries unchanged. A weight without its scale (or the
    reverse) is refused, naming it: both travel in the same bucket."""
    named = list(named)
    scales = {n.removesuffix(SCALE_SUFFIX): t for n, t in named if n.endswith(SCALE_SUFFIX)}
    if not scales and not any(t.dtype == FP8_DTYPE for _, t in named):
        return named
    out, used = [], set()
    for n, t in named:
        if n.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == FP8_DTYPE:
            if n not in scales:
                raise ValueError(f"{n} arrived in FP8 without {n + SCALE_SUFFIX}")
            out.append((n, dequantize(t, scales[n], dtype)))
            used.add(n)
        else:
            out.append((n, t))
    orphans = sorted(set(scales) - used)
    if orphans:
        raise ValueError(f"{orphans[0] + SCALE_SUFFIX} arrived without its FP8 weight {orphans[0]}")
    return out


# ----------------------------------------------------------------------------------- the wire
def wire_entries(names: Sequence[str], shapes: Sequence, dtypes: Sequence[torch.dtype]
                 ) -> list[tuple[str, tuple[int, ...], torch.dtype, int, str]]:
    """The entries of one bucket on the wire, in order: ``(name, shape, dtype, source index, kind)``,
    kind 'weight' (FP8), 'scale' (its fp32 ``weight_scale_inv``) or 'as_is'. The order is by element
    size, largest first (scales, the unquantised tensors, then the FP8 weights; stable within each):
    every tensor then starts at a multiple of its element size with no padding, as SGLang's
    flattened bucket needs."""
    entries = []
    for i, (n, s, d) in enumerate(zip(names, shapes, dtypes)):
        s = tuple(int(x) for x in s)
        if is_quantized(n, s):
            entries.append((n + SCALE_SUFFIX, scale_shape(s), torch.float32, i, "scale"))
            entries.append((n, s, FP8_DTYPE, i, "weight"))
        else:
            entries.append((n, s, d, i, "as_is"))
    return sorted(entries, key=lambda e: -e[2].itemsize)


def encode_bucket(bucket):
    """``bucket`` (:class:`areal_fast.weights.gather.Bucket` of full tensors) as the FP8 bucket: the
    fused MoE experts split into the checkpoint's per-expert tensors, every linear weight quantised,
    laid out back to back in :func:`wire_entries` order (a new buffer on the bucket's device)."""
    from areal_fast.weights.experts import to_checkpoint_layout
    from areal_fast.weights.gather import Bucket

    bucket = to_checkpoint_layout(bucket)
    entries = wire_entries(bucket.names, bucket.shapes, bucket.dtypes)
    quantized = {i: quantize(bucket.tensor(i)) for _n, _s, _d, i, kind in entries if kind == "weight"}
    sizes = [math.prod(s) * d.itemsize for _n, s, d, _i, _k in entries]
    data = torch.empty(sum(sizes), dtype=torch.uint8, device=bucket.data.device)
    offsets, off = [], 0
    for (_n, s, d, i, kind), nb in zip(entries, sizes):
        t = bucket.tensor(i) if kind == "as_is" else quantized[i][0 if kind == "weight" else 1]
        data[off:off + nb].view(d).view(s).copy_(t)
        offsets.append(off)
        off += nb
    return Bucket(bucket.index, [e[0] for e in entries], [e[2] for e in entries], [e[1] for e in entries],
                  offsets, data, last=bucket.last)


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the collectives carry it: an FP8 tensor as its bytes (gloo has no FP8 type; a broadcast of
    one-byte elements is the same bytes whatever their type), any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def bucket_encoder(config) -> Callable | None:
    """The bucket transform of a :class:`~areal_fast.weights.config.WeightSyncConfig` (None: none)."""
    return encode_bucket if getattr(config, "quantize", None) == "fp8" else None


def transfer_wire(plan, src, dtypes) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtype names, shapes) of vLLM's ``update_info`` for an FP8 update: the entries of every
    bucket of ``plan`` in the order :func:`encode_bucket` sends them (the worker receives by position)."""
    from areal_fast.weights.experts import split_entries

    names, dts, shapes = [], [], []
    for b in range(plan.n_buckets):
        bn, bs, bd = [], [], []
        for t in plan.tensors_of(b).tolist():
            for name, shape, _ in split_entries(src.names[t], src.shapes[t]):
                bn.append(name)
                bs.append(shape)
                bd.append(dtypes[t])
        for n, s, d, _i, _k in wire_entries(bn, bs, bd):
            names.append(n)
            dts.append(str(d).removeprefix("torch."))
            shapes.append(list(s))
    return names, dts, shapes


# ----------------------------------------------------------------------------------- the servers
# Launch flags of servers serving the FP8 layout: SGLang's and vLLM's ``--quantization fp8`` (their
# Fp8Config; the checkpoint's quantization_config, from write_fp8_checkpoint, makes it block-quantised:
# without one both would quantise a bf16 checkpoint per tensor at load, which the weights sent here do
# not fit), the embedded engine's flag of the same name (embedded/fp8.py).
SERVER_FLAGS = {"sglang": ("--quantization", "fp8"), "vllm": ("--quantization", "fp8"),
                "embedded": ("--quantization", "fp8")}

def quantization_config(names: Sequence[str]) -> dict:
    """The ``quantization_config`` of the model's ``config.json`` for servers loading the FP8 layout
    (the keys of Qwen3-*-FP8 checkpoints; ``names``: the checkpoint-layout tensor names, which name
    the modules kept unquantised)."""
    keep = sorted({n.removesuffix(".weight") for n in names
                   if n.endswith(".weight") and (n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
                                                 or n.startswith("lm_head"))})
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK), "modules_to_not_convert": keep}


def write_fp8_checkpoint(src_dir: str, dst_dir: str) -> str:
    """The FP8 checkpoint SGLang and vLLM are launched on (``--quantization fp8``): the weights of the
    Hugging Face checkpoint ``src_dir`` in the layout this module sends (per-expert MoE tensors, linear
    weights in FP8 with their scales) and its ``config.json`` with :func:`quantization_config`; the
    other files (tokenizer, generation config) copied. Returns ``dst_dir``."""
    import glob
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from areal_fast.weights.experts import to_checkpoint_state

    files = sorted(glob.glob(os.path.join(src_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"write_fp8_checkpoint: no *.safetensors files in {src_dir!r}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    state = to_checkpoint_state(state)
    out = {n: (t if t.dtype == FP8_DTYPE or n.endswith(SCALE_SUFFIX) else t.to(torch.bfloat16)).contiguous()
           for n, t in quantize_state(state).items()}
    os.makedirs(dst_dir, exist_ok=True)
    for fn in os.listdir(src_dir):
        p = os.path.join(src_dir, fn)
        if os.path.isfile(p) and not fn.endswith(".safetensors") and fn != "model.safetensors.index.json":
            shutil.copy2(p, os.path.join(dst_dir, fn))
    save_file(out, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(list(out))
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst_dir
