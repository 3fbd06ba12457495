"""The trainer's device mesh: data-parallel, context-parallel and expert-parallel groups.

Rank layout: ``rank = dp_index * cp + cp_index`` (a context-parallel group is ``cp`` consecutive
ranks, so its all-to-alls stay inside a node where they can). An expert-parallel group is ``ep``
consecutive ranks: expert parallelism borrows its ranks from the dp x cp ranks, as torchtitan's
does. The ranks that hold the same experts (one from each expert-parallel group, the same index in
each: ranks ``i, i + ep, i + 2 ep, ...``) are the expert data-parallel group; the expert gradients
are reduced over it.

Dense parameters stay under FSDP2 over every rank (``fsdp_mesh``); the experts of a rank are its
own (``expert.py``), replicated over the expert data-parallel group (``expert_fsdp_mesh``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

NAMES = ("dp", "cp", "ep")


def layout(world: int, dp: int, cp: int, ep: int) -> dict[str, list[list[int]]]:
    """The rank groups of each kind (every rank in exactly one group of each), without torch.distributed:
    ``dp`` groups share a cp index, ``cp`` groups are consecutive blocks of cp ranks, ``ep`` groups
    consecutive blocks of ep ranks, ``expert_dp`` groups the ranks with the same index in their ep group."""
    if dp * cp != world or world % ep:
        raise ValueError(f"mesh: dp {dp} x cp {cp} must be the world size {world}, and ep {ep} divide it")
    return {
        "dp": [[d * cp + c for d in range(dp)] for c in range(cp)],
        "cp": [[d * cp + c for c in range(cp)] for d in range(dp)],
        "ep": [[b * ep + i for i in range(ep)] for b in range(world // ep)],
        "expert_dp": [[b * ep + i for b in range(world // ep)] for i in range(ep)],
    }


@dataclass
class TrainerMesh:
    """This rank's place in the trainer's mesh: degrees, groups, FSDP2 meshes."""

    world: int
    dp: int
    cp: int
    ep: int
    rank: int
    fsdp_mesh: object
    """DeviceMesh over every rank (``("dp",)``), for the dense parameters."""
    expert_fsdp_mesh: object | None = None
    """DeviceMesh over the world / ep ranks that hold the same experts (None when that is 1)."""
    ep_mesh: object | None = None
    """DeviceMesh over this rank's expert-parallel group (None when ep is 1): the experts' state-dict
    entries are ``Shard(0)`` DTensors on it (``expert.py``)."""
    groups: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)
    """name -> the global ranks of this rank's group (every name of :func:`layout`)."""

    def group(self, name: str):
        """The ProcessGroup of this rank's ``name`` group ('dp', 'cp', 'ep'; 'expert_dp' too), None when
        that degree is 1."""
        if name not in self.ranks:
            raise KeyError(f"mesh group {name!r}: one of {sorted(self.ranks)}")
        return self.groups.get(name)

    def index(self, name: str) -> int:
        """This rank's position in its ``name`` group."""
        if name not in self.ranks:
            raise KeyError(f"mesh group {name!r}: one of {sorted(self.ranks)}")
        return self.ranks[name].index(self.rank)

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: world / ep."""
        return self.world // self.ep


def build_mesh(parallel, world: int, device) -> TrainerMesh:
    """The mesh of ``parallel`` (a ``ParallelConfig``) over the ``world`` ranks of the initialised default
    group (gloo on CPU, NCCL on CUDA: the default group's backend). Collective: every rank calls it.
    ``ep`` = ``cp`` = 1 builds today's one-dimensional mesh and no group."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device)
    ep, cp = int(parallel.ep), int(parallel.cp)
    if world % cp or world % ep:
        raise ValueError(f"train.parallel: cp {cp} and ep {ep} must divide the world size {world}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    groups_of = layout(world, world // cp, cp, ep)
    mine = {name: next(g for g in gs if rank in g) for name, gs in groups_of.items()}
    groups: dict = {}
    # new_group is collective over the default group: every rank creates every group, in one order
    for name, gs in groups_of.items():
        if len(gs[0]) == 1 or (name == "dp" and cp == 1) or name in ("ep", "expert_dp"):
            continue
        for g in gs:
            pg = dist.new_group(g)
            if rank in g:
                groups[name] = pg
    if cp == 1 and world > 1:
        groups["dp"] = fsdp_mesh.get_group()
    expert_fsdp_mesh = ep_mesh = None
    if ep > 1:  # rank = expert_dp index * ep + ep index: dim 0 holds the same experts, dim 1 one ep group
        meshes = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("expert_dp", "ep"))
        ep_mesh = meshes["ep"]
        groups["ep"] = ep_mesh.get_group()
        if world // ep > 1:
            expert_fsdp_mesh = meshes["expert_dp"]
            groups["expert_dp"] = expert_fsdp_mesh.get_group()
    return TrainerMesh(world=world, dp=world // cp, cp=cp, ep=ep, rank=rank, fsdp_mesh=fsdp_mesh,
                       expert_fsdp_mesh=expert_fsdp_mesh, ep_mesh=ep_mesh, groups=groups, ranks=mine)
