"""One command for a fresh GPU machine: install, run every GPU test and GPU benchmark, one result file.

    python bench/gpu_suite.py --part a|b|c --commit SHA   # a third of it, each under 9 minutes (PARTS)
    python bench/gpu_suite.py [--out FILE] [--only STEP,...] [--wheelhouse DIR] [--budget-s 1200]
    python bench/gpu_suite.py --dry-run                   # on CPU: every step found, GPU tests collected

Steps, in order, each under its own time limit and all under ``--budget-s`` (20 minutes; a part
520 s):

==============  =====  ==========================================================================
step            limit  what
==============  =====  ==========================================================================
env               20   versions (python, torch, CUDA, Triton, nvcc), ``nvidia-smi``, missing modules
install          210   ``pip install -e . --no-build-isolation --no-deps`` with the CUDA sources
                       (``AREAL_FAST_CUDA=ON``, sm_90a), then checks that ``_C`` has CUDA; skipped
                       when the installed build is from the same build inputs (:func:`reusable_build`)
gpu_tests        290   ``pytest -m gpu tests`` (every test marked ``gpu``), 120 s per test
ppo_loss         230   loss 16k/32k x 151,936 bf16 fwd+bwd vs copy, eager, compiled, Liger;
                       fused linear at H = 3584 vs the bare GEMMs
packing           80   pack / unpack / gather / scatter vs a same-size copy, H = 3584
reshard          150   interval copy of the whole Qwen2.5-7B layout vs copy, SGLang TP shard build,
                       NCCL between two processes on one GPU (or why not: then the colocated path)
trainer          150   PPO trainer step, Qwen2-0.5B shape, fused vs unfused: tokens/s, MFU
==============  =====  ==========================================================================

Made for a machine that kills a command after 10 minutes and gives back only ``$OUT``:

* ``--part a|b|c`` runs a third of the steps (each part starts with ``install``, which on a warm
  machine reuses the build of the part before) within :data:`PART_BUDGET_S`.
* The result file goes to ``--out``, by default ``$OUT/gpu_suite[-part<X>]-<device>-<date>.json``
  when ``$OUT`` is set (else under ``bench/results/``). It is rewritten (atomically) before and
  after every step, so a killed run keeps every finished step and names the one it was in.
  Benchmark rows and each step's full output go to ``<out>.rows/`` beside it as they are written.
* A step runs in its own process group; when it runs out of time (or leaves processes behind,
  e.g. NCCL workers) the whole group is killed.
* The commit is taken from ``git``, else ``--commit`` / ``AREAL_FAST_COMMIT``, else from the
  installed build (``areal_fast/_build_info.py``, written by CMake at build time).

A step that fails or runs out of time is recorded (exit status, the tail of its output) and the
suite goes on. Exit status: 0 when every step passed.

The dry run collects the GPU tests exactly as the real step selects them (``-m gpu tests``) in an
interpreter where the optional packages the GPU image lacks (orjson, SGLang, flash-attn, ...) cannot
be imported (``bench/without_optional/sitecustomize.py``), and checks that every test file with a
``gpu`` mark is collected without a collection error.

No network is assumed: the image must hold torch, Triton, nvcc, CMake, scikit-build-core,
pybind11, pytest, transformers, aiohttp, safetensors and PyYAML (the ``env`` step lists what is
missing). Anything else, e.g. ``liger-kernel`` for the Liger baseline, is installed first from
local wheels with ``--wheelhouse DIR`` (``pip install --no-index --no-deps``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance  # noqa: E402

BUDGET_S = 1200
TAIL_CHARS = 4000
# modules the install and the tests need besides torch / triton (the image's)
REQUIRED = ("numpy", "pybind11", "scikit_build_core", "transformers", "aiohttp", "pytest", "pytest_timeout",
            "safetensors", "yaml", "hypothesis")
# The dry run's interpreter: this folder's sitecustomize.py hides the optional packages.
WITHOUT_OPTIONAL = ROOT / "bench" / "without_optional"
# What pytest selects on the GPU machine, in the real step and in the dry run alike.
GPU_TEST_ARGS = ("-m", "gpu", "tests", "-p", "no:cacheprovider")
# Where a finished install records its build inputs (kept between commands on a warm machine).
INSTALL_STAMP = ROOT / "build" / "gpu_suite_install.json"
INSTALL_ENV = {"AREAL_FAST_CUDA": "ON", "CMAKE_ARGS": "-DCMAKE_CUDA_ARCHITECTURES=90a",
               "CMAKE_BUILD_PARALLEL_LEVEL": "16"}


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    argv: tuple[str, ...]
    """Command, run from the repository root; ``{py}`` is the interpreter, ``{results}`` the rows dir."""
    dry_argv: tuple[str, ...] | None = None
    """What --dry-run runs instead (None: only check that the files it names exist)."""
    needs: tuple[str, ...] = ()
    """Repository files the step needs."""
    env: dict = field(default_factory=dict)
    """Environment added to the step's (the real run and the dry run)."""
    dry_check: Callable[[str], str | None] | None = None
    """Checks the dry run's output; returns what is wrong, or None."""
    reuse: Callable[[], tuple[bool, str]] | None = None
    """``(True, why)`` when the step's work is already done (the real run then skips it)."""
    done: Callable[[], None] | None = None
    """Called after the real step passed (e.g. to record what was built)."""


