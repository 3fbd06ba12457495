"""The package itself: the native core, the kernels subpackage, and backend selection."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from tolerances import FP32_TINY_OP_TOL

import areal_fast
from areal_fast import dispatch


def test_import_has_no_gpu_requirement():
    # A fresh interpreter with no CUDA visible and no Triton interpreter must import everything.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    code = "import areal_fast, areal_fast.kernels, areal_fast.packing; print(areal_fast.__version__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == areal_fast.__version__


def test_kernels_are_a_subpackage_not_top_level():
    import areal_fast.kernels as k

    assert k.__name__ == "areal_fast.kernels"
    assert "kernels" not in sys.modules or sys.modules["kernels"] is not k



def test_a_checkout_does_not_shadow_a_top_level_kernels_package(tmp_path):
    # transformers imports Hugging Face's `kernels` when it is installed; run from a checkout our
    # folder of the same name comes first on sys.path and must give way to it (transformers 5.25
    # failed every model build otherwise).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'theirs'\n")
    probe = ("import os, sys; sys.path[:] = [{root!r}] + {extra!r} + [p for p in sys.path if not os.path.isdir("
             "os.path.join(p or '.', 'kernels'))]\n"  # no other kernels but the one given
             "import kernels; print(getattr(kernels, 'CUDAProperties', None), kernels.__file__)\n"
             "import areal_fast.kernels as k; print(k.__name__, k.__file__)\n")
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", probe.format(root=root, extra=extra)], cwd=root, capture_output=True, text=True,
        timeout=120)
    found = run([str(tmp_path / "site")])
    assert found.returncode == 0, found.stderr
    theirs, ours = found.stdout.splitlines()
    assert theirs == f"theirs {other / '__init__.py'}"
    assert ours.startswith("areal_fast.kernels ")
    # with no other one, ours stays as it was (no version: transformers' "not installed")
    alone = run([])
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.splitlines()[0] == f"None {os.path.join(root, 'kernels', '__init__.py')}"
    # the checkout on the path a second time under another spelling (a link to it) is still the checkout
    (tmp_path / "link").symlink_to(root)
    twice = run([str(tmp_path / "link")])
    assert twice.returncode == 0, twice.stderr[-2000:]
    assert twice.stdout.splitlines()[0] == f"None {os.path.join(root, 'kernels', '__init__.py')}"


def test_native_core_reports_its_build():
    C = dispatch.native()
    assert isinstance(C.has_cuda(), bool)
    if shutil.which("nvcc") and os.environ.get("AREAL_FAST_CUDA", "AUTO") != "OFF":
        # This machine has nvcc, so the build must have compiled the CUDA sources.
        assert C.has_cuda(), "nvcc is on PATH but areal_fast._C was built without CUDA"


def test_native_core_counts_the_devices_torch_sees():
    C = dispatch.native()
    if not C.has_cuda():
        assert C.cuda_device_count() == 0, "a build without CUDA sources must report no devices"
    elif torch.version.cuda is not None:
        assert C.cuda_device_count() == torch.cuda.device_count()
    # With every device hidden, the CUDA runtime (and so the core) must see none.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    code = "from areal_fast.dispatch import native; print(native().cuda_device_count())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_reference_is_always_available():
    assert dispatch.select("demo", "cpu", available=("triton", "reference")) == "reference"
    assert dispatch.why_unavailable("reference", "cpu") is None


def test_env_override(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.select("demo", "cpu", available=dispatch.BACKENDS) == "reference"
    monkeypatch.setenv(dispatch.ENV_VAR, "warp")
    with pytest.raises(dispatch.BackendUnavailable, match="AREAL_FAST_BACKEND='warp': 'warp' is not a backend"):
        dispatch.select("demo", "cpu", available=dispatch.BACKENDS)


def test_explicit_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    with pytest.raises(dispatch.BackendUnavailable, match="backend 'triton' was requested .* but cannot run"):
        dispatch.select("demo", "cpu", available=dispatch.BACKENDS, backend="triton")
    with pytest.raises(dispatch.BackendUnavailable, match="has only reference"):
        dispatch.select("demo", "cpu", available=("reference",), backend="cuda")


def test_cuda_backend_needs_cuda_tensors():
    reason = dispatch.why_unavailable("cuda", "cpu")
    assert reason is not None and ("CUDA" in reason or "cuda" in reason)


def _tiny_case(op: str, device: str):
    """A tiny call of ``op`` on ``device``: ``run(backend) -> result`` (comparable with ``_same``)."""
    import numpy as np

    from areal_fast.ops.ppo_loss import token_logprobs
    from areal_fast.packing import plan_microbatches
    from areal_fast.packing.segments import gather_segments, pack, scatter_segments, unpack
    from areal_fast.weights.interval_copy import interval_copy
    from areal_fast.weights.plan import DTYPE_CODES, assign_buckets

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=device)
    x = torch.randn(6, 3, generator=g).to(device)
    if op == "ppo_loss":
        logits, labels = torch.randn(5, 11, generator=g).to(device), torch.tensor([0, 3, 10, 7, 1], device=device)
        return lambda b: token_logprobs(logits, labels, backend=b)
    if op == "packing.pack":
        padded = torch.randn(3, 4, 2, generator=g).to(device)
        return lambda b: pack(padded, [2, 4, 1], backend=b)
    if op == "packing.unpack":
        return lambda b: unpack(x, cu, 3, backend=b)
    if op == "packing.gather_segments":
        return lambda b: gather_segments(x, cu, [2, 0, 1], backend=b)
    if op == "packing.scatter_segments":
        return lambda b: scatter_segments(x, cu, [2, 0, 1], backend=b)
    if op == "packing.plan":  # budget 4: each sequence alone, the only valid plan up to order
        return lambda b: sorted(sorted(mb) for r in plan_microbatches([3, 4, 2], 4, backend=b).microbatches for mb in r)
    if op == "weights.plan":
        return lambda b: assign_buckets([10, 7, 30, 1], [4, 4, 8, 1], 32, backend=b)
    if op == "weights.interval_copy":
        src = torch.arange(8, dtype=torch.float32, device=device)
        code = DTYPE_CODES[torch.float32]
        iv = np.array([[0, 0, 2, 0, 0, 0, 3, 1, code, code], [0, 0, 6, 0, 0, 4, 2, 1, code, code]])

        def run(b):
            dst = torch.zeros(6, dtype=torch.float32, device=device)
            interval_copy([src], [dst], iv, backend=b)
            return dst
        return run
    if op in ("weights.delta_encode", "weights.delta_apply"):
        from areal_fast.weights.delta_codec import delta_apply, delta_encode

        old = torch.tensor([0.0, -0.0, 1.5, 2.0, 3.0], dtype=torch.bfloat16, device=device)
        new = torch.tensor([-0.0, -0.0, 1.5, 2.5, 3.0], dtype=torch.bfloat16, device=device)

        def run_delta(b):
            if op == "weights.delta_encode":
                return [t.view(torch.int16) for t in delta_encode(old, new, backend=b)]
            dst = old.clone()
            delta_apply(dst, torch.tensor([0, 3], dtype=torch.int32, device=device), new[[0, 3]], backend=b)
            return dst.view(torch.int16)
        return run_delta
    raise AssertionError(f"no tiny case for op {op!r}: add one here")


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return torch.allclose(got.cpu().float(), want.cpu().float(), **FP32_TINY_OP_TOL)
    if isinstance(want, (tuple, list)) and any(isinstance(w, (tuple, list)) or hasattr(w, "shape") for w in want):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if hasattr(want, "shape"):  # numpy arrays
        import numpy as np

        return np.array_equal(np.asarray(got), np.asarray(want))
    return got == want


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
def test_what_describe_reports_is_what_runs(op, monkeypatch):
    """describe() is what `areal-fast info` shows: every backend of ``op`` it reports available runs
    the op and equals the reference; every one it reports unavailable, forced, raises
    BackendUnavailable naming the op and the reason describe gave; the op's automatic choice is
    the backend describe names, and runs."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    d = dispatch.describe()
    assert set(dispatch.BACKENDS) <= set(d) and d["reference"] == "available"
    host_only = set(dispatch.OPS[op]) <= {"native", "reference"}
    device = "cpu" if host_only else d["device"]
    run = _tiny_case(op, device)
    want = run("reference")
    for b in dispatch.OPS[op]:
        status = d["native"] if b == "native" else d[b]
        if b == "native" or host_only or device == d["device"]:
            if status == "available":
                assert _same(run(b), want), f"{op}: backend {b!r} is reported available but differs from the reference"
            else:
                with pytest.raises(dispatch.BackendUnavailable, match=re.escape(op)) as e:
                    run(b)
                assert status in str(e.value), f"{op}: forcing {b!r} says {e.value}, describe says {status!r}"
    chosen = d[f"op:{op}"]
    assert chosen in dispatch.OPS[op] and d["native" if chosen == "native" else chosen] == "available"
    assert _same(run(None), want)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("doc", ["architecture.md", "glossary.md"])
