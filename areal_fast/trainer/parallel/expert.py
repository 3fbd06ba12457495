"""Expert parallelism for transformers' fused MoE experts (Qwen3-MoE first).

Each rank of an expert-parallel group of ``ep`` ranks keeps ``E / ep`` whole experts of every sparse
block: rank ``j`` of the group holds experts ``[j E/ep, (j+1) E/ep)`` as plain (not FSDP2) fused
parameters ``gate_up_proj [E/ep, 2I, H]`` and ``down_proj [E/ep, H, I]`` under the model's own
names. A block's forward (:class:`ExpertParallelExperts`):

1. the router (dense, under FSDP2, replayable by ``moe_routing``) picks the top-k experts of each
   of this rank's tokens, as in the model;
2. the (token, expert) pairs are sorted by expert, so each owner's rows are contiguous; the
   per-expert counts go out first (``all_to_all_single`` of E ints), then the rows themselves
   (``all_to_all_single``, differentiable: its backward is the reverse all-to-all);
3. the owner runs its experts on the rows it received (the model's MLP: ``act(gate) * up``, then
   down), and the results go back by the reverse all-to-all;
4. each result is scaled by its routing weight and added into its token's row, as the model does.

The experts of a rank are replicated over the world / ep ranks that hold the same experts (the
mesh's ``expert_dp`` group): :func:`finalize_expert_grads` all-reduces their gradients there once
per optimizer step. Gradient scale: the actor multiplies each rank's loss by the world size
(FSDP2 averages dense gradients over it); an expert's owner receives, through the all-to-all's
backward, the gradient of every token of its expert-parallel group, so the sum over the
expert_dp group divided by the world size is the gradient of the whole batch.

The router's load-balancing loss is not added (docs/moe.md): the RL loss is the PPO objective alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts module (``Qwen3MoeExperts`` and those of its shape)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3
            and hasattr(module, "num_experts") and hasattr(module, "act_fn"))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with the given splits; the backward sends the gradients back
    the same way (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over ``group`` (rows of ``x``; None: one rank, ``x`` itself)."""
    if group is None:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class ExpertParallelExperts(nn.Module):
    """This rank's ``E / ep`` experts of one sparse block, and the token exchange with the other
    experts' ranks (module docstring). Same parameter names as the model's experts module, local
    rows only."""

    def __init__(self, experts: nn.Module, ep: int, ep_index: int, group):
        super().__init__()
        e, two_i, h = experts.gate_up_proj.shape
        if e % ep:
            raise ValueError(f"expert parallelism: {ep} ranks do not divide the {e} experts")
        self.num_experts, self.ep, self.ep_index, self.group = int(e), int(ep), int(ep_index), group
        self.local = e // ep
        self.first = ep_index * self.local
        self.act_fn = experts.act_fn
        dev = experts.gate_up_proj.device
        self.gate_up_proj = nn.Parameter(torch.empty(self.local, two_i, h, device=dev))
        self.down_proj = nn.Parameter(torch.empty(self.local, *experts.down_proj.shape[1:], device=dev))

    def _experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by local expert (``counts`` rows each) through their experts' MLPs."""
        outs = []
        for e, part in enumerate(torch.split(rows, counts)):
            if part.shape[0] == 0:
                continue
            gate, up = nn.functional.linear(part, self.gate_up_proj[e].to(part.dtype)).chunk(2, dim=-1)
            outs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e].to(part.dtype)))
        return torch.cat(outs) if outs else rows[:0]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, hence by owner
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E] rows this rank sends each expert
        if self.group is None:
            recv = counts.view(1, -1)
        else:
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.group)  # [ep x E/ep]: what each source sends mine
            recv = recv.view(self.ep, self.local)
        # the one wait for the device in this layer: the split sizes the exchanges need on the host
        host = torch.cat([counts, recv.reshape(-1)]).tolist()
        sent, got = host[:self.num_experts], host[self.num_experts:]  # [E] counts, [ep x local] received
        send_splits = [sum(sent[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        recv_splits = [sum(got[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        rows = all_to_all(hidden_states[token], recv_splits, send_splits, self.group)
        # received: per source rank, rows sorted by expert; regroup by local expert for the MLPs
        local_id = torch.repeat_interleave(torch.arange(self.local, device=rows.device).repeat(self.ep),
                                           recv.reshape(-1).to(rows.device), output_size=sum(recv_splits))
        perm = torch.argsort(local_id, stable=True)
        out = self._experts(rows[perm], [sum(got[e::self.local]) for e in range(self.local)])
        out = out[torch.argsort(perm)]
        back = all_to_all(out, send_splits, recv_splits, self.group)
        back = back * top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, token, back.to(final.dtype))


def apply_expert_parallel(lm: nn.Module, mesh, *, force: bool = False) -> list[nn.Parameter]:
    """Replace every fused experts module of ``lm`` (on the meta device, before sharding) by this
    rank's :class:`ExpertParallelExperts`; returns their parameters (to keep out of FSDP2). With
    ``mesh.ep`` 1 only when ``force`` (the expert-parallel code path on one rank, no exchange)."""
    ep = mesh.ep if mesh is not None else 1
    if ep == 1 and not force:
        return []
    group = mesh.group("ep") if mesh is not None else None
    index = mesh.index("ep") if mesh is not None else 0
    params: list[nn.Parameter] = []
    targets = [(name, mod) for name, mod in lm.named_modules() if is_fused_experts(mod)]
    if not targets:
        raise ValueError("train.parallel.ep: the model has no fused experts module to split (a dense model, or a "
                         "mixture-of-experts family whose experts are not transformers' fused gate_up_proj / "
                         "down_proj)")
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = lm.get_submodule(parent_name) if parent_name else lm
        new = ExpertParallelExperts(mod, ep, index, group)
        setattr(parent, child, new)
        params += [new.gate_up_proj, new.down_proj]
    return params


def expert_slices(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Qualified parameter name -> (first expert, local experts, all experts) of each expert-parallel
    parameter of ``model``."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ExpertParallelExperts):
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}" if name else p] = (mod.first, mod.local, mod.num_experts)
    return out


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for mod in model.modules() if isinstance(mod, ExpertParallelExperts)
            for p in (mod.gate_up_proj, mod.down_proj)]


@torch.no_grad()
def finalize_expert_grads(model: nn.Module, mesh) -> None:
    """Once per optimizer step, after the last backward: the experts' gradients summed over the
    ranks that hold the same experts and divided by the world size (module docstring)."""
    grads = [p.grad for p in expert_params(model) if p.grad is not None]
    if not grads:
        return
    group = mesh.group("expert_dp") if mesh is not None else None
    if group is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in grads:
            g.copy_(flat[off: off + g.numel()].view_as(g))
            off += g.numel()
    world = mesh.world if mesh is not None else 1
    if world > 1:
        for g in grads:
            g.div_(world)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, params: list[nn.Parameter], max_norm: float, mesh) -> torch.Tensor:
    """The global gradient norm of ``params`` (FSDP2 DTensor shards over every rank and this rank's
    experts, replicated over expert_dp: counted once), gradients scaled to ``max_norm`` when above
    it. Every element of the model counts once over the world."""
    experts = {id(p) for p in expert_params(model)}
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
    edp_first = mesh is None or mesh.group("expert_dp") is None or mesh.index("expert_dp") == 0
    for p in params:
        g = p.grad
        if g is None:
            continue
        if id(p) in experts:
            if edp_first:
                sq += g.double().pow(2).sum()
        else:
            local = g.to_local() if hasattr(g, "to_local") else g
            sq += local.double().pow(2).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    norm = sq.sqrt().float()
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def as_global(local: torch.Tensor, total: int, mesh) -> torch.Tensor:
    """This rank's expert rows as a ``Shard(0)`` DTensor of all ``total`` experts over the
    expert-parallel group (``mesh.ep_mesh``), sharing ``local``'s storage: ``full_tensor()`` gathers
    the experts, DCP saves them under one global shape, and a load writes into the parameter."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (total,) + tuple(local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh.ep_mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def global_state(model: nn.Module, state: dict, mesh) -> dict:
    """``state`` (keyed as ``model.state_dict()``, or by the same names through
    ``get_model_state_dict``) with this rank's experts as global DTensors (:func:`as_global`); other
    entries unchanged. Without expert parallelism ``state`` itself."""
    slices = expert_slices(model)
    if not slices or mesh is None or mesh.ep_mesh is None:
        return state
    out = dict(state)
    for qual, (_, _, total) in slices.items():
        for key in (qual, qual.replace("_checkpoint_wrapped_module.", "")):
            if key in out and not hasattr(out[key], "to_local"):
                out[key] = as_global(out[key], total, mesh)
    return out


def global_optim_state(model: nn.Module, osd: dict, mesh) -> dict:
    """``get_optimizer_state_dict``'s ``osd`` with the experts' moments as global DTensors (in place)."""
    slices = expert_slices(model)
    if not slices or mesh is None or mesh.ep_mesh is None:
        return osd
    totals = {q.replace("_checkpoint_wrapped_module.", ""): s[2] for q, s in slices.items()}
    for key, per in osd.get("state", {}).items():
        total = totals.get(key)
        if total is None:
            continue
        for name, t in per.items():
            if isinstance(t, torch.Tensor) and t.dim() and not hasattr(t, "to_local"):
                per[name] = as_global(t, total, mesh)
    return osd


def local_state(state: dict) -> dict:
    """Undo :func:`global_state` / :func:`global_optim_state` (the experts' DTensors back to this
    rank's rows, the same storage), recursively."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor) and v.device_mesh.ndim == 1 and "ep" == (v.device_mesh.mesh_dim_names or ("",))[0]:
            out[k] = v.to_local()
        elif isinstance(v, dict):
            out[k] = local_state(v)
        else:
            out[k] = v
    return out
