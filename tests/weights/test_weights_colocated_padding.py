"""The colocated shard buffer: built in uninitialised memory, only the bytes no interval writes
(vocabulary padding rows, alignment gaps) are zeroed, and the shards equal the layout reference."""

import numpy as np
import pytest
import torch

from areal_fast.weights import colocated
from areal_fast.weights.colocated import build_tp_shard, unwritten_ranges
from areal_fast.weights.interval_copy import interval_copy_ref
from areal_fast.weights.layout import ModelSpec, hf_to_sglang
from areal_fast.weights.plan import DTYPE_CODES

# vocabulary 253: padded rows on every TP rank; head_dim 6 and hidden 30: alignment gaps
SPEC = ModelSpec("qwen2", num_layers=2, hidden_size=30, intermediate_size=44, num_heads=4, num_kv_heads=1,
                 head_dim=6, vocab_size=253, qkv_bias=True)


def _mask(ranges: np.ndarray, n: int) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges.tolist():
        m[a:b] = True
    return m


def _written(srcs, intervals, nbytes) -> torch.Tensor:
    """Bytes the intervals write: copy sources of 1.0 (fp32 1.0 -> bf16 0x3F80: no zero byte)."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    interval_copy_ref([torch.ones_like(s) for s in srcs], [buf], intervals)
    return buf != 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_from_garbage_memory_equal_the_reference_and_only_padding_is_zeroed(tp, monkeypatch):
    g = torch.Generator().manual_seed(tp)
    state = {n: torch.randn(s, generator=g) * 4 + 0.5 for n, s in SPEC.hf_shapes().items()}
    monkeypatch.setattr(colocated, "_alloc", lambda n, device: torch.full((n,), 0xAB, dtype=torch.uint8))
    want = hf_to_sglang({n: t.to(torch.bfloat16) for n, t in state.items()}, SPEC, tp)
    padded = 0
    for r in range(tp):
        buf, named, plan = build_tp_shard(state, SPEC, tp, r)
        assert [n for n, _ in named] == list(want[r])
        for n, t in named:  # what the server receives: bit for bit the reference, padding rows zero
            assert torch.equal(t.view(torch.int16), want[r][n].view(torch.int16)), n
        gaps = unwritten_ranges(plan.intervals[0], plan.buffer_bytes)
        srcs = [state[n] for n in SPEC.hf_shapes()]
        written = _written(srcs, plan.intervals[0], plan.buffer_bytes)
        assert torch.equal(_mask(gaps, plan.buffer_bytes), ~written)  # zeroed = exactly what no interval writes
        assert not buf[~written].any()
        padded += int((~written).sum())
    assert padded > 0, "the spec was meant to have padding"


def test_unwritten_ranges_of_strided_overlapping_and_empty_intervals():
    f32, bf16 = DTYPE_CODES[torch.float32], DTYPE_CODES[torch.bfloat16]
    iv = np.array([
        [0, 0, 5, 0, 3, 9, 5, 4, f32, bf16],   # 4 rows of 5 bf16, rows 9 apart, from bf16 element 3
        [0, 0, 0, 0, 5, 0, 2, 1, f32, f32],    # 2 fp32 at fp32 element 5 (bytes 20..28): inside row 0's gap
        [0, 0, 0, 0, 7, 0, 6, 1, f32, bf16],   # overlaps row 0 and the one above
        [0, 0, 0, 0, 60, 0, 0, 3, f32, bf16],  # empty: writes nothing
        [0, 0, 0, 1, 0, 0, 8, 1, f32, f32],    # another destination: not this buffer's
    ], np.int64)
    src, nbytes = torch.ones(64), 100
    want = torch.zeros(nbytes, dtype=torch.uint8)
    interval_copy_ref([src], [want, torch.zeros(32, dtype=torch.uint8)], iv)
    gaps = unwritten_ranges(iv, nbytes)
    assert torch.equal(_mask(gaps, nbytes), want == 0)
    assert (gaps[1:, 0] > gaps[:-1, 1]).all(), "ranges must be merged and sorted"
    assert unwritten_ranges(iv[:0], 10).tolist() == [[0, 10]]