def test_every_file_a_doc_names_exists(doc):
    """Paths in backticks (``areal_fast/x.py``, ``trainer/batch.py``) and linked docs must exist:
    from the repository root, from ``docs/``, from ``areal_fast/`` (or its ``rollout/``), or
    from a directory named in backticks in the ``###`` heading above them."""
    roots = [os.path.join(REPO, *d) for d in ((), ("docs",), ("areal_fast",), ("areal_fast", "rollout"))]
    named, section = [], []
    for line in open(os.path.join(REPO, "docs", doc)):
        if line.startswith("#"):
            section = [os.path.join(REPO, d) for d in re.findall(r"`([\w./-]+/)`", line)]
            continue
        for p in re.findall(r"`([\w./-]+\.(?:py|cpp|cu|h|md|txt))`", line) + re.findall(r"\]\(([\w./-]+\.md)", line):
            named.append((p, roots + section))
    assert named, f"docs/{doc} names no file"
    missing = sorted({p for p, where in named if not any(os.path.exists(os.path.join(r, p)) for r in where)})
    assert missing == [], f"docs/{doc} names files that do not exist: {missing}"


def test_no_test_skips_on_an_import_error_of_our_own_code():
    """A broken import of areal_fast must fail the suite, not show up as a skip."""
    hidden = re.compile(r"importorskip\(\s*[\"']areal_fast|except\s*\(?\s*(ImportError|ModuleNotFoundError)[^\n]*:\s*\n"
                        r"\s*pytest\.skip")
    tests = os.path.join(REPO, "tests")
    files = [os.path.join(d, f) for d, _, names in os.walk(tests) for f in names if f.endswith(".py")]
    assert len(files) > 50, f"found only {len(files)} test modules under {tests}"
    offenders = sorted(os.path.relpath(f, tests) for f in files if hidden.search(open(f).read()))
    assert offenders == [], f"these tests turn an ImportError into a skip: {offenders}"


MAX_MODULE_LINES = 600  # a file past this mixes concerns: split it by what it owns


def test_no_module_of_the_package_is_over_600_lines():
    pkg = os.path.join(REPO, "areal_fast")
    long = {}
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    n = sum(1 for _ in f)
                if n > MAX_MODULE_LINES:
                    long[os.path.relpath(path, REPO)] = n
    assert long == {}, f"over {MAX_MODULE_LINES} lines: {long}"


BENCH_LINE_LIMIT = 7000  # the benchmarks share one harness (bench/common.py, bench/sweep.py); past this, fold


def test_the_benchmarks_stay_within_their_line_budget():
    """bench/ holds measurements only, on one shared harness; servers, simulators and device checks
    they use live in tools/. Growing past the budget means a new benchmark repeats the harness."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench"
    lines = sum(len(p.read_text().splitlines()) for p in bench.rglob("*.py"))
    assert 0 < lines <= BENCH_LINE_LIMIT, f"bench/ has {lines} lines of Python, over {BENCH_LINE_LIMIT}"
