"""Trainer ranks of the many-sender test (``torchrun --nproc-per-node 4``, gloo, CPU): every case in one launch.

For 2 trainer ranks (a group of ranks 0-1) and 4 (all), with a tiny dense model (Qwen2, vocabulary 251:
uneven shards) and a tiny MoE state (fused experts, sent per expert), Shard(0) DTensors like FSDP2's:

* today's path (``senders: one``): a whole update and a delta update, the bytes each rank moved;
* every rank sending (``senders: rank``, ``delta: on``, whole every 2nd): a whole update, a delta
  update, the scheduled whole one, then the servers change: the twin leaves (a new group generation over
  the other), and it joins again (another generation); a whole and a delta update each time.

Rank 0 saves the expected tensors of every version (bf16, checkpoint layout) and ``stats.json``: per
update, every rank's bytes (to the servers, through the exchange, through the gather).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def dense_state(shapes: dict) -> dict[str, torch.Tensor]:
    """The tiny Qwen2's tensors (``--shapes``: the test's ModelSpec, vocabulary 251: uneven shards)."""
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(tuple(s), generator=g) * 0.5 for k, s in shapes.items()}


_E, _H, _I = 4, 32, 16
# "moe." in front: the twin server holds the dense and the MoE tensors side by side
MOE_SHAPES = {"moe.model.embed_tokens.weight": (50, _H), "moe.model.norm.weight": (_H,),
              "moe.model.layers.0.self_attn.q_proj.weight": (_H, _H), "moe.model.layers.0.mlp.gate.weight": (_E, _H),
              "moe.model.layers.0.mlp.experts.gate_up_proj": (_E, 2 * _I, _H),
              "moe.model.layers.0.mlp.experts.down_proj": (_E, _H, _I),
              "moe.model.layers.0.input_layernorm.weight": (_H,)}


def moe_state() -> dict[str, torch.Tensor]:
    """A tiny MoE layer's tensors: fused experts (sent per expert), a router, attention, norms."""
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(s, generator=g) * 0.5 for k, s in MOE_SHAPES.items()}


def perturb(state, rank: int, step: int, frac: float = 0.03) -> None:
    """Change about ``frac`` of this rank's elements by more than a bf16 step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    with torch.no_grad():
        for t in state.values():
            loc = t.to_local().view(-1)
            if loc.numel():
                k = max(1, int(frac * loc.numel()))
                idx = torch.randint(0, loc.numel(), (k,), generator=g)
                loc[idx] += 0.25 + loc[idx].abs()


def expected(state) -> dict[str, torch.Tensor]:
    from areal_fast.weights.experts import to_checkpoint_state

    return {n: t.contiguous() for n, t in
            to_checkpoint_state({k: v.full_tensor().to(torch.bfloat16) for k, v in state.items()}).items()}


class Case:
    """One model on one trainer group: its sharded state, the updates made and their statistics."""

    def __init__(self, kind: str, n: int, group, state, out: str, rank: int, stats: list):
        self.kind, self.n, self.group, self.state = kind, n, group, state
        self.out, self.rank, self.stats = out, rank, stats
        self.step = 0

    def update(self, sync, label: str, change: bool = True) -> None:
        if change:
            self.step += 1
            perturb(self.state, self.rank, self.step)
        version = f"{self.kind}-n{self.n}-{label}"
        sync.update(self.state, version)
        exp = expected(self.state)  # collective over the mesh
        every = [None] * self.n
        dist.all_gather_object(every, dict(sync.stats), group=self.group)
        if self.rank == 0:
            torch.save(exp, os.path.join(self.out, f"{version}.pt"))
            self.stats.append({"version": version, "n": self.n, "kind": self.kind, "urls": list(sync.urls),
                               "senders": sync.config.senders,
                               "update_bytes": sum(t.numel() * t.element_size() for t in exp.values()),
                               "largest_tensor_bytes": max(t.numel() * t.element_size() for t in exp.values()),
                               "ranks": every})


def cfg(senders: str, name: str):
    from areal_fast.weights.sync import WeightSyncConfig

    return WeightSyncConfig(bucket_bytes=32 << 10, dtype="bfloat16", timeout_s=60, group_name=name, senders=senders,
                            delta="on", delta_full_every=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", nargs=2, required=True, help="an SGLang-like receiver (tp 2), then the twin")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", required=True, help="JSON {name: shape} of the dense model")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
    from areal_fast.weights.membership import group_name_of

    rank = dist.get_rank()
    stats: list = []
    url_s, url_t = a.urls
    models = {"dense": dense_state(json.loads(a.shapes)), "moe": moe_state()}
    for n in (2, 4):
        group = dist.new_group(list(range(n)))
        if rank < n:
            mesh = DeviceMesh.from_group(group, "cpu")
            for kind, full in models.items():
                state = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in full.items()}
                case = Case(kind, n, group, state, a.out, rank, stats)
                base = f"wg-{kind}-n{n}"
                one = DistributedWeightSync([url_s, url_t], cfg("one", base + "-one"), group=group)
                case.update(one, "one-whole", change=False)
                case.update(one, "one-delta")
                one.close()
                many = DistributedWeightSync([url_s, url_t], cfg("rank", base), group=group)
                for label in ("whole", "delta1", "whole2"):  # whole every 2nd
                    case.update(many, label)
                many.close()
                left = DistributedWeightSync([url_s], cfg("rank", group_name_of(base, 1)), group=group)
                case.update(left, "left-whole")
                case.update(left, "left-delta")
                left.close()
                back = DistributedWeightSync([url_s, url_t], cfg("rank", group_name_of(base, 2)), group=group)
                case.update(back, "joined-whole")
                case.update(back, "joined-delta")
                back.close()
                if n == 4 and kind == "dense":  # one sender per node of 2 ranks: ranks 1 and 3 only contribute
                    os.environ["LOCAL_WORLD_SIZE"] = "2"
                    node = DistributedWeightSync([url_s, url_t], cfg("node", base + "-node"), group=group)
                    case.update(node, "node-whole")
                    case.update(node, "node-delta")
                    node.close()
                    os.environ["LOCAL_WORLD_SIZE"] = "4"
        dist.barrier()
    if rank == 0:
        with open(os.path.join(a.out, "stats.json"), "w") as f:
            json.dump({"updates": stats}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
