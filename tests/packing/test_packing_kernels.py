"""Varlen packing ops: references vs naive loops, Triton kernels (interpreter) vs references.

All ops are copies, so every comparison is bitwise (tensors compared as raw bytes, which also
covers NaN payloads and -0.0 in the random float data).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_fast.dispatch import BackendUnavailable
from areal_fast.packing import (
    gather_segments,
    gather_segments_ref,
    pack,
    pack_ref,
    plan_microbatches,
    scatter_segments,
    scatter_segments_ref,
    unpack,
    unpack_ref,
)

DTYPES = [torch.int64, torch.int32, torch.float32, torch.bfloat16]
# Trailing shapes: 1-D per-token, a width that is not a power of two, two trailing dims.
TRAILING = [(), (5,), (3, 7)]
L = 9
LENGTHS = {
    "mixed_0_to_L": [3, 0, 9, 1, 5, 9, 2],
    "all_zero": [0, 0, 0],
    "single": [6],
    "all_full": [9, 9],
}


def random_bits(shape, dtype, gen) -> torch.Tensor:
    """Random raw bytes viewed as ``dtype`` (floats include NaNs, infs, -0.0 and subnormals)."""
    n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def cu_of(lengths) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    return cu


# ----------------------------------------------------------------------------- references vs loops


def test_references_match_naive_loops():
    gen = torch.Generator().manual_seed(0)
    lengths = LENGTHS["mixed_0_to_L"]
    B = len(lengths)
    padded = torch.randn(B, L, 3, generator=gen)
    packed, cu, pos = pack_ref(padded, lengths)
    assert torch.equal(packed, torch.cat([padded[b, :n] for b, n in enumerate(lengths)]))
    assert torch.equal(pos, torch.cat([torch.arange(n) for n in lengths]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *np.cumsum(lengths).tolist()]
    out = unpack_ref(packed, cu, L + 2, pad_value=-1.5)
    for b, n in enumerate(lengths):
        assert torch.equal(out[b, :n], padded[b, :n]) and bool((out[b, n:] == -1.5).all())
    order = [4, 2, 6, 0, 1, 5, 3]
    (g,), new_cu = gather_segments_ref([packed], cu, order)
    assert torch.equal(g, torch.cat([packed[cu[o] : cu[o + 1]] for o in order]))
    assert new_cu.dtype == torch.int32 and new_cu.tolist() == [0, *np.cumsum([lengths[o] for o in order]).tolist()]
    assert torch.equal(scatter_segments_ref(g, cu, order), packed)


# ----------------------------------------------------------------------------- kernels (interpreter)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(LENGTHS))
@pytest.mark.parametrize("trailing", TRAILING, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_unpack_kernel_bitwise(dtype, trailing, case):
    gen = torch.Generator().manual_seed(1)
    lengths = LENGTHS[case]
    padded = random_bits((len(lengths), L, *trailing), dtype, gen)
    got = pack(padded, lengths, backend="interpret")
    want = pack_ref(padded, lengths)
    for g, w in zip(got, want):
        assert same_bits(g, w)
    assert got[2].dtype == torch.int64 and got[1].dtype == torch.int32
    packed, cu, _ = got
    # zero pad (zero bytes, no pad row) and a non-zero pad value (pad row), longer max_len
    for max_len, pad in ((L, 0), (L + 3, 7)):
        assert same_bits(unpack(packed, cu, max_len, pad, backend="interpret"), unpack_ref(packed, cu, max_len, pad))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(LENGTHS))
def test_gather_scatter_many_tensors_one_launch(case, monkeypatch):
    """Six per-token tensors of four dtypes, rows of 1 to 60 bytes, moved by ONE kernel launch."""
    from areal_fast.kernels import packing as K

    launches = []
    real = K._segment_copy_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(K, "_segment_copy_kernel", Counting())
    gen = torch.Generator().manual_seed(2)
    lengths = LENGTHS[case]
    cu, T = cu_of(lengths), sum(lengths)
    tensors = [
        random_bits((T,), torch.int64, gen),
        random_bits((T,), torch.int32, gen),
        random_bits((T, 5), torch.float32, gen),
        random_bits((T, 3), torch.bfloat16, gen),  # 6-byte rows
        random_bits((T,), torch.bfloat16, gen),  # 2-byte rows
        random_bits((T, 3, 5), torch.int64, gen),
    ]
    order = torch.randperm(len(lengths), generator=gen)
    got, new_cu = gather_segments(tensors, cu, order, backend="interpret")
    want, want_cu = gather_segments_ref(tensors, cu, order)
    assert torch.equal(new_cu, want_cu) and all(same_bits(g, w) for g, w in zip(got, want))
    assert len(launches) == (1 if T else 0)
    back = scatter_segments(got, cu, order, backend="interpret")
    assert all(same_bits(b, t) for b, t in zip(back, tensors))
    assert all(same_bits(b, w) for b, w in zip(back, scatter_segments_ref(got, cu, order)))
    assert len(launches) == (2 if T else 0)


def test_scalar_rows_get_small_tiles():
    """Rows that cannot move by 16-byte accesses (width not a 16-word multiple, or a pointer not
    16-byte aligned) get tiles of SCALAR_TILE_WORDS: at TILE_WORDS each thread held 32 rows and
    their addresses, 200-255 registers on sm_90a and a spill in a mixed launch (docs/static_sm90.md)."""
    from areal_fast.kernels import packing as K

    assert K.tile_shape(1) == (1024, 1) and K.tile_shape(896) == (16, 256)  # 1-word and hidden rows: unchanged
    assert K.tile_shape(16) == (256, 16) and K.tile_shape(16, vector=True) == (256, 16)
    for words in (2, 3, 5, 15, 16, 33, 100):
        bt, bw = K.tile_shape(words, vector=False)
        # at least MIN_BLOCK_T rows: wide rows keep 16 x 128 or 16 x 256 tiles (few rows per thread)
        assert bt * bw <= max(K.SCALAR_TILE_WORDS, K.MIN_BLOCK_T * bw) and bw >= min(words, K.MAX_BLOCK_W), words
    assert K.SCALAR_TILE_WORDS <= 1024  # 8 words per thread at 4 warps
    x = torch.zeros(65, 16, dtype=torch.int64)
    assert K.vector_rows(16, x) and not K.vector_rows(15, x) and not K.vector_rows(16, x.view(-1)[1:])


@pytest.mark.interpreter
def test_five_mixed_dtype_columns_one_launch(monkeypatch):
    """The trainer's per-token columns (int64 ids, fp32 log-probs, int32 versions, bool mask) and
    int64 [T, 3, 5] rows (scalar tiles of 64 x 16 words) in ONE launch each way, over several
    token blocks per program (capped grid), bitwise equal to the references."""
    from areal_fast.kernels import packing as K

    launches = []
    real = K._segment_copy_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append(meta)
                return real[grid](*args, **meta)
            return launch

    monkeypatch.setattr(K, "_segment_copy_kernel", Recording())
    gen = torch.Generator().manual_seed(8)
    lengths = [700, 0, 333, 1000, 1]
    cu, T = cu_of(lengths), sum(lengths)
    tensors = [random_bits((T,), torch.int64, gen), random_bits((T,), torch.float32, gen),
               random_bits((T,), torch.int32, gen), torch.randint(0, 2, (T,), generator=gen).bool(),
               random_bits((T, 3, 5), torch.int64, gen)]
    order = torch.tensor([3, 0, 4, 2, 1])
    want, new_cu = gather_segments_ref(tensors, cu, order)
    old_start = cu.long()[:-1][order]
    outs = [torch.empty_like(t) for t in tensors]
    K.segment_copy(tensors, outs, new_cu, old_start, scatter=False, max_programs=3)
    assert all(same_bits(o, w) for o, w in zip(outs, want))
    back = [torch.empty_like(t) for t in tensors]
    K.segment_copy(outs, back, new_cu, old_start, scatter=True, max_programs=3)
    assert all(same_bits(b, t) for b, t in zip(back, tensors))
    assert len(launches) == 2 and all(m["N_TENSORS"] == 5 for m in launches)
    assert launches[0]["BLOCK_TS"] == (1024, 1024, 1024, 1024, 64) and launches[0]["BLOCK_WS"] == (1, 1, 1, 1, 16)
    got, got_cu = gather_segments(tensors, cu, order, backend="interpret")
    assert torch.equal(got_cu, new_cu) and all(same_bits(g, w) for g, w in zip(got, want))
    assert len(launches) == 3


@pytest.mark.interpreter
def test_gather_in_planner_order_and_single_tensor():
    lengths = [5, 3, 8, 1, 9, 2, 7]
    plan = plan_microbatches(lengths, 10, n_ranks=2)
    cu = cu_of(lengths)
    x = torch.arange(sum(lengths), dtype=torch.int64) * 10
    got, new_cu = gather_segments(x, cu, plan.order, backend="interpret")  # numpy order
    assert isinstance(got, torch.Tensor)
    assert got.tolist() == [v for o in plan.order for v in x[cu[o] : cu[o + 1]].tolist()]
    assert new_cu.tolist() == [0, *np.cumsum([lengths[o] for o in plan.order]).tolist()]
    assert torch.equal(scatter_segments(got, cu, plan.order.tolist(), backend="interpret"), x)


@pytest.mark.interpreter
@pytest.mark.parametrize("max_programs", [1, 3])
def test_kernels_loop_when_grid_is_capped(max_programs):
    """Programs stride over token blocks, so a capped grid (long T) still covers every row."""
    from areal_fast.kernels import packing as K

    gen = torch.Generator().manual_seed(3)
    lengths = [700, 0, 333, 1000]  # 2033 tokens: several 1024-token blocks for 1-word rows
    B, Lmax, T = len(lengths), max(lengths), sum(lengths)
    cu, order = cu_of(lengths), torch.tensor([2, 0, 3, 1])
    a, b = random_bits((T,), torch.int64, gen), random_bits((T, 300), torch.int16, gen)
    want, new_cu = gather_segments_ref([a, b], cu, order)
    old_start = cu.long()[:-1][order]
    outs = [torch.empty_like(a), torch.empty_like(b)]
    K.segment_copy([a, b], outs, new_cu, old_start, scatter=False, max_programs=max_programs)
    assert all(same_bits(o, w) for o, w in zip(outs, want))
    padded = torch.empty(B, Lmax, dtype=torch.int64)
    K.unpack_rows(a, padded, cu, Lmax, max_programs=max_programs)
    assert same_bits(padded, unpack_ref(a, cu, Lmax))


@pytest.mark.interpreter
def test_misaligned_views_and_odd_dtypes():
    """Views at odd byte offsets fall back to narrower words; bool and uint8 copy too."""
    from areal_fast.kernels import packing as K

    gen = torch.Generator().manual_seed(4)
    lengths = [4, 0, 3]
    cu, T = cu_of(lengths), 7
    base = random_bits((T * 4 + 1,), torch.int16, gen)
    odd = base[1:].view(T, 4)  # 8-byte rows, but data_ptr % 4 == 2: must use int16 words
    assert K.word_dtype(8, odd) == torch.int16 and K.word_dtype(8, base[:4]) == torch.int64
    flags = torch.randint(0, 2, (T,), generator=gen).bool()
    u8 = random_bits((T, 5), torch.uint8, gen)
    order = [2, 0, 1]
    got, _ = gather_segments([odd, flags, u8], cu, order, backend="interpret")
    want, _ = gather_segments_ref([odd, flags, u8], cu, order)
    assert all(same_bits(g, w) for g, w in zip(got, want))
    padded = random_bits((3, 4, 3), torch.int16, gen)[:, :, :]
    noncontig = padded.transpose(0, 1).contiguous().transpose(0, 1)
    got = pack(noncontig, lengths, backend="interpret")
    assert all(same_bits(g, w) for g, w in zip(got, pack_ref(padded, lengths)))


@pytest.mark.interpreter
def test_empty_shapes():
    x = torch.zeros(0, 3)
    packed, cu, pos = pack(torch.zeros(0, 5, 3), [], backend="interpret")
    assert packed.shape == (0, 3) and cu.tolist() == [0] and pos.shape == (0,)
    assert unpack(x, cu, 4, backend="interpret").shape == (0, 4, 3)
    assert unpack(x, cu_of([0, 0]), 0, backend="interpret").shape == (2, 0, 3)
    assert unpack(x, cu_of([0, 0]), backend="interpret").shape == (2, 0, 3)
    zero_width = torch.zeros(5, 0)
    out, _ = gather_segments([zero_width, torch.arange(5)], cu_of([2, 3]), [1, 0], backend="interpret")
    assert out[0].shape == (5, 0) and out[1].tolist() == [2, 3, 4, 0, 1]
    p, _, pos = pack(torch.zeros(2, 3, 0), [3, 1], backend="interpret")
    assert p.shape == (4, 0) and pos.tolist() == [0, 1, 2, 0]


# The compiled kernels on CUDA for every dtype, and the same test logic in the Triton interpreter on
# the CPU for one dtype (3.5 s), so a slip in the test itself shows in CI, not on the GPU machine.
KERNEL_RUNS = [pytest.param("cuda", "triton", dt, marks=pytest.mark.gpu, id=f"cuda-{dt}") for dt in DTYPES] + [
    pytest.param("cpu", "interpret", torch.bfloat16, marks=pytest.mark.interpreter, id="cpu-interpret")]


@pytest.mark.parametrize("device,backend,dtype", KERNEL_RUNS)
def test_kernels_match_reference_every_case(device, backend, dtype):
    """Every case above; on CUDA also long sequences and a wide row; and a capped grid."""
    every_case(device, backend, dtype)


def _check(ok: bool) -> None:
    assert ok


def every_case(device, backend, dtype, check=_check, long_case=None):
    """The cases of :func:`test_kernels_match_reference_every_case` (``check`` gets each comparison;
    the variant count below runs them with a no-op)."""
    from areal_fast.kernels import packing as K

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(7)
    cases = [(LENGTHS[c], L, t) for c in LENGTHS for t in TRAILING]
    if device == "cuda" if long_case is None else long_case:
        cases.append(([3000, 0, 1, 4097, 2500], 4100, (1000,)))
    for lengths, Lmax, trailing in cases:
        padded = random_bits((len(lengths), Lmax, *trailing), dtype, gen).to(dev)
        got, want = pack(padded, lengths, backend=backend), pack_ref(padded, lengths)
        check(all(same_bits(g, w) for g, w in zip(got, want)))
        packed, cu, _ = got
        for pad in (0, 7):
            check(same_bits(unpack(packed, cu, Lmax + 1, pad, backend=backend), unpack_ref(packed, cu, Lmax + 1, pad)))
        order = torch.randperm(len(lengths), generator=gen)
        extra = [random_bits((packed.shape[0], 3), torch.bfloat16, gen).to(dev), packed[:, None].clone()]
        g, new_cu = gather_segments([packed, *extra], cu, order, backend=backend)
        gr, new_cu_r = gather_segments_ref([packed, *extra], cu, order)
        check(torch.equal(new_cu, new_cu_r) and all(same_bits(a, b) for a, b in zip(g, gr)))
        back = scatter_segments(g, cu, order, backend=backend)
        check(all(same_bits(a, b) for a, b in zip(back, [packed, *extra])))
    out = torch.empty_like(packed)
    K.segment_copy([packed], [out], new_cu, cu.long()[:-1][order.to(dev)].contiguous(), scatter=False,
                   max_programs=2)
    check(same_bits(out, gr[0]))


# Just enough of a driver targeting sm_90a for the JIT to key and compile kernels without a GPU (the
# scripts below run it in a subprocess before importing the kernels).
FAKE_SM90_DRIVER = textwrap.dedent(
    """
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class FakeDriver:
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_device_interface(self): return torch.cuda
        def get_active_torch_device(self): return torch.device("cpu")
        def get_benchmarker(self): return None

    driver.set_active(FakeDriver())
    """
)

# Specialisations of the GPU test above, counted on CPU: its launches (every dtype, the long case too)
# go to stand-ins that ask the real JIT functions for their cache keys (what decides a compile) under a
# driver that targets sm_90a, without compiling or launching anything.
_VARIANTS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
""") + FAKE_SM90_DRIVER + textwrap.dedent("""
    from areal_fast import dispatch
    from areal_fast.kernels import packing as K

    dispatch.why_unavailable = lambda backend, device=None: None  # 'triton' on CPU tensors: nothing runs
    keys = set()

    class Keyed:
        def __init__(self, jit): self.jit = jit
        def __getitem__(self, grid):
            def launch(*args, **meta):
                _, spec, options = self.jit.device_caches[0][4](*args, **meta)  # the JIT's own binder
                keys.add((self.jit.fn.__name__, str(spec), str(options)))
            return launch

    K._segment_copy_kernel, K._unpack_kernel = Keyed(K._segment_copy_kernel), Keyed(K._unpack_kernel)
    sys.path.insert(0, sys.argv[1])
    import test_packing_kernels as t

    t.random_bits = lambda shape, dtype, gen: torch.empty(shape, dtype=dtype)  # contents change no key
    for dtype in t.DTYPES:
        t.every_case("cpu", "triton", dtype, check=lambda ok: None, long_case=True)
    print("variants", len(keys), sum(k[0] == "_unpack_kernel" for k in keys))
    """
)
# 84 while counts (T, B, the block counts...) were specialised; the kernels' comment says which stay
MAX_COLD_VARIANTS = 51


