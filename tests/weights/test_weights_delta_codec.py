"""The delta codec (``areal_fast.weights.delta_codec``): every backend against the torch reference,
bit pattern for bit pattern (-0.0 vs 0.0, NaN payloads, inf), odd shapes, empty deltas, all changed.

Backends: reference (defines the result), native (C++ ``csrc/reshard/delta_cpu.cpp``), interpret
(the Triton kernels of ``kernels/delta.py`` under TRITON_INTERPRET=1), triton (gpu).
"""

from __future__ import annotations

import pytest
import torch

from areal_fast import dispatch
from areal_fast.weights.delta_codec import delta_apply, delta_apply_ref, delta_encode, delta_encode_ref

# bf16 bit patterns that float compares get wrong: +0/-0, two NaN payloads, +-inf, a subnormal
SPECIAL_BITS = [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC3, 0x7F80, 0xFF80, 0x0001]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _pair(shape, frac: float, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g).to(dtype)
    new = old.clone()
    mask = torch.rand(shape, generator=g) < frac
    new[mask] = (old[mask].float() * 1.01 + 1e-3).to(dtype)
    return old, new


def _special_pair():
    """Every ordered pair of special bit patterns (equal pairs unchanged, the rest changed)."""
    s = torch.tensor(SPECIAL_BITS, dtype=torch.int32)
    a, b = torch.meshgrid(s, s, indexing="ij")
    to16 = lambda t: ((t + 0x8000) % 0x10000 - 0x8000).to(torch.int16).reshape(-1)  # noqa: E731
    return to16(a).view(torch.bfloat16), to16(b).view(torch.bfloat16)


CASES = {
    "empty": lambda: _pair((0,), 0.5),
    "one_same": lambda: _pair((1,), 0.0),
    "odd_3x5x7": lambda: _pair((3, 5, 7), 0.3, 1),
    "across_blocks": lambda: _pair((2049 * 3 + 5,), 0.01, 2),
    "none_changed": lambda: _pair((17, 129), 0.0, 3),
    "all_changed": lambda: _pair((33, 65), 1.01, 4),
    "special_bits": _special_pair,
    "fp16": lambda: _pair((257,), 0.2, 5, torch.float16),
}


def _backends():
    out = [pytest.param("reference"), pytest.param("native")]
    out.append(pytest.param("interpret", marks=pytest.mark.interpreter))
    return out


def _need(name: str, device="cpu"):
    try:
        dispatch.select("weights.delta_encode", device, backend=name)
    except dispatch.BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_round_trip_is_bitwise(case):
    old, new = CASES[case]()
    idx, val = delta_encode_ref(old, new)
    want = torch.nonzero(_bits(old).reshape(-1) != _bits(new).reshape(-1)).reshape(-1)
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), want)
    dst = old.clone()
    delta_apply_ref(dst, idx, val)
    assert torch.equal(_bits(dst), _bits(new))


def test_special_bits_count_every_bit_change():
    old, new = _special_pair()
    idx, _ = delta_encode_ref(old, new)
    n = len(SPECIAL_BITS)
    assert idx.numel() == n * n - n  # only the diagonal is unchanged, -0.0/0.0 and NaN payloads included


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_equals_reference(name, case):
    _need(name)
    old, new = CASES[case]()
    want_idx, want_val = delta_encode_ref(old, new)
    idx, val = delta_encode(old, new, backend=name)
    assert torch.equal(idx, want_idx) and torch.equal(_bits(val), _bits(want_val))
    dst = old.clone()
    assert delta_apply(dst, idx, val, backend=name) == name
    assert torch.equal(_bits(dst), _bits(new))


@pytest.mark.parametrize("name", _backends())
def test_max_changed_refuses_without_encoding(name):
    _need(name)
    old, new = _pair((300,), 0.5, 7)
    n = delta_encode_ref(old, new)[0].numel()
    assert delta_encode(old, new, backend=name, max_changed=n - 1) is None
    assert delta_encode(old, new, backend=name, max_changed=n)[0].numel() == n


@pytest.mark.parametrize("name", _backends())
def test_index_outside_the_tensor_raises_before_writing(name):
    _need(name)
    dst = torch.zeros(10, dtype=torch.bfloat16)
    idx = torch.tensor([1, 10], dtype=torch.int32)
    val = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="10"):
        delta_apply(dst, idx, val, backend=name)
    assert torch.equal(dst, torch.zeros(10, dtype=torch.bfloat16))  # nothing written


def test_bad_inputs_are_named():
    a = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(ValueError, match="only 16-bit"):
        delta_encode(a, a)
    b = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must match"):
        delta_encode(b, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not contiguous"):
        delta_encode(torch.zeros(4, 4, dtype=torch.bfloat16).t(), torch.zeros(4, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="int32"):
        delta_apply(b, torch.tensor([0]), torch.ones(1, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_on_cuda_equals_reference(case):
    _need("triton", "cuda")
    old, new = CASES[case]()
    want_idx, want_val = delta_encode_ref(old, new)
    idx, val = delta_encode(old.cuda(), new.cuda(), backend="triton")
    assert torch.equal(idx.cpu(), want_idx) and torch.equal(_bits(val.cpu()), _bits(want_val))
    dst = old.cuda()
    delta_apply(dst, idx, val, backend="triton")
    assert torch.equal(_bits(dst.cpu()), _bits(new))
