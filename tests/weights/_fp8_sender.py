"""Test sender: trainer rank 0 sending one FP8 update (``weights.quantize: fp8``) over each transport, in
its own process (the receiving engines run in the test's process; one process cannot hold both ends of
a named gloo group).

    python _fp8_sender.py STATE.pt SGLANG_BROADCAST_URL SGLANG_DISK_URL VLLM_TWIN_URL SAVE_ROOT

SGLang's broadcast to the first engine, SGLang's disk transport to the second, vLLM's weight transfer to
the twin: version 1 each, several buckets each (one engine a transport, so each is checked alone).
"""

from __future__ import annotations

import sys

import torch

from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
from areal_fast.backends.vllm.transfer import VLLMTransferWeightSync
from areal_fast.weights.config import WeightSyncConfig


def main(state_path: str, broadcast_url: str, disk_url: str, twin_url: str, save_root: str) -> None:
    state = torch.load(state_path)
    cfg = WeightSyncConfig(bucket_bytes=64 << 10, timeout_s=60, dtype="bfloat16", quantize="fp8", save_root=save_root)
    for sync in (DistributedWeightSync([broadcast_url], cfg), DiskWeightSync([disk_url], cfg),
                 VLLMTransferWeightSync([twin_url], cfg)):
        try:
            sync.update(state, "1")
        finally:
            sync.close()
        print(f"SENT {type(sync).__name__}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6])
