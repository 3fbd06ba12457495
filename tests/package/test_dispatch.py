"""Backend selection: ``areal_fast.dispatch.select`` is the one switch for every op (forced
backends, unavailable backends, the AREAL_FAST_BACKEND override), and every op routes through it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import areal_fast
from areal_fast import dispatch
from areal_fast.dispatch import BackendUnavailable, select
from areal_fast.packing import pack, pack_ref, plan_microbatches, plan_microbatches_ref
from areal_fast.weights.interval_copy import interval_copy
from areal_fast.weights.plan import plan_fsdp_buckets

PLANNER_ARGS = ([5, 3, 9, 1, 7, 2], 10)


COPY_2 = [[0, 0, 2, 0, 0, 2, 2, 1, 1, 1]]  # one run of 2 float32 elements, tensor 0 -> tensor 0


def same_plan(a, b) -> bool:
    return a.microbatches == b.microbatches and a.rank_cost.tolist() == b.rank_cost.tolist()


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


def _interpreter_usable() -> bool:
    return dispatch.why_unavailable("interpret", "cpu") is None


# ------------------------------------------------------------------------------- the one list
def test_every_op_lists_known_backends_fastest_first_with_a_reference():
    for op, names in dispatch.OPS.items():
        assert set(names) <= set(dispatch.BACKENDS), op
        assert names[-1] == "reference", f"{op}: every op has a reference, tried last"
        assert list(names) == sorted(names, key=dispatch.BACKENDS.index), f"{op}: not in BACKENDS order"


def test_unknown_op_and_unknown_backend_are_named():
    with pytest.raises(ValueError, match="unknown op 'packing.plann'"):
        select("packing.plann")
    with pytest.raises(BackendUnavailable, match="packing.plan: unknown backend 'warp'"):
        select("packing.plan", backend="warp")
    with pytest.raises(ValueError, match="unknown backend 'warp'"):
        dispatch.why_unavailable("warp", "cpu")


# ------------------------------------------------------------------------------------ forced
def test_forced_backends_run_each_op():
    lengths, budget = PLANNER_ARGS
    assert same_plan(plan_microbatches(lengths, budget, backend="reference"), plan_microbatches_ref(lengths, budget))
    native_plan = plan_microbatches(lengths, budget, backend="native")
    assert sorted(native_plan.order.tolist()) == list(range(len(lengths)))

    rows, cols = [4, 3], [5, 2]
    a = plan_fsdp_buckets(rows, cols, [1, 1], [2, 2], 2, 64, backend="native")
    b = plan_fsdp_buckets(rows, cols, [1, 1], [2, 2], 2, 64, backend="reference")
    assert a.bucket.tolist() == b.bucket.tolist() and a.bucket_bytes.tolist() == b.bucket_bytes.tolist()

    x = torch.arange(6, dtype=torch.float32)
    iv = [[0, 0, 6, 0, 0, 6, 6, 1, 1, 1]]  # 6 float32 elements, one run
    for name in ("native", "reference"):
        y = torch.zeros(6)
        assert interval_copy([x], [y], iv, backend=name) == name
        assert torch.equal(y, x)

    padded = torch.arange(12.0).view(2, 3, 2)
    got = pack(padded, [2, 3], backend="reference")
    assert all(torch.equal(g, w) for g, w in zip(got, pack_ref(padded, torch.tensor([2, 3]))))


def test_automatic_choice_on_cpu():
    assert select("packing.plan") == "native"
    assert select("weights.plan") == "native"
    assert select("weights.interval_copy", torch.device("cpu")) == "native"
    assert interval_copy([torch.ones(2)], [torch.zeros(2)], COPY_2) == "native"
    # The interpreter is never chosen automatically, even with TRITON_INTERPRET=1 (set by conftest
    # on machines without a GPU): it exists to test kernels and is ~1000x slower than the reference.
    assert select("packing.pack", "cpu") == "reference"
    assert select("ppo_loss", "cpu") == "reference"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_automatic_choice_on_cuda():
    want = "triton" if dispatch.why_unavailable("triton", "cuda") is None else "reference"
    assert select("packing.pack", "cuda") == want
    want = "cuda" if dispatch.native_has_cuda() else "reference"
    assert select("weights.interval_copy", "cuda:0") == want


# ------------------------------------------------------------------------------- unavailable
def test_backend_an_op_does_not_have_raises_with_the_list():
    with pytest.raises(BackendUnavailable, match=r"packing.plan: backend 'triton' .* has only native, reference"):
        plan_microbatches(*PLANNER_ARGS, backend="triton")
    with pytest.raises(BackendUnavailable, match=r"weights.plan: backend 'interpret' .* has only native, reference"):
        plan_fsdp_buckets([2], [2], [1], [1], 1, 64, backend="interpret")


def test_backend_that_cannot_run_here_raises_with_the_reason():
    with pytest.raises(BackendUnavailable, match=r"weights.interval_copy: backend 'cuda' .* cannot run: .*CUDA"):
        interval_copy([torch.ones(2)], [torch.zeros(2)], COPY_2, backend="cuda")
    with pytest.raises(BackendUnavailable, match=r"packing.pack: backend 'triton' .* cannot run: .*(CUDA|interpret)"):
        pack(torch.zeros(2, 3, 1), [1, 2], backend="triton")
    if not _interpreter_usable():
        with pytest.raises(BackendUnavailable, match=r"packing.pack: backend 'interpret' .* cannot run"):
            pack(torch.zeros(2, 3, 1), [1, 2], backend="interpret")


def test_missing_native_core_falls_back_with_the_reason(monkeypatch):
    def broken_native():
        raise ImportError("areal_fast._C (the native core) is not built (simulated)")

    monkeypatch.setattr(dispatch, "native", broken_native)
    dispatch._warn_fallback.cache_clear()
    lengths, budget = PLANNER_ARGS
    with pytest.warns(RuntimeWarning, match=r"packing.plan: falling back from 'native'.*not built \(simulated\)"):
        plan = plan_microbatches(lengths, budget)
    assert same_plan(plan, plan_microbatches_ref(lengths, budget))
    with pytest.raises(BackendUnavailable, match=r"packing.plan: backend 'native' .* not built \(simulated\)"):
        plan_microbatches(lengths, budget, backend="native")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert select("weights.interval_copy", "cpu") == "reference"
        info = dispatch.describe()
    assert info["native"].startswith("areal_fast._C (the native core) is not built")
    assert info["op:weights.plan"] == "reference"
    dispatch._warn_fallback.cache_clear()


# ------------------------------------------------------------------------------ environment
def test_env_forces_every_op_that_has_the_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    for op in dispatch.OPS:
        assert select(op, "cpu") == "reference", op
    assert interval_copy([torch.ones(2)], [torch.zeros(2)], COPY_2) == "reference"
    lengths, budget = PLANNER_ARGS
    assert same_plan(plan_microbatches(lengths, budget), plan_microbatches_ref(lengths, budget))


def test_env_global_value_leaves_ops_without_that_backend_alone(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "native")
    assert select("packing.plan") == "native"
    assert select("packing.pack", "cpu") == "reference"  # no native pack: automatic choice
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert select("packing.plan") == "native"
    with pytest.raises(BackendUnavailable, match=r"packing.pack: backend 'triton' was requested \(AREAL_FAST_BACKEND"):
        select("packing.pack", "cpu")  # has triton, forced, cannot run on CPU


def test_env_per_op_entries(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "packing.plan=reference")
    assert select("packing.plan") == "reference"
    assert select("weights.plan") == "native"
    monkeypatch.setenv(dispatch.ENV_VAR, "native, packing=reference , packing.plan=native")
    assert select("packing.plan") == "native"  # the longest key wins
    assert select("packing.gather_segments", "cpu") == "reference"
    assert select("weights.interval_copy", "cpu") == "native"
    monkeypatch.setenv(dispatch.ENV_VAR, "packing.plan=triton")  # named for this op: must be honoured
    with pytest.raises(BackendUnavailable, match="packing.plan: backend 'triton' .* has only native, reference"):
        select("packing.plan")


def test_env_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "warp")
    with pytest.raises(BackendUnavailable, match=r"AREAL_FAST_BACKEND='warp': 'warp' is not a backend"):
        select("packing.plan")
    monkeypatch.setenv(dispatch.ENV_VAR, "packing.plan=warp")
    with pytest.raises(BackendUnavailable, match=r"'warp' is not a backend"):
        select("weights.plan")
    monkeypatch.setenv(dispatch.ENV_VAR, "=reference")
    with pytest.raises(BackendUnavailable, match="no op name"):
        select("weights.plan")


def test_argument_wins_over_env(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert select("packing.plan", backend="native") == "native"
    assert interval_copy([torch.ones(2)], [torch.zeros(2)], COPY_2, backend="native") == "native"
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert select("packing.plan", backend="auto") == "native"


@pytest.mark.skipif(not _interpreter_usable(), reason="needs Triton and TRITON_INTERPRET=1 (set by tests/conftest.py)")
def test_env_can_ask_for_the_interpreter(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "interpret")
    assert select("packing.pack", "cpu") == "interpret"
    assert select("packing.plan") == "native"
    padded = torch.arange(12.0).view(2, 3, 2)
    got = pack(padded, [2, 3])
    assert all(torch.equal(g, w) for g, w in zip(got, pack_ref(padded, torch.tensor([2, 3]))))


# ------------------------------------------------------------------------ nobody else decides
def test_only_dispatch_py_reads_the_override():
    root = Path(areal_fast.__file__).parent
    reads = re.compile(r"(environ|getenv)[^\n]*AREAL_FAST_BACKEND|ENV_VAR\b")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "dispatch.py" and reads.search(p.read_text())]
    assert offenders == [], f"these modules read AREAL_FAST_BACKEND themselves: {offenders}"


def test_planner_results_do_not_depend_on_lengths_type_under_reference():
    lengths = np.array([5, 3, 9, 1], dtype=np.int32)
    assert same_plan(plan_microbatches(lengths, 10, backend="reference"),
                     plan_microbatches(torch.tensor([5, 3, 9, 1]), 10, backend="reference"))


def test_describe_reports_every_backend_and_what_each_op_runs(monkeypatch):
    d = dispatch.describe()
    assert set(dispatch.BACKENDS) <= set(d) and d["reference"] == "available"
    assert {f"op:{op}" for op in dispatch.OPS} <= set(d)
    assert d["op:packing.plan"] == "native"
    monkeypatch.setenv(dispatch.ENV_VAR, "packing.plan=reference")
    assert dispatch.describe()["op:packing.plan"] == "reference"
    monkeypatch.setenv(dispatch.ENV_VAR, "weights.plan=triton")
    assert dispatch.describe()["op:weights.plan"].startswith("error: weights.plan: backend 'triton'")
