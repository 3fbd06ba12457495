"""Mixture-of-experts weights: the model's fused expert tensors vs the checkpoint's per-expert ones.

Hugging Face transformers (5.x) keeps the experts of a sparse MoE block (Qwen2/Qwen3-MoE and the
models that share their checkpoint names) as two 3-D parameters per layer:

* ``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``: expert ``e``'s gate projection in rows ``[0, I)``
  of ``[e]``, its up projection in rows ``[I, 2I)``;
* ``...mlp.experts.down_proj`` ``[E, H, I]``.

Checkpoints on disk, SGLang's and vLLM's ``load_weights`` use one 2-D tensor per expert and
projection: ``...mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``.up_proj.weight`` ``[I, H]``,
``.down_proj.weight`` ``[H, I]`` (the loaders stack gate and up into their own fused ``w13`` and
down into ``w2``, expert ``e`` at index ``e``). The weight sync sends that checkpoint layout, so a
server loads what it would load from disk.

Every per-expert tensor is a contiguous byte range of the fused one, in the fused one's byte order
(gate_0, up_0, gate_1, up_1, ...; down_0, down_1, ...): renaming a bucket costs no copy and keeps
it unpadded.
"""

from __future__ import annotations

import re

import torch

GATE_UP = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj$")
DOWN = re.compile(r"^(?P<prefix>.*\.experts)\.down_proj$")
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def is_fused(name: str, shape) -> bool:
    """Is ``name`` a fused 3-D expert tensor this module splits?"""
    return len(shape) == 3 and (GATE_UP.match(name) is not None or DOWN.match(name) is not None)


def split_entries(name: str, shape) -> list[tuple[str, tuple[int, ...], int]]:
    """The checkpoint tensors of one fused expert tensor: (name, shape, element offset in the fused
    tensor), in byte order. A name that is not a fused expert tensor comes back whole."""
    shape = tuple(int(s) for s in shape)
    m = GATE_UP.match(name)
    if m and len(shape) == 3:
        e_n, rows, cols = shape
        if rows % 2:
            raise ValueError(f"{name}: gate_up_proj has {rows} rows; gate and up need an even count")
        i = rows // 2
        out = []
        for e in range(e_n):
            base = e * rows * cols
            out.append((f"{m['prefix']}.{e}.gate_proj.weight", (i, cols), base))
            out.append((f"{m['prefix']}.{e}.up_proj.weight", (i, cols), base + i * cols))
        return out
    m = DOWN.match(name)
    if m and len(shape) == 3:
        e_n, rows, cols = shape
        return [(f"{m['prefix']}.{e}.down_proj.weight", (rows, cols), e * rows * cols) for e in range(e_n)]
    return [(name, shape, 0)]


def to_checkpoint_layout(bucket):
    """``bucket`` (a :class:`areal_fast.weights.gather.Bucket`) with its fused expert tensors
    renamed into per-expert checkpoint tensors; the same bytes (no copy). A bucket without fused
    experts is returned as it is."""
    if not any(is_fused(n, s) for n, s in zip(bucket.names, bucket.shapes)):
        return bucket
    from areal_fast.weights.gather import Bucket

    names, dtypes, shapes, offsets = [], [], [], []
    for n, d, s, off in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets):
        for name, shape, elem in split_entries(n, s):
            names.append(name)
            dtypes.append(d)
            shapes.append(shape)
            offsets.append(off + elem * d.itemsize)
    return Bucket(bucket.index, names, dtypes, shapes, offsets, bucket.data, last=bucket.last)


def to_checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``{name: tensor}`` dict in the checkpoint layout (per-expert views of the fused tensors)."""
    out = {}
    for n, t in state.items():
        if not is_fused(n, t.shape):
            out[n] = t
            continue
        flat = t.contiguous().view(-1)
        for name, shape, elem in split_entries(n, t.shape):
            out[name] = flat[elem: elem + int(torch.Size(shape).numel())].view(shape)
    return out


def to_model_layout(state: dict[str, torch.Tensor], expected) -> dict[str, torch.Tensor]:
    """Fuse the per-expert checkpoint tensors of ``state`` into the model's fused tensors where
    ``expected`` (the model's parameter names) has them; other entries unchanged. Refuses a fused
    tensor with a missing expert, naming it."""
    expected = set(expected)
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for n, t in state.items():
        m = PER_EXPERT.match(n)
        if m and (f"{m['prefix']}.gate_up_proj" in expected or f"{m['prefix']}.down_proj" in expected):
            groups.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"])] = t
        else:
            out[n] = t
    for prefix, parts in groups.items():
        n_exp = 1 + max(e for e, _ in parts)
        for e in range(n_exp):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if (e, proj) not in parts:
                    raise ValueError(f"{prefix}.{e}.{proj}.weight is missing from the checkpoint "
                                     f"(it has experts up to {n_exp - 1})")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(n_exp)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n_exp)])
    return out


def checkpoint_views(named_params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> views into the model's fused expert parameters (writing a
    view writes the parameter), for a receiver that loads checkpoint-layout tensors."""
    out = {}
    for n, p in named_params.items():
        if is_fused(n, p.shape) and p.is_contiguous():
            flat = p.data.view(-1)
            for name, shape, elem in split_entries(n, p.shape):
                out[name] = flat[elem: elem + int(torch.Size(shape).numel())].view(shape)
    return out