def test_the_gpu_test_compiles_few_kernel_variants():
    """Cold, every distinct specialisation is one Triton compile on the GPU machine: the GPU test's
    launches may need at most MAX_COLD_VARIANTS of them (sizes and counts are not specialised)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _VARIANTS_SCRIPT, str(Path(__file__).parent)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total, unpack_variants = map(int, proc.stdout.split("variants")[-1].split())
    assert 0 < unpack_variants < total <= MAX_COLD_VARIANTS, proc.stdout


# ----------------------------------------------------------------------------- autograd


@pytest.mark.interpreter
def test_pack_unpack_gradients_match_reference():
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 0, 9, 5]
    padded = torch.randn(4, L, 6, generator=gen)
    w_packed = torch.randn(17, 6, generator=gen)
    w_padded = torch.randn(4, L + 1, 6, generator=gen)
    grads = []
    for fn_pack, fn_unpack in (
        (lambda x: pack(x, lengths, backend="interpret"), lambda p, c: unpack(p, c, L + 1, 2.0, backend="interpret")),
        (lambda x: pack_ref(x, lengths), lambda p, c: unpack_ref(p, c, L + 1, 2.0)),
    ):
        x = padded.clone().requires_grad_(True)
        packed, cu, pos = fn_pack(x)
        assert not pos.requires_grad
        y = fn_unpack(packed * 3.0, cu)  # unpack of a non-leaf: gradient flows through both ops
        ((packed * w_packed).sum() + (y * w_padded).sum()).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert bool((grads[0][1] == 0).all()) and bool((grads[0][0, 3:] == 0).all())  # pad rows


@pytest.mark.interpreter
def test_gather_scatter_gradients_match_reference():
    gen = torch.Generator().manual_seed(6)
    lengths = [4, 0, 2, 5]
    cu, T, order = cu_of(lengths), 11, [3, 1, 0, 2]
    a0 = torch.randn(T, 3, generator=gen)
    b0 = torch.randn(T, generator=gen, dtype=torch.float64)
    ids = torch.arange(T)
    wa, wb = torch.randn(T, 3, generator=gen), torch.randn(T, generator=gen, dtype=torch.float64)
    results = []
    for gather, scatter in (
        (lambda ts: gather_segments(ts, cu, order, backend="interpret")[0],
         lambda ts: scatter_segments(ts, cu, order, backend="interpret")),
        (lambda ts: gather_segments_ref(ts, cu, order)[0], lambda ts: scatter_segments_ref(ts, cu, order)),
    ):
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        ga, gb, gi = gather([a, b, ids])
        assert not gi.requires_grad
        (sa,) = scatter([ga * wa])  # b's gather output only used directly: a None grad for one input
        ((sa * sa).sum() + (gb * wb).sum()).backward()
        results.append((a.grad, b.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ----------------------------------------------------------------------------- errors and dispatch


def _bad_cases():
    cu = cu_of([2, 3])
    x = torch.zeros(5, 2)
    return [
        ("pack", lambda: pack(torch.zeros(3), [1, 2, 3]), ValueError, r"pack: padded must be a tensor \[B, L"),
        ("pack", lambda: pack(torch.zeros(2, 4), [1, 2, 3]), ValueError, r"lengths must have shape \[B\] = \[2\]"),
        ("pack", lambda: pack(torch.zeros(2, 4), [1, 5]), ValueError, r"lengths\[1\] = 5 is outside 0..L = 0..4"),
        ("pack", lambda: pack(torch.zeros(2, 4), [-1, 2]), ValueError, r"lengths\[0\] = -1"),
        ("pack", lambda: pack(torch.zeros(2, 4), [1.5, 2.0]), TypeError, "lengths must hold integers"),
        ("unpack", lambda: unpack(x, cu.long(), 4), TypeError, "cu_seqlens must be int32, got torch.int64"),
        ("unpack", lambda: unpack(x, cu.view(1, 3), 4), ValueError, "cu_seqlens must be 1-D"),
        ("unpack", lambda: unpack(x, torch.tensor([0, 4, 3, 5], dtype=torch.int32), 4), ValueError,
         r"non-decreasing, got cu_seqlens\[1\] = 4 > cu_seqlens\[2\] = 3"),
        ("unpack", lambda: unpack(x, torch.tensor([1, 2, 5], dtype=torch.int32), 4), ValueError,
         r"must start at 0"),
        ("unpack", lambda: unpack(torch.zeros(6, 2), cu, 4), ValueError,
         r"cu_seqlens\[-1\] = 5 tokens but packed has 6 rows"),
        ("unpack", lambda: unpack(x, cu, 2), ValueError, "sequence 1 has 3 tokens > max_len = 2"),
        ("gather", lambda: gather_segments([x, torch.zeros(4)], cu, [1, 0]), ValueError,
         r"tensors\[0\] has 5, tensors\[1\] has 4"),
        ("gather", lambda: gather_segments([], cu, [1, 0]), TypeError, "non-empty list/tuple of tensors"),
        ("gather", lambda: gather_segments(x, cu, [0, 0]), ValueError, r"permutation of range\(2\).*\[0, 0\]"),
        ("gather", lambda: gather_segments(x, cu, [1, 2]), ValueError, r"permutation of range\(2\)"),
        ("gather", lambda: gather_segments(x, cu, [-1, 0]), ValueError, r"permutation of range\(2\)"),
        ("gather", lambda: gather_segments(x, cu, [0, 1, 2]), ValueError, r"one entry per sequence \(B = 2"),
        ("gather", lambda: gather_segments(x, cu, [0.0, 1.0]), TypeError, "order must hold integers"),
        ("gather", lambda: gather_segments(x, [0, 2, 5], [0, 1]), TypeError, "cu_seqlens must be a torch.Tensor"),
        ("scatter", lambda: scatter_segments(torch.zeros(4, 2), cu, [1, 0]), ValueError,
         r"scatter_segments: cu_seqlens\[-1\] = 5 tokens but tensors\[0\] has 4 rows"),
        ("scatter", lambda: scatter_segments(x, cu.float(), [1, 0]), TypeError, "must be int32, got torch.float32"),
    ]


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_inputs_raise_clear_errors(i, backend, monkeypatch):
    if backend == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter not enabled")
    monkeypatch.setenv("AREAL_FAST_BACKEND", backend)
    _, fn, exc, match = _bad_cases()[i]
    with pytest.raises(exc, match=match):
        fn()


def test_backend_dispatch(monkeypatch):
    from areal_fast.kernels import packing as K

    x = torch.arange(12).view(2, 6)
    with pytest.raises(BackendUnavailable, match="packing.pack: backend 'triton' was requested"):
        pack(x, [1, 2], backend="triton")
    with pytest.raises(BackendUnavailable, match="has only triton, interpret, reference"):
        unpack(x.view(12), cu_of([12]), 12, backend="cuda")

    def boom(*a, **k):
        raise AssertionError("kernel launched on the reference backend")

    monkeypatch.setattr(K, "segment_copy", boom)
    monkeypatch.setenv("AREAL_FAST_BACKEND", "reference")
    packed, cu, pos = pack(x, [1, 2])
    assert packed.tolist() == [0, 6, 7] and pos.tolist() == [0, 0, 1]
    assert gather_segments(packed, cu, [1, 0])[0].tolist() == [6, 7, 0]


# ----------------------------------------------------------------------------- compiled (no GPU needed)

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import torch, triton
""") + FAKE_SM90_DRIVER + textwrap.dedent("""
    from areal_fast.kernels import packing as K

    def compile_segment_copy(T, B, ws, scatter, write_pos):
        cu, starts = torch.zeros(B + 1, dtype=torch.int32), torch.zeros(B, dtype=torch.int64)
        tiles = [K.tile_shape(w.shape[1]) for w in ws]
        return K._segment_copy_kernel.warmup(
            tuple(ws), tuple(ws), tuple(w.shape[1] for w in ws), cu, starts, starts, T, B, B.bit_length(),
            N_TENSORS=len(ws), BLOCK_TS=tuple(t for t, _ in tiles), BLOCK_WS=tuple(w for _, w in tiles),
            SCATTER=scatter, WRITE_POS=write_pos, grid=(1, len(ws)))

    T = 1000
    ws = [torch.zeros(T, 1024, dtype=torch.int64), torch.zeros(T, 1, dtype=torch.int16),
          torch.zeros(T, 3, dtype=torch.int32)]
    k = compile_segment_copy(T, 7, ws, True, True)
    # 16-byte vector loads for the 8-byte-word rows (1024 words: 16-byte aligned rows)
    assert "ld.global.v2.b64" in k.asm["ptx"], "no 16-byte loads"
    compile_segment_copy(1, 1, [torch.zeros(1, 1, dtype=torch.uint8)], False, False)  # a width of 1 specializes
    cu = torch.zeros(8, dtype=torch.int32)
    for M, W in ((16, 1024), (1, 1)):
        K._unpack_kernel.warmup(ws[0], ws[0], ws[0], cu, 7 * M, M, W, 10, BLOCK_T=16, BLOCK_W=256,
                                HAS_PAD=W > 1, grid=(1,))
    print("compiled ok")
    """
)


def test_kernels_compile_for_sm90_without_gpu():
    """The interpreter accepts some code that the compiler rejects: compile to PTX/cubin for sm_90a."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton wheel without the NVIDIA backend's ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and "compiled ok" in proc.stdout, proc.stderr[-3000:]
