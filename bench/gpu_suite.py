"""One command for a fresh GPU machine: install, run every GPU test and GPU benchmark, one result file.

    python bench/gpu_suite.py [--out FILE] [--only STEP,...] [--wheelhouse DIR] [--budget-s 1200]
    python bench/gpu_suite.py --part a|b|c    # a third of it, each under 10 minutes (see PARTS)
    python bench/gpu_suite.py --dry-run       # on CPU: every step found, every bench parses its arguments

Steps, in order, each under its own time limit and all under ``--budget-s`` (20 minutes):

==============  =====  ==========================================================================
step            limit  what
==============  =====  ==========================================================================
env               30   versions (python, torch, CUDA, Triton, nvcc), ``nvidia-smi``, missing modules
install          240   ``pip install -e . --no-build-isolation --no-deps`` with the CUDA sources
                       (``AREAL_FAST_CUDA=ON``, sm_90a), then checks that ``_C`` has CUDA
gpu_tests        300   ``pytest -m gpu`` over ``tests/`` (every test marked ``gpu``), 120 s per test
ppo_loss         240   loss 16k/32k x 151,936 bf16 fwd+bwd vs copy, eager, compiled, Liger;
                       fused linear at H = 3584 vs the bare GEMMs
packing           90   pack / unpack / gather / scatter vs a same-size copy, H = 3584
reshard          150   interval copy of the whole Qwen2.5-7B layout vs copy, SGLang TP shard build,
                       NCCL between two processes on one GPU (or why not: then the colocated path)
trainer          150   PPO trainer step, Qwen2-0.5B shape, fused vs unfused: tokens/s, MFU
==============  =====  ==========================================================================

A step that fails or runs out of time is recorded (exit status, the tail of its output) and the
suite goes on. Benchmarks write their rows into a scratch directory; the suite gathers them, with
the provenance (device, versions, commit, date), into ONE file, by default
``bench/results/gpu_suite-<device>-<date>.json``. Exit status: 0 when every step passed.

No network is assumed: the image must hold torch, Triton, nvcc, CMake, scikit-build-core,
pybind11, pytest (+ pytest-timeout), transformers, aiohttp, safetensors and PyYAML (the ``env``
step lists what is missing). Anything else, e.g. ``liger-kernel`` for the Liger baseline, is
installed first from local wheels with ``--wheelhouse DIR`` (``pip install --no-index --no-deps``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance  # noqa: E402

BUDGET_S = 1200
TAIL_CHARS = 4000
# modules the install and the tests need besides torch / triton (the image's)
REQUIRED = ("numpy", "pybind11", "scikit_build_core", "transformers", "aiohttp", "pytest", "safetensors", "yaml")


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    argv: tuple[str, ...]
    """Command, run from the repository root; ``{py}`` is the interpreter, ``{results}`` the scratch dir."""
    dry_argv: tuple[str, ...] | None = None
    """What --dry-run runs instead (None: only check that the files it names exist)."""
    needs: tuple[str, ...] = ()
    """Repository files the step needs."""
    env: dict = field(default_factory=dict)


def _bench(name: str, limit: int, script: str, *args: str) -> Step:
    argv = ("{py}", f"bench/{script}", *args, "--results", "{results}")
    return Step(name, limit, argv, dry_argv=(*argv, "--dry-run"), needs=(f"bench/{script}",))


ENV_PY = ("import importlib.util, json, platform, torch; "
          f"mods = {{m: importlib.util.find_spec(m) is not None for m in {REQUIRED!r}}}; "
          "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
          "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None, "
          "'missing': [m for m, ok in mods.items() if not ok]}))")
CHECK_C = ("from areal_fast import backend; import torch; n = backend.native(); "
           "assert n.has_cuda(), '_C was built without CUDA'; print('areal_fast._C with CUDA; device', "
           "torch.cuda.get_device_name())")

STEPS: tuple[Step, ...] = (
    Step("env", 30, ("bash", "-c", "{py} -c " + shlex.quote(ENV_PY) + "; nvcc --version | tail -2; "
                     "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv"),
         dry_argv=("{py}", "-c", ENV_PY)),
    Step("install", 240, ("bash", "-c", "set -o pipefail; export CUDACXX=${CUDACXX:-$(command -v nvcc || "
                          "echo /usr/local/cuda/bin/nvcc)}; {py} -m pip install -e . --no-build-isolation --no-deps -v "
                          "2>&1 | tail -40 && {py} -c " + shlex.quote(CHECK_C)),
         dry_argv=("{py}", "-m", "pip", "--version"), needs=("pyproject.toml", "CMakeLists.txt"),
         env={"AREAL_FAST_CUDA": "ON", "CMAKE_ARGS": "-DCMAKE_CUDA_ARCHITECTURES=90a",
              "CMAKE_BUILD_PARALLEL_LEVEL": "16"}),
    Step("gpu_tests", 300, ("{py}", "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider",
                            "--timeout", "120", "--junitxml", "{results}/gpu_tests.xml"),
         dry_argv=("{py}", "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider",
                   "{gpu_test_files}"),
         needs=("tests/conftest.py",)),
    _bench("ppo_loss", 240, "bench_ppo_loss.py", "--production"),
    _bench("packing", 90, "bench_packing_kernels.py", "--batch", "64", "--max-len", "8192", "--hidden", "3584",
           "--reps", "30"),
    _bench("reshard", 150, "bench_reshard.py", "--parts", "plan,cuda_copy,gpu_sync", "--layers", "28"),
    _bench("trainer", 150, "bench_trainer.py", "--shape", "qwen2-0.5b", "--tokens", "16384", "--mb-tokens", "8192",
           "--steps", "3"),
)


# For machines that limit one command to 10 minutes: three parts, each repeating the install
# (incremental, seconds, when the build directory is still there) and within 590 s of limits.
PARTS = {"a": ("env", "install", "gpu_tests"), "b": ("install", "ppo_loss", "packing"),
         "c": ("install", "reshard", "trainer")}
PART_BUDGET_S = 590


def gpu_test_files() -> list[str]:
    """Test files with a ``gpu`` mark (what ``pytest -m gpu`` will select from)."""
    out = []
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        text = p.read_text(errors="replace")
        if "mark.gpu" in text:
            out.append(str(p.relative_to(ROOT)))
    return out


def _expand(argv, results: str) -> list[str]:
    out = []
    for a in argv:
        if a == "{gpu_test_files}":
            out.extend(gpu_test_files())
        else:
            out.append(a.replace("{py}", sys.executable).replace("{results}", results))
    return out


def run_step(step: Step, results: str, limit_s: float, dry: bool) -> dict:
    rec = {"step": step.name, "limit_s": round(limit_s, 1)}
    missing = [f for f in step.needs if not (ROOT / f).exists()]
    if missing:
        return rec | {"status": "failed", "error": f"missing {missing}"}
    argv = step.dry_argv if dry else step.argv
    if argv is None:
        return rec | {"status": "ok", "note": "files present"}
    cmd = _expand(argv, results)
    rec["cmd"] = shlex.join(cmd)
    if limit_s <= 0:
        return rec | {"status": "skipped", "error": "suite budget spent"}
    env = os.environ | step.env | {"PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        rc, out, timed_out = p.returncode, (p.stdout or "") + (p.stderr or ""), False
    except subprocess.TimeoutExpired as e:
        def _s(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        rc, out, timed_out = None, _s(e.stdout) + _s(e.stderr), True
    rec.update(seconds=round(time.perf_counter() - t0, 1), rc=rc, timed_out=timed_out, output_tail=out[-TAIL_CHARS:])
    rec["status"] = "ok" if rc == 0 else "timeout" if timed_out else "failed"
    return rec


def collect_rows(results: str) -> dict[str, list[dict]]:
    rows = {}
    for p in sorted(Path(results).glob("*.jsonl")):
        rows[p.stem] = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        for r in rows[p.stem]:
            r.pop("provenance", None)  # the suite's file carries it once
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="check every step on CPU; run no GPU work")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    which.add_argument("--part", choices=sorted(PARTS), default=None,
                       help=f"one of the parts for a 10-minute command limit: {PARTS}")
    ap.add_argument("--out", default=None, help="result file (default bench/results/gpu_suite-<device>-<date>.json)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="time for the whole suite (default 1200 s)")
    ap.add_argument("--wheelhouse", default=None, help="install missing requirements from these local wheels first")
    args = ap.parse_args(argv)
    names = [s.name for s in STEPS]
    if args.part is not None:
        only = list(PARTS[args.part])
        args.budget_s = min(args.budget_s, PART_BUDGET_S)
    else:
        only = names if args.only is None else [x for x in args.only.split(",") if x]
    bad = [x for x in only if x not in names]
    if bad:
        ap.error(f"--only: unknown steps {bad}; steps are {names}")
    if args.wheelhouse and not args.dry_run:
        wh = Path(args.wheelhouse)
        if not wh.is_dir():
            ap.error(f"--wheelhouse {wh}: not a directory")
        wheels = sorted(str(p) for p in wh.glob("*.whl"))
        if not wheels:
            ap.error(f"--wheelhouse {wh}: no .whl files")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *wheels], cwd=ROOT,
                       check=False)
    start = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as results:
        for step in STEPS:
            if step.name not in only:
                continue
            left = args.budget_s - (time.perf_counter() - start)
            limit = min(step.limit_s, left) if not args.dry_run else min(step.limit_s, 180)
            print(f"[gpu_suite] {step.name} (limit {limit:.0f} s) ...", flush=True)
            rec = run_step(step, results, limit, args.dry_run)
            print(f"[gpu_suite] {step.name}: {rec['status']} ({rec.get('seconds', 0)} s)", flush=True)
            if rec["status"] != "ok":
                print(rec.get("output_tail", rec.get("error", ""))[-1500:], flush=True)
            records.append(rec)
        rows = collect_rows(results)
    prov = provenance()
    res = {"suite": "gpu_suite", "dry_run": args.dry_run, "part": args.part, "provenance": prov,
           "seconds": round(time.perf_counter() - start, 1), "budget_s": args.budget_s,
           "passed": all(r["status"] == "ok" for r in records), "steps": records, "rows": rows}
    if args.out:
        out = Path(args.out)
    else:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d_%H%M")
        device = prov.get("device", "cpu").replace(" ", "_").replace("/", "_")
        tag = ("-dry" if args.dry_run else "") + (f"-part{args.part}" if args.part else "")
        out = ROOT / "bench" / "results" / f"gpu_suite{tag}-{device}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"[gpu_suite] {'passed' if res['passed'] else 'FAILED'}: "
          f"{sum(r['status'] == 'ok' for r in records)}/{len(records)} steps in {res['seconds']} s; wrote {out}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
