"""Test sender: trainer rank 0 sending one FP8 update (``weights.quantize: fp8``) over each transport, in
its own process (the receiving engines run in the test's process; one process cannot hold both ends of
a named gloo group).

    python _fp8_sender.py STATE.pt SGLANG_URL VLLM_TWIN_URL SAVE_ROOT

SGLang's broadcast, then SGLang's disk transport, to the first engine (versions 1 and 2); vLLM's weight
transfer to the twin (version 1). Several buckets each.
"""

from __future__ import annotations

import sys

import torch

from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
from areal_fast.backends.vllm.transfer import VLLMTransferWeightSync
from areal_fast.weights.config import WeightSyncConfig


def main(state_path: str, sglang_url: str, twin_url: str, save_root: str) -> None:
    state = torch.load(state_path)
    cfg = WeightSyncConfig(bucket_bytes=64 << 10, timeout_s=60, dtype="bfloat16", quantize="fp8", save_root=save_root)
    for sync, version in ((DistributedWeightSync([sglang_url], cfg), "1"), (DiskWeightSync([sglang_url], cfg), "2"),
                          (VLLMTransferWeightSync([twin_url], cfg), "1")):
        try:
            sync.update(state, version)
        finally:
            sync.close()
        print(f"SENT {type(sync).__name__} {version}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
