"""What the trainer's parallelism costs per rank and step (docs/parallelism.md): on the tiny models,
COUNTED (2 gloo ranks under torchrun, one PPO step per arm, every collective wrapped by
``areal_fast.trainer.parallel.cost.CollectiveCounter``: bytes this rank sends by kind and group, and the
parameter bytes a rank holds); for Qwen3-30B-A3B at 32k tokens on 8 H200, COMPUTED
(``cost.computed_step``: the formula and its assumptions are in its docstring and the doc).

    python bench/bench_parallel_cost.py [--arms dp,ep2]

A row per arm goes to ``bench/results/parallel_cost.jsonl`` (``kind``: "counted" or "computed").
An arm is an entry of ``ARMS``: the tiny model it trains and its ``train.parallel`` degrees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_harness_args, csv_list, provenance, save  # noqa: E402

WORLD = 2
# arm -> (tiny model, train.parallel degrees)
ARMS = {
    "dp": ("moe", {"ep": 1}),
    "ep2": ("moe", {"ep": 2}),
    "cp2": ("moe", {"cp": 2}),
}
# Qwen3-30B-A3B, 32k tokens a rank, 8 H200 in one node (NVLink) or spread (InfiniBand)
NVLINK_BYTES_S = 450e9  # H200 NVLink 4: 900 GB/s both directions, 450 GB/s each way (datasheet)
IB_BYTES_S = 50e9  # one 400 Gb/s NIC a GPU (datasheet line rate)
COMPUTED = [("dp8", 1), ("ep2", 2), ("ep4", 4), ("ep8", 8)]
COMPUTED_CP = [("cp2", 2), ("cp4", 4), ("cp8", 8)]  # context parallelism: its all-to-alls on top of dp8's FSDP2
MICRO_BATCHES = (1, 4)  # the 32k tokens as one micro-batch, or four of 8k


def build_model(kind: str, path: str) -> str:
    from areal_fast.data.tiny_models import build_tiny_qwen2, build_tiny_qwen3_moe

    if kind == "moe":
        return build_tiny_qwen3_moe(path, vocab_size=100, seed=7)
    return build_tiny_qwen2(path, vocab_size=100, seed=7)


def batch():
    import torch

    from areal_fast.sample import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(8):
        p, o = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
        out.append(Sample(prompt_ids=torch.randint(2, 100, (p,), generator=g).tolist(),
                          output_ids=torch.randint(2, 100, (o,), generator=g).tolist(),
                          output_logprobs=(-torch.rand(o, generator=g) * 4 - 1).tolist(),
                          output_versions=[0] * o, reward=float(i % 2), group_id=i // 4))
    return out


def worker(arm: str, model_path: str, out: str) -> None:
    import torch.distributed as dist

    from areal_fast.trainer import OptimConfig, ParallelConfig, PPOActor, TrainerConfig
    from areal_fast.trainer.model import shutdown_process_group
    from areal_fast.trainer.parallel.cost import CollectiveCounter, param_bytes_per_rank

    _, degrees = ARMS[arm]
    world = int(os.environ["WORLD_SIZE"])
    actor = PPOActor(TrainerConfig(model_path=model_path, device="cpu", world_size=world, max_tokens_per_mb=40,
                                   parallel=ParallelConfig(**degrees), optim=OptimConfig(lr=1e-3)))
    names = {}  # a group by the mesh's names for it ("fsdp+ep": FSDP2's group is also the expert group)
    for name, pg in [("fsdp", actor.pmesh.fsdp_mesh.get_group()), *actor.pmesh.groups.items()]:
        names[id(pg)] = f"{names[id(pg)]}+{name}" if id(pg) in names else name

    def label(group):
        return names.get(id(group), "world") if group is not None else "world"

    actor.train_batch(batch())  # a first step: the counted one is a steady step
    with CollectiveCounter(label) as c:
        actor.train_batch(batch())
    row = {"arm": arm, "world": world, **degrees, "param_bytes": param_bytes_per_rank(actor.model),
           "sent": dict(sorted(c.sent.items())), "calls": dict(sorted(c.calls.items()))}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if actor.rank == 0:
        Path(out).write_text(json.dumps(rows))
    shutdown_process_group()


def counted(arm: str, root: str) -> dict:
    kind, _ = ARMS[arm]
    model = build_model(kind, os.path.join(root, kind)) if not os.path.isdir(os.path.join(root, kind)) \
        else os.path.join(root, kind)
    out = os.path.join(root, f"{arm}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           __file__, "--worker", arm, model, out]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise SystemExit(f"{arm}: torchrun failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    per_rank = json.loads(Path(out).read_text())
    return {"kind": "counted", "model": kind, **{k: per_rank[0][k] for k in ("arm", "world", *ARMS[arm][1])},
            "per_rank": [{k: r[k] for k in ("param_bytes", "sent", "calls")} for r in per_rank]}


def computed() -> list[dict]:
    from areal_fast.trainer.parallel.cost import QWEN3_30B_A3B, computed_step, moe_param_counts

    rows = []
    for arm, ep in COMPUTED:
        for mbs in MICRO_BATCHES:
            for link, bw in (("nvlink", NVLINK_BYTES_S), ("ib", IB_BYTES_S)):
                r = computed_step(QWEN3_30B_A3B, world=8, ep=ep, tokens_per_rank=32768, link_bytes_s=bw,
                                  micro_batches=mbs)
                rows.append({"kind": "computed", "model": "Qwen3-30B-A3B", "arm": arm, "link": link,
                             "link_bytes_s": bw, "params": moe_param_counts(QWEN3_30B_A3B), **r})
    rows += computed_cp()
    return rows


def computed_cp() -> list[dict]:
    """Context parallelism on the 8 ranks (``context.computed_cp_step``): 32k tokens a rank, a micro-batch
    of cp x 32k (the longest sequence); and one 32k-token sequence cut over cp ranks (32k / cp a rank)."""
    from areal_fast.trainer.parallel.context import computed_cp_step
    from areal_fast.trainer.parallel.cost import QWEN3_30B_A3B

    rows = []
    for arm, cp in [("dp8", 1)] + COMPUTED_CP:
        for scenario, tokens in (("32k_a_rank", 32768), ("one_32k_sequence", 32768 // cp)):
            for link, bw in (("nvlink", NVLINK_BYTES_S), ("ib", IB_BYTES_S)):
                r = computed_cp_step(QWEN3_30B_A3B, cp=cp, tokens_per_rank=tokens, link_bytes_s=bw)
                rows.append({"kind": "computed_cp", "model": "Qwen3-30B-A3B", "arm": arm, "scenario": scenario,
                             "world": 8, "link": link, "link_bytes_s": bw, **r})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", type=csv_list(list(ARMS)), default=list(ARMS))
    add_harness_args(ap, dry_run="")
    args = ap.parse_args(argv)
    prov = provenance(native=False)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for arm in args.arms:
            rows.append(counted(arm, root))
            r = rows[-1]["per_rank"][0]
            print(arm, "param bytes", r["param_bytes"], "sent", r["sent"])
    rows += computed()
    for r in rows[len(args.arms):]:
        if r["kind"] == "computed_cp":
            print(r["arm"], r["scenario"], r["link"], f"all-to-all {r['all_to_all'] / 1e9:.1f} GB",
                  f"{r['all_to_all_seconds'] * 1e3:.0f} ms", f"attention {r['attention_flops'] / 1e15:.2f} PFLOP")
            continue
        print(r["arm"], r["link"], f"mbs {r['micro_batches']}", f"held {r['param_bytes_held'] / 1e9:.2f} GB",
              f"sent {r['sent_total'] / 1e9:.2f} GB",
              f"{r['comm_seconds'] * 1e3:.0f} ms")
    save("parallel_cost", rows, args, prov)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