def _bench(name: str, limit: int, script: str, *args: str) -> Step:
    argv = ("{py}", f"bench/{script}", *args, "--results", "{results}")
    return Step(name, limit, argv, dry_argv=(*argv, "--dry-run"), needs=(f"bench/{script}",))


# ----------------------------------------------------------------------------- the GPU tests


def gpu_test_files() -> list[str]:
    """Test files with a ``gpu`` mark (what ``pytest -m gpu`` will select from), in every folder of tests/."""
    out = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        text = p.read_text(errors="replace")
        if "mark.gpu" in text:
            out.append(str(p.relative_to(ROOT)))
    return out


_COLLECTED = re.compile(r"^(\d+)(?:/\d+)? tests? collected(.*)$", re.M)


def collected_gpu_tests(output: str) -> list[str]:
    """The node ids listed by ``pytest --collect-only -q``."""
    return [ln.strip() for ln in output.splitlines() if re.match(r"^tests/\S+\.py::", ln.strip())]


def check_gpu_collection(output: str) -> str | None:
    """What is wrong with a ``pytest --collect-only -q -m gpu tests`` output, or None: a collection
    error, no GPU test, or a file with a ``gpu`` mark of which no test was collected."""
    if re.search(r"\berrors?\b", output.splitlines()[-1] if output.strip() else "") or "ERROR tests/" in output:
        bad = sorted(set(re.findall(r"^ERROR (tests/\S+)", output, re.M)))
        return f"collection errors in {bad or 'the test modules'}"
    ids = collected_gpu_tests(output)
    m = _COLLECTED.search(output)
    if not ids or m is None or int(m.group(1)) != len(ids):
        return f"no GPU test collected (or the count is unreadable): {output[-300:]!r}"
    missing = sorted(set(gpu_test_files()) - {i.split("::")[0] for i in ids})
    if missing:
        return f"no test collected from {missing}, which carry a gpu mark"
    return None


def _timeout_args() -> list[str]:
    # without pytest-timeout a `--timeout` option would end the step before any test ran
    return ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []


# ----------------------------------------------------------------------------- the install


