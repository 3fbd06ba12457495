"""A test worker: train on batches from a JSONL file (one JSON list of sample dicts per line),
under torchrun or as one process; rank 0 prints one JSON line of metrics per step. The config is a
JSON file of ``train`` section keys, read by the one config loader (``configutil.from_dict``).

    python -m torch.distributed.run --nproc-per-node=2 tests/trainer/_train_jsonl.py --config c.json --batches b.jsonl
"""

from __future__ import annotations

import argparse
import json

from areal_fast.configutil import from_dict
from areal_fast.trainer import PPOActor, TrainerConfig, export_hf, load_checkpoint, save_checkpoint
from areal_fast.trainer.model import shutdown_process_group


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="_train_jsonl.py", description=__doc__)
    ap.add_argument("--config", required=True,
                    help="JSON file of TrainerConfig fields (ppo, ppo.loss, optim as objects; model_path required)")
    ap.add_argument("--batches", required=True, help="JSONL: each line a list of sample dicts")
    ap.add_argument("--resume", help="checkpoint directory to resume from")
    ap.add_argument("--save", help="checkpoint directory to write at the end")
    ap.add_argument("--export-hf", help="directory for an HF safetensors export at the end")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = from_dict(TrainerConfig, json.load(f))
    actor = PPOActor(cfg)
    if args.resume:
        load_checkpoint(actor, args.resume)
    with open(args.batches) as f:
        for line in f:
            if not line.strip():
                continue
            batch = json.loads(line) if actor.rank == 0 else None
            metrics = actor.train_batch(batch)
            if actor.rank == 0:
                print(json.dumps(metrics), flush=True)
    if args.save:
        save_checkpoint(actor, args.save)
    if args.export_hf:
        export_hf(actor, args.export_hf)
    shutdown_process_group()


if __name__ == "__main__":
    main()
