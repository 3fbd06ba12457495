"""Test sender: trainer rank 0 of vLLM's weight transfer (``backends.vllm.transfer``) in its own
process, so the receiving twin can run in the test's process (a process cannot hold both ends of
one named gloo group).

    python _vllm_sender.py URL STATE.pt VERSION [STATE.pt VERSION ...]

Each state dict (``torch.save``) is sent as one update over one group (made once, reused); prints
``INITS <n>`` at the end.
"""

from __future__ import annotations

import sys

import torch

from areal_fast.backends.vllm.transfer import VLLMTransferWeightSync
from areal_fast.weights.config import WeightSyncConfig


def main(argv: list[str]) -> None:
    url, rest = argv[0], argv[1:]
    cfg = WeightSyncConfig(bucket_bytes=64 << 10, timeout_s=60, dtype=None)  # several buckets, sent as stored
    sync = VLLMTransferWeightSync([url], cfg)
    try:
        for path, version in zip(rest[::2], rest[1::2]):
            sync.update(torch.load(path), version)
        print(f"INITS {sync.n_inits}", flush=True)
    finally:
        sync.close()


if __name__ == "__main__":
    main(sys.argv[1:])