def build_inputs_hash(env: dict | None = None) -> str:
    """What the installed ``_C`` depends on: the native sources, the build files, the package's file
    names (an editable install maps them), the build settings, this checkout's path and the interpreter."""
    h = hashlib.sha256()
    for p in sorted([ROOT / "CMakeLists.txt", ROOT / "pyproject.toml", *(ROOT / "csrc").rglob("*")]):
        if p.is_file():
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    for pkg in ("areal_fast", "kernels"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            h.update(str(p.relative_to(ROOT)).encode() + b"\0")
    settings = {k: (env or INSTALL_ENV).get(k) for k in sorted(INSTALL_ENV)}
    h.update(json.dumps([settings, str(ROOT), sys.executable]).encode())
    return h.hexdigest()[:16]


CHECK_C = ("import pathlib, sys, torch; import areal_fast; from areal_fast import backend; n = backend.native(); "
           "assert n.has_cuda(), '_C was built without CUDA'; "
           "root = pathlib.Path(sys.argv[1]).resolve(); here = pathlib.Path(areal_fast.__file__).resolve(); "
           "assert root in here.parents, f'areal_fast is imported from {here}, not from {root}'; "
           "print('areal_fast._C with CUDA; device', torch.cuda.get_device_name())")


def reusable_build(stamp: Path = INSTALL_STAMP, inputs: str | None = None,
                   check: tuple[str, ...] = ("{py}", "-c", CHECK_C, str(ROOT))) -> tuple[bool, str]:
    """``(True, why)`` when the install can be skipped: the stamp of the last install names the
    same build inputs and the installed package imports from here with a CUDA ``_C`` (``check``)."""
    inputs = build_inputs_hash() if inputs is None else inputs
    try:
        was = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False, f"no install recorded at {stamp}"
    if was.get("inputs") != inputs:
        return False, f"build inputs changed ({was.get('inputs')} -> {inputs})"
    try:
        p = subprocess.run([a.replace("{py}", sys.executable) for a in check], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"the installed build could not be checked: {e}"
    if p.returncode != 0:
        return False, "the installed build fails its check: " + (p.stdout + p.stderr).strip()[-300:]
    return True, f"installed build {inputs} reused ({was.get('date')}): {p.stdout.strip()[-200:]}"


def record_install(stamp: Path = INSTALL_STAMP, inputs: str | None = None) -> None:
    """After a passed install: what it was built from (read by :func:`reusable_build`)."""
    stamp.parent.mkdir(parents=True, exist_ok=True)
    info = {"inputs": build_inputs_hash() if inputs is None else inputs,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    _write_atomic(stamp, json.dumps(info) + "\n")


ENV_PY = ("import importlib.util, json, platform, torch; "
          f"mods = {{m: importlib.util.find_spec(m) is not None for m in {REQUIRED!r}}}; "
          "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
          "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None, "
          "'missing': [m for m, ok in mods.items() if not ok]}))")

STEPS: tuple[Step, ...] = (
    Step("env", 20, ("bash", "-c", "{py} -c " + shlex.quote(ENV_PY) + "; nvcc --version | tail -2; "
                     "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv"),
         dry_argv=("{py}", "-c", ENV_PY)),
    Step("install", 210, ("bash", "-c", "set -o pipefail; export CUDACXX=${CUDACXX:-$(command -v nvcc || "
                          "echo /usr/local/cuda/bin/nvcc)}; {py} -m pip install -e . --no-build-isolation --no-deps -v "
                          "2>&1 | tail -40 && {py} -c " + shlex.quote(CHECK_C) + " " + shlex.quote(str(ROOT))),
         dry_argv=("{py}", "-m", "pip", "--version"), needs=("pyproject.toml", "CMakeLists.txt"),
         env=INSTALL_ENV, reuse=reusable_build, done=record_install),
    Step("gpu_tests", 290, ("{py}", "-m", "pytest", "-q", *GPU_TEST_ARGS, "--continue-on-collection-errors",
                            "{timeout_args}", "--junitxml", "{results}/gpu_tests.xml"),
         dry_argv=("{py}", "-m", "pytest", "-q", "--collect-only", *GPU_TEST_ARGS),
         needs=("tests/conftest.py",), dry_check=check_gpu_collection),
    _bench("ppo_loss", 230, "bench_ppo_loss.py", "--production"),
    _bench("packing", 80, "bench_packing_kernels.py", "--batch", "64", "--max-len", "8192", "--hidden", "3584",
           "--reps", "30"),
    _bench("reshard", 150, "bench_reshard.py", "--parts", "plan,cuda_copy,gpu_sync", "--layers", "28"),
    _bench("trainer", 150, "bench_trainer.py", "--shape", "qwen2-0.5b", "--tokens", "16384", "--mb-tokens", "8192",
           "--steps", "3"),
)


# For machines that limit one command to 10 minutes: three parts, each starting with the install
# (skipped when the build of an earlier part on this machine is reusable) and within PART_BUDGET_S,
# which leaves 20 s of the 9 minutes for the suite's own start (torch import) and its writes.
PARTS = {"a": ("env", "install", "gpu_tests"), "b": ("install", "ppo_loss", "packing"),
         "c": ("install", "reshard", "trainer")}
PART_BUDGET_S = 520
PART_WALL_S = 540  # what a part must finish within, its install included


# ----------------------------------------------------------------------------- running a step


def _expand(argv, results: str) -> list[str]:
    out = []
    for a in argv:
        if a == "{timeout_args}":
            out.extend(_timeout_args())
        else:
            out.append(a.replace("{py}", sys.executable).replace("{results}", results))
    return out


def _kill_group(pgid: int) -> bool:
    """SIGKILL every process of the group; True when there was one left to kill."""
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _step_env(step: Step, dry: bool) -> dict:
    env = os.environ | step.env | {"PYTHONUNBUFFERED": "1"}
    if dry:  # the GPU image's interpreter: no orjson, SGLang, flash-attn...
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WITHOUT_OPTIONAL), env.get("PYTHONPATH")) if p)
    return env


