"""Test trainer rank: a tiny FSDP2-sharded Qwen2 on gloo/CPU that syncs weights to receivers.

Run with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (one process per rank). Scenario:
v1 flattened buckets (small buckets, several calls), v2 per-tensor broadcasts after changing
the weights, v3 through disk; then, if --fail-url is given, an update to a server that rejects
a tensor once must raise WeightSyncError and leave the version unchanged, and the next update
(v5, same group) must succeed: the failed one left no weight-update session open. Rank 0 saves the full
expected tensors (bf16, the declared cast) per version and a JSON summary into --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def tiny_qwen2(seed: int = 0):
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=251, tie_word_embeddings=True,  # 251: uneven
                                   max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # random biases and norms too, so every byte is checked
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def full_state(model, spec) -> dict:
    from torch.distributed.tensor import DTensor

    from areal_fast.weights.layout import sendable

    out = {}
    for n, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[n] = full.detach().to(torch.bfloat16)
    return sendable(out, spec)


def _t(msg):
    import sys
    import time

    if os.environ.get("WSYNC_TIMING"):
        print(f"[{time.monotonic():.2f}] rank{os.environ.get('RANK')} {msg}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail-url", default=None)
    ap.add_argument("--fail-tensor", default=None)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard

    from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
    from areal_fast.weights.layout import ModelSpec
    from areal_fast.weights.sync import WeightSyncConfig, WeightSyncError

    model = tiny_qwen2()
    spec = ModelSpec.from_hf_config(model.config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    summary = {}
    cfg = WeightSyncConfig(bucket_bytes=24 << 10, dtype=torch.bfloat16, timeout_s=60)
    sync = DistributedWeightSync(a.urls, cfg)
    _t("start")
    sync.update(model, 1)
    _t("v1")
    exp = full_state(model, spec)
    if rank == 0:
        torch.save(exp, os.path.join(a.out, "expected_v1.pt"))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(-1.5).add_(0.25)
    sync.config.load_format = None
    sync.update(model, 2)
    _t("v2")
    exp = full_state(model, spec)
    if rank == 0:
        torch.save(exp, os.path.join(a.out, "expected_v2.pt"))
    summary["version_after_v2"] = sync.version
    summary["n_inits"] = sync.n_inits
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    disk = DiskWeightSync(a.urls, WeightSyncConfig(bucket_bytes=48 << 10, dtype=torch.bfloat16, timeout_s=60))
    disk.update(model, 3)
    _t("v3")
    exp = full_state(model, spec)
    if rank == 0:
        torch.save(exp, os.path.join(a.out, "expected_v3.pt"))
        summary["disk_dir_removed"] = not os.path.exists(disk.last_path)
    summary["disk_version"] = disk.version
    if a.fail_url:
        bad = DistributedWeightSync([a.fail_url], WeightSyncConfig(bucket_bytes=24 << 10, timeout_s=60,
                                                                   group_name="fail_group"))
        try:
            bad.update(model, 4)
            summary["fail_error"] = None
        except WeightSyncError as e:
            summary["fail_error"] = str(e)
        _t("fail")
        summary["fail_version"] = bad.version
        try:
            bad.update(model, 5)
            summary["retry_error"] = None
        except WeightSyncError as e:
            summary["retry_error"] = str(e)
        summary["retry_version"] = bad.version
        summary["retry_n_inits"] = bad.n_inits
        bad.close()
    sync.close()
    if rank == 0:
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
