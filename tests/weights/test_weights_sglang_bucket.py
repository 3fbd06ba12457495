"""Contract: a flattened bucket built by our sender is unpacked by SGLang's own
``FlattenedTensorBucket`` (from the released wheel, imported on CPU) into exactly our tensors.

For each version the receive side is replayed the way that version's model runner does it,
from the request body we would send: 0.5.6 allocates empty tensors and packs them into a
``FlattenedTensorBucket`` to get the receive buffer; 0.5.23 calls ``FlattenedTensorBucket.empty``
(which also refuses unaligned offsets). The broadcast is replaced by a copy of our bucket's bytes
into that buffer (what the broadcast writes), then ``reconstruct_tensors`` must give back every
tensor bit for bit. Skipped only when the wheel cannot be downloaded.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from areal_fast.backends.sglang.weight_sync import bucket_request, check_unpadded
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.gather import BucketGatherer, collect_sources, send_dtypes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_wheel import sglang_module  # noqa: E402

VERSIONS = ["0.5.6", "0.5.23"]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {  # odd element counts, so tensors start at offsets that are not multiples of 4 or 8
        "model.embed_tokens.weight": torch.randn(37, 5, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(7, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(9, 11, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(300, 5, generator=g),  # alone: > one bucket
        "model.norm.weight": torch.randn(3, generator=g),
        "lm_head.weight": torch.randn(13, 5, generator=g),
    }


def _buckets(state, dtype: str | None, bucket_bytes: int):
    cfg = WeightSyncConfig(dtype=dtype, bucket_bytes=bucket_bytes)
    src = collect_sources(state)
    dtypes = send_dtypes(src, cfg.send_dtype("cuda"))
    out = []

    class _Done:
        def wait(self):
            pass

    def keep(b):
        out.append((bucket_request(b, "1", cfg), b.data.clone(), [b.tensor(i).clone() for i in range(len(b.names))]))
        offsets_nbytes = [(o, b.tensor(i).numel() * b.dtypes[i].itemsize) for i, o in enumerate(b.offsets)]
        check_unpadded(b.index, b.names, [o for o, _ in offsets_nbytes], [n for _, n in offsets_nbytes])
        return _Done()

    BucketGatherer(cfg.bucket_bytes).run(src, dtypes, keep)
    return out


def _receive_buffer(tb, version: str, body: dict):
    """SGLang ``version``'s receive-side bucket for ``body`` (see the module docstring)."""
    if version == "0.5.6":
        named = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in
                 zip(body["names"], body["dtypes"], body["shapes"])]
        return tb.FlattenedTensorBucket(named_tensors=named)
    return tb.FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", None])  # the GPU default, and fp32 as stored
@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_unpacks_our_bucket_bitwise(version, dtype):
    tb = sglang_module(version, "sglang.srt.weight_sync.tensor_bucket")
    buckets = _buckets(_state(), dtype, bucket_bytes=1 << 10)
    assert len(buckets) >= 3  # several buckets, one of them a single large tensor
    seen = set()
    for body, data, tensors in buckets:
        assert body["load_format"] == "flattened_bucket"
        bucket = _receive_buffer(tb, version, body)
        flat = bucket.get_flattened_tensor()
        assert flat.dtype == torch.uint8 and flat.numel() == data.numel(), "broadcast sizes would differ"
        flat.copy_(data)  # what the broadcast writes into the receive buffer
        got = bucket.reconstruct_tensors()
        assert [n for n, _ in got] == body["names"]
        for (name, t), want in zip(got, tensors):
            assert t.dtype == want.dtype and t.shape == want.shape, name
            assert torch.equal(t.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name
            seen.add(name)
    assert seen == set(_state())


def test_sglang_0523_refuses_unaligned_offsets_we_never_send():
    """0.5.23 rejects a bucket whose tensor would start at an offset not aligned to its dtype;
    our sender either packs without gaps or refuses the bucket before asking any server."""
    tb = sglang_module("0.5.23", "sglang.srt.weight_sync.tensor_bucket")
    with pytest.raises(ValueError, match="Unaligned"):
        tb.FlattenedTensorBucket.empty(["a", "b"], ["bfloat16", "float32"], [[1], [1]], "cpu")
    from areal_fast.weights.errors import WeightSyncError

    with pytest.raises(WeightSyncError, match="alignment padding"):
        check_unpadded(0, ["a", "b"], [0, 4], [2, 4])  # bf16 at 0, fp32 aligned to 4: a 2-byte gap