def run_step(step: Step, results: str, limit_s: float, dry: bool) -> dict:
    """Run one step in its own process group (its output in ``<results>/<step>.log``); a step that
    runs past ``limit_s`` is killed with everything it started, and so is anything it leaves behind."""
    rec = {"step": step.name, "limit_s": round(limit_s, 1)}
    missing = [f for f in step.needs if not (ROOT / f).exists()]
    if missing:
        return rec | {"status": "failed", "error": f"missing {missing}"}
    if step.reuse is not None:
        t0 = time.perf_counter()
        reused, why = step.reuse()
        rec["reuse"] = why
        if reused and not dry:
            return rec | {"status": "ok", "reused": True, "seconds": round(time.perf_counter() - t0, 1)}
        limit_s -= time.perf_counter() - t0  # the check's time is the step's
    argv = step.dry_argv if dry else step.argv
    if argv is None:
        return rec | {"status": "ok", "note": "files present"}
    cmd = _expand(argv, results)
    rec["cmd"] = shlex.join(cmd)
    if limit_s <= 0:
        return rec | {"status": "skipped", "error": "suite budget spent"}
    log = Path(results) / f"{step.name}{'-dry' if dry else ''}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        # a file, not a pipe: a child that outlives the step cannot hold the suite up on an open pipe
        p = subprocess.Popen(cmd, cwd=ROOT, env=_step_env(step, dry), stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc, timed_out = p.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            rc, timed_out = p.wait(), True
        leftovers = _kill_group(p.pid)  # NCCL workers, servers... started by the step and still running
    out = log.read_text(errors="replace")
    rec.update(seconds=round(time.perf_counter() - t0, 1), rc=None if timed_out else rc, timed_out=timed_out,
               output_tail=out[-TAIL_CHARS:], log=log.name)
    if leftovers and not timed_out:
        rec["killed_leftovers"] = True
    rec["status"] = "timeout" if timed_out else "ok" if rc == 0 else "failed"
    if rec["status"] == "ok" and dry and step.dry_check is not None:
        wrong = step.dry_check(out)
        if wrong:
            rec.update(status="failed", error=wrong)
    if rec["status"] == "ok" and not dry and step.done is not None:
        step.done()
    return rec


def collect_rows(results: str) -> dict[str, list[dict]]:
    rows = {}
    for p in sorted(Path(results).glob("*.jsonl")):
        rows[p.stem] = []
        for x in p.read_text().splitlines():
            try:
                rows[p.stem].append(json.loads(x))
            except ValueError:  # a line cut short by a killed benchmark
                continue
        for r in rows[p.stem]:
            r.pop("provenance", None)  # the suite's file carries it once
    return rows


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_out(prov: dict, part: str | None, dry: bool, environ=os.environ) -> Path:
    """``$OUT/gpu_suite[-dry][-part<X>]-<device>-<date>.json`` (``bench/results/`` without ``$OUT``)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d_%H%M")
    device = re.sub(r"[^A-Za-z0-9_.-]+", "_", prov.get("device", "cpu"))
    tag = ("-dry" if dry else "") + (f"-part{part}" if part else "")
    folder = Path(environ["OUT"]) if environ.get("OUT") else ROOT / "bench" / "results"
    return folder / f"gpu_suite{tag}-{device}-{stamp}.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="check every step on CPU; run no GPU work")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    which.add_argument("--part", choices=sorted(PARTS), default=None,
                       help=f"one of the parts for a 10-minute command limit: {PARTS}")
    ap.add_argument("--out", default=None,
                    help="result file (default $OUT/gpu_suite[-part<X>]-<device>-<date>.json, or under "
                         "bench/results/ without $OUT)")
    ap.add_argument("--commit", default=None,
                    help="the commit being measured, where there is no .git (sets AREAL_FAST_COMMIT for the "
                         "build and every step)")
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
    if args.commit:
        os.environ["AREAL_FAST_COMMIT"] = args.commit
    start = time.perf_counter()
    if args.wheelhouse and not args.dry_run:
        wh = Path(args.wheelhouse)
        if not wh.is_dir():
            ap.error(f"--wheelhouse {wh}: not a directory")
        wheels = sorted(str(p) for p in wh.glob("*.whl"))
        if not wheels:
            ap.error(f"--wheelhouse {wh}: no .whl files")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *wheels], cwd=ROOT,
                       check=False, timeout=120)
    # without areal_fast's _C: the install step may be about to replace it
    prov = provenance(native=False)
    out = Path(args.out) if args.out else default_out(prov, args.part, args.dry_run)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = out.with_name(out.stem + ".rows")
    results.mkdir(parents=True, exist_ok=True)
    for old in [*results.glob("*.jsonl"), *results.glob("*.log")]:  # an earlier run under the same name
        old.unlink()
    records: list[dict] = []
    res = {"suite": "gpu_suite", "dry_run": args.dry_run, "part": args.part, "provenance": prov,
           "budget_s": args.budget_s, "finished": False, "steps": records, "rows": {}}

    def write(current: dict | None = None) -> None:
        res.update(seconds=round(time.perf_counter() - start, 1), rows=collect_rows(str(results)),
                   steps=records + ([current] if current else []),
                   passed=bool(records) and all(r["status"] == "ok" for r in records) and current is None)
        _write_atomic(out, json.dumps(res, indent=1, default=str) + "\n")

    for step in STEPS:
        if step.name not in only:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        limit = min(step.limit_s, left) if not args.dry_run else 180  # a dry step's time says nothing
        print(f"[gpu_suite] {step.name} (limit {limit:.0f} s) ...", flush=True)
        write({"step": step.name, "status": "running", "limit_s": round(limit, 1),
               "started": _dt.datetime.now(_dt.timezone.utc).strftime("%H:%M:%SZ")})
        rec = run_step(step, str(results), limit, args.dry_run)
        print(f"[gpu_suite] {step.name}: {rec['status']} ({rec.get('seconds', 0)} s)"
              + (f"; {rec['reuse']}" if "reuse" in rec else ""), flush=True)
        if rec["status"] != "ok":
            print(rec.get("error", "") + "\n" + rec.get("output_tail", "")[-1500:], flush=True)
        records.append(rec)
        write()
    res["finished"] = True
    write()
    print(f"[gpu_suite] {'passed' if res['passed'] else 'FAILED'}: "
          f"{sum(r['status'] == 'ok' for r in records)}/{len(records)} steps in {res['seconds']} s; wrote {out}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
