"""The GPU day: one command for a lent GPU machine, the most valuable checks first, under 8 minutes.

    python3 tools/gpu_suite.py --day --commit <sha> --out $OUT/gpu_day.json     # budget 450 s; timeout_s 480
    python3 tools/gpu_suite.py --day --steps reshard --budget-s 120 --out $OUT/gpu_day.json   # a rerun, warm
    python tools/gpu_suite.py --dry-run [--steps ...] [--budget-s 450] [--out FILE] [--deep]   # on CPU

:data:`STEPS` in priority order, each in its own process group under its own deadline (cut to what
is left of :data:`DAY_BUDGET_S`); the JSON summary (``--out``) and ``<out>.log`` rewritten atomically
after every step and every :data:`PROGRESS_S` while one runs (the GPU tests' results test by test).
docs/benchmarks.md ("The GPU day") gives the steps with their estimates and
deadlines, what comes back, and what keeps a short GPU session from being wasted.
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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.* and tools.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import provenance  # noqa: E402
from tools.results_log import read_results_log  # noqa: E402

DAY_BUDGET_S = 450  # the day's command: under 8 minutes with the suite's start and end
DAY_WALL_S = 480  # what the day must finish within (the session calls it with timeout_s about this)
STARTUP_S = 10  # the suite's own start (torch imported for provenance) and its writes
MIN_STEP_S = 5  # a must-run step is skipped only when less than this is left
TAIL_CHARS = 4000  # of each step's output, in the log file and (failed steps) in the JSON
PROGRESS_S = 10  # while a step runs, its key numbers so far go into the JSON this often
# modules the install and the tests need besides torch / triton (the image's)
REQUIRED = ("numpy", "pybind11", "scikit_build_core", "transformers", "aiohttp", "pytest", "pytest_timeout",
            "safetensors", "yaml", "hypothesis")
# The dry run's interpreter: this folder's sitecustomize.py hides the optional packages.
WITHOUT_OPTIONAL = ROOT / "tools" / "without_optional"
# What pytest selects on the GPU machine, in the real step and in the dry run alike; with the plugin
# that writes each test's result as it finishes (tools/results_log.py), read even from a cut step.
GPU_TEST_ARGS = ("-m", "gpu", "tests", "-p", "no:cacheprovider", "-p", "tools.results_log")
RESULTS_LOG = "gpu_tests.results.jsonl"
MAX_FAILED_IDS = 30
# Where a finished install records its build inputs (kept between commands on a warm machine).
INSTALL_STAMP = ROOT / "build" / "gpu_suite_install.json"
INSTALL_ENV = {"AREAL_FAST_CUDA": "ON", "CMAKE_ARGS": "-DCMAKE_CUDA_ARCHITECTURES=90a",
               "CMAKE_BUILD_PARALLEL_LEVEL": "16"}


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: int
    """Expected seconds on the GPU machine: what the budget plans with."""
    deadline_s: int
    """The most the step may take (cut to what is left of the budget): then its process group is killed."""
    argv: tuple[str, ...]
    """Command, run from the repository root; ``{py}`` is the interpreter, ``{results}`` the step's folder."""
    must: bool = False
    """Runs with whatever the budget left; other steps are skipped when less than their estimate is left."""
    after_install: bool = False
    """Needs the package installed: ``--steps`` adds ``install`` in front of it."""
    dry_argv: tuple[str, ...] | None = None
    """The step's CPU check (``--dry-run --deep``; None: only its files and command are checked)."""
    needs: tuple[str, ...] = ()
    """Repository files the step needs."""
    env: dict = field(default_factory=dict)
    """Environment added to the step's (the real run and the CPU check alike)."""
    dry_check: Callable[[str], str | None] | None = None
    """Checks the CPU check's output; returns what is wrong, or None."""
    reuse: Callable[[], tuple[bool, str]] | None = None
    """``(True, why)`` when the step's work is already done (the real run then skips it)."""
    done: Callable[[], None] | None = None
    """Called after the real step passed (e.g. to record what was built)."""
    key: Callable[[str, str], dict] | None = None
    """``key(output, results_dir)``: the step's key numbers for the summary."""


def rows_key(output: str, results: str) -> dict:
    """A benchmark's key numbers: the rows it wrote (a step cut at its deadline keeps those it finished)."""
    return {"rows": collect_rows(results)}


def _bench(name: str, estimate: int, deadline: int, script: str, *args: str, must: bool = False) -> Step:
    argv = ("{py}", f"bench/{script}", *args, "--results", "{results}")
    return Step(name, estimate, deadline, argv, must=must, after_install=True, dry_argv=(*argv, "--dry-run"),
                needs=(f"bench/{script}",), key=rows_key)


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


_PYTEST_SUMMARY = re.compile(r"\b\d+ (?:passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s")


def tests_key(output: str, results: str) -> dict:
    """The GPU tests' results: each finished test's ``[id, outcome, seconds]``, the counts, the
    failed ids with their errors and the test a cut was in (from the results log, written test by
    test, so a step cut at its deadline still has them); where there is no results log (a pytest run
    without the plugin), the counts and failed ids of its JUnit file; pytest's summary line."""
    key: dict = {}
    lines = [ln for ln in output.splitlines() if _PYTEST_SUMMARY.search(ln)]
    if lines:
        key["summary"] = lines[-1].strip("= ")
    log = read_results_log(Path(results) / RESULTS_LOG)
    if log is not None:
        bad = log["failed_ids"][:MAX_FAILED_IDS]
        key.update(tests=len(log["tests"]), failures=log["failed"], errors=log["error"], skipped=log["skipped"],
                   passed=log["passed"], failed_ids=bad, errors_by_id={i: log["errors"][i] for i in bad
                                                                      if i in log["errors"]},
                   session_finished=log["finished"], per_test=log["tests"])
        if log["running"]:
            key["running_when_cut"] = log["running"]
        if log["collect_errors"]:
            key["collect_errors"] = log["collect_errors"]
    xml = Path(results) / "gpu_tests.xml"
    if log is not None or not xml.exists():
        return key
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as e:  # cut short by the deadline
        return key | {"junit": f"unreadable: {e}"}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for k in ("tests", "failures", "errors", "skipped"):
        key[k] = sum(int(s.get(k, 0)) for s in suites)
    key["passed"] = key["tests"] - key["failures"] - key["errors"] - key["skipped"]
    bad = []
    for tc in root.iter("testcase"):
        if tc.find("failure") is not None or tc.find("error") is not None:
            mod = tc.get("classname", "").replace(".", "/")
            bad.append(f"{mod}.py::{tc.get('name')}")
    key["failed_ids"] = bad[:MAX_FAILED_IDS]
    return key


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


CHECK_C = ("import pathlib, sys, torch; import areal_fast; from areal_fast import dispatch; n = dispatch.native(); "
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


def install_key(output: str, results: str) -> dict:
    lines = [ln for ln in output.splitlines() if ln.startswith("areal_fast._C with CUDA")]
    return {"check": lines[-1]} if lines else {}


# ----------------------------------------------------------------------------- the environment

ENV_PY = ("import importlib.util, json, platform, torch; "
          f"mods = {{m: importlib.util.find_spec(m) is not None for m in {REQUIRED!r}}}; "
          "c = torch.cuda.is_available(); pr = torch.cuda.get_device_properties(0) if c else None; "
          "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
          "'cuda': torch.version.cuda, "
          "'triton': importlib.util.find_spec('triton') and __import__('triton').__version__, "
          "'gpu': pr and pr.name, 'capability': pr and f'sm_{pr.major}{pr.minor}', "
          "'sms': pr and pr.multi_processor_count, 'gpu_mem_gib': pr and round(pr.total_memory / 2**30, 1), "
          "'missing': [m for m, ok in mods.items() if not ok]}))")


def env_key(output: str, results: str) -> dict:
    """The env step's facts: the JSON line of :data:`ENV_PY`, nvcc's release, nvidia-smi's row."""
    key: dict = {}
    lines = output.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("{"):
            try:
                key.update(json.loads(ln))
            except ValueError:
                pass
        elif m := re.search(r"release ([\d.]+)", ln):
            key["nvcc"] = m.group(1)
        elif ln.startswith("name, memory.total") and i + 1 < len(lines):
            key["nvidia_smi"] = lines[i + 1].strip()
    return key


# ----------------------------------------------------------------------------- the plan

STEPS: tuple[Step, ...] = (
    Step("env", 10, 30, ("bash", "-c", "{py} -c " + shlex.quote(ENV_PY) + "; nvcc --version | tail -2; "
                         "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv"),
         must=True, dry_argv=("{py}", "-c", ENV_PY), key=env_key),
    Step("install", 120, 240, ("bash", "-c", "set -o pipefail; export CUDACXX=${CUDACXX:-$(command -v nvcc || "
                               "echo /usr/local/cuda/bin/nvcc)}; {py} -m pip install -e . --no-build-isolation "
                               "--no-deps -v 2>&1 | tail -40 && {py} -c " + shlex.quote(CHECK_C) + " "
                               + shlex.quote(str(ROOT))),
         must=True, dry_argv=("{py}", "-m", "pip", "--version"), needs=("pyproject.toml", "CMakeLists.txt"),
         env=INSTALL_ENV, reuse=reusable_build, done=record_install, key=install_key),
    Step("gpu_tests", 120, 200, ("{py}", "-m", "pytest", "-q", *GPU_TEST_ARGS, "--continue-on-collection-errors",
                                 "{timeout_args}", "--junitxml", "{results}/gpu_tests.xml",
                                 "--results-log", "{results}/" + RESULTS_LOG),
         must=True, after_install=True, dry_argv=("{py}", "-m", "pytest", "-q", "--collect-only", *GPU_TEST_ARGS),
         needs=("tests/conftest.py",), dry_check=check_gpu_collection, key=tests_key),
    _bench("loss", 90, 150, "bench_ppo_loss.py", "--production", "--skip-compile", "--skip-liger", must=True),
    _bench("trainer", 60, 120, "bench_trainer.py", "--shape", "qwen2-0.5b", "--tokens", "16384", "--mb-tokens",
           "8192", "--steps", "1", must=True),
    _bench("sync_pieces", 20, 60, "bench_sync_senders.py", "--parts", "gpu"),
    _bench("packing", 40, 80, "bench_packing_kernels.py", "--batch", "64", "--max-len", "8192", "--hidden", "3584",
           "--reps", "30"),
    _bench("reshard", 90, 150, "bench_reshard.py", "--parts", "plan,cuda_copy,gpu_sync", "--layers", "28"),
    _bench("loss_baselines", 150, 230, "bench_ppo_loss.py", "--production", "--skip-fused"),
)


def select_steps(names: list[str] | None, steps: tuple[Step, ...] | None = None) -> list[Step]:
    """The steps to run, in plan order: all, or the named ones (with ``install`` in front when one
    of them needs the package). Raises ValueError on an unknown name."""
    steps = STEPS if steps is None else steps
    if names is None:
        return list(steps)
    known = [s.name for s in steps]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown steps {bad}; steps are {known}")
    want = set(names)
    if "install" in known and any(s.after_install for s in steps if s.name in want):
        want.add("install")
    return [s for s in steps if s.name in want]


def plan(steps: list[Step], budget_s: float, all_must: bool = False) -> dict:
    """The budget arithmetic: each step's estimate, deadline and the estimated time at its end; the
    must-run total (with the suite's start) and whether it fits; the steps expected to be skipped.
    ``all_must``: every step counts as must-run (steps named by ``--steps``)."""
    rows, at, must = [], float(STARTUP_S), float(STARTUP_S)
    for s in steps:
        is_must = s.must or all_must
        runs = is_must or budget_s - at >= s.estimate_s
        if runs:
            at += s.estimate_s
        if is_must:
            must += s.estimate_s
        rows.append({"step": s.name, "estimate_s": s.estimate_s, "deadline_s": s.deadline_s, "must": is_must,
                     "expected": "run" if runs else "skipped: budget", "ends_at_s": round(at) if runs else None})
    return {"budget_s": budget_s, "startup_s": STARTUP_S, "steps": rows, "must_estimate_s": round(must),
            "must_deadline_s": STARTUP_S + sum(s.deadline_s for s in steps if s.must or all_must),
            "all_estimate_s": STARTUP_S + sum(s.estimate_s for s in steps), "fits": must <= budget_s}


def format_plan(p: dict) -> str:
    out = [f"{'step':<16}{'estimate':>9}{'deadline':>9}  must  expected (ends at, estimated)"]
    for r in p["steps"]:
        exp = f"run (~{r['ends_at_s']} s)" if r["ends_at_s"] is not None else r["expected"]
        out.append(f"{r['step']:<16}{r['estimate_s']:>9}{r['deadline_s']:>9}  {'yes' if r['must'] else 'no':<4}  {exp}")
    out.append(f"must-run: {p['must_estimate_s']} s estimated ({p['startup_s']} s of start included; at most "
               f"{p['must_deadline_s']} s by their deadlines, cut by the budget) of a {p['budget_s']:g} s budget: "
               + ("fits" if p["fits"] else "DOES NOT FIT"))
    out.append(f"all steps: {p['all_estimate_s']} s estimated")
    return "\n".join(out)


def check_step(step: Step) -> list[str]:
    """What a step's command needs that is not here: repository files, the program, the script or
    module it runs (``nvcc``, ``nvidia-smi`` inside a shell line are the GPU image's and not checked)."""
    missing = [f"file {f}" for f in step.needs if not (ROOT / f).exists()]
    argv = [a.replace("{py}", sys.executable) for a in step.argv]
    if not argv:
        return missing + ["an empty command"]
    if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        missing.append(f"program {argv[0]}")
    elif argv[0] == sys.executable and len(argv) > 2 and argv[1] == "-m":
        if importlib.util.find_spec(argv[2]) is None:
            missing.append(f"module {argv[2]}")
    elif argv[0] == sys.executable and len(argv) > 1 and argv[1].endswith(".py"):
        if not (ROOT / argv[1]).is_file():
            missing.append(f"script {argv[1]}")
    return missing


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


try:  # resolved before any fork: the child only calls it
    import ctypes

    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (ImportError, OSError, AttributeError):
    _PRCTL = None


def _die_with_suite() -> None:
    """In the step's first process, before it runs: SIGKILL when the suite dies (PR_SET_PDEATHSIG),
    since the step's own session would outlive a suite killed from outside."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))


def run_step(step: Step, results: str, limit_s: float, dry: bool,
             progress: Callable[[dict], None] | None = None) -> dict:
    """Run one step in its own process group (its output in ``<results>/<step>.log``); a step that
    runs past ``limit_s`` is killed with everything it started, and so is anything it leaves behind.
    ``progress(key)`` gets the step's key numbers so far every :data:`PROGRESS_S` while it runs."""
    rec = {"step": step.name, "deadline_s": round(limit_s, 1)}
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
        return rec | {"status": "skipped", "reason": "budget: none left"}
    log = Path(results) / f"{step.name}{'-dry' if dry else ''}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        # a file, not a pipe: a child that outlives the step cannot hold the suite up on an open pipe
        p = subprocess.Popen(cmd, cwd=ROOT, env=_step_env(step, dry), stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_suite)
        try:
            rc, timed_out = _wait(p, t0 + limit_s, None if dry else _progress(step, log, results, progress))
        except BaseException:  # the suite interrupted (SIGTERM, Ctrl-C): the step goes with it
            _kill_group(p.pid)
            p.wait()
            raise
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
    if not dry and step.key is not None:
        rec["key"] = _key_of(step, out, results)
    if rec["status"] == "ok" and not dry and step.done is not None:
        step.done()
    return rec


def _wait(p: subprocess.Popen, end: float, tick: Callable[[], None] | None) -> tuple[int, bool]:
    """``(returncode, timed_out)``: waits for the step until ``end`` (``perf_counter``), calling
    ``tick`` every PROGRESS_S meanwhile; past ``end`` its process group is killed."""
    while True:
        left = end - time.perf_counter()
        try:
            return p.wait(timeout=max(0.0, min(left, PROGRESS_S) if tick is not None else left)), False
        except subprocess.TimeoutExpired:
            if tick is None or time.perf_counter() >= end:
                _kill_group(p.pid)
                return p.wait(), True
            tick()


def _progress(step: Step, log: Path, results: str, progress) -> Callable[[], None] | None:
    if progress is None or step.key is None:
        return None

    def tick() -> None:
        try:
            out = log.read_text(errors="replace")
        except OSError as e:
            progress({"error": f"{type(e).__name__}: {e}"})
            return
        progress(_key_of(step, out, results))
    return tick


def _key_of(step: Step, out: str, results: str) -> dict:
    """``step.key(out, results)``, or the error: a half-written file or a parser's slip must not cost
    the step or the day."""
    try:
        return step.key(out, results)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


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
            r.pop("provenance", None)  # the summary carries it once
    return rows


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_out(prov: dict, dry: bool, environ=os.environ) -> Path:
    """``$OUT/gpu_day.json`` (``gpu_day-dry.json`` for a dry run); without ``$OUT``
    ``bench/results/gpu_day[-dry]-<device>-<date>.json``."""
    tag = "-dry" if dry else ""
    if environ.get("OUT"):
        return Path(environ["OUT"]) / f"gpu_day{tag}.json"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d_%H%M")
    device = re.sub(r"[^A-Za-z0-9_.-]+", "_", prov.get("device", "cpu"))
    return ROOT / "bench" / "results" / f"gpu_day{tag}-{device}-{stamp}.json"


class Report:
    """The two files that come back: the JSON summary and the log of step tails, rewritten
    atomically before and after every step."""

    def __init__(self, out: Path, res: dict, steps: list[Step], start: float, log: bool = True):
        self.out, self.res, self.start = out, res, start
        self.log = out.with_suffix(".log") if log else None
        self.records = {s.name: {"step": s.name, "status": "planned", "estimate_s": s.estimate_s,
                                 "deadline_s": s.deadline_s, "must": s.must} for s in steps}
        self.tails: dict[str, str] = {}

    def set(self, rec: dict, tail: str | None = None) -> None:
        self.records[rec["step"]] = rec
        if tail is not None:
            self.tails[rec["step"]] = tail

    def write(self) -> None:
        recs = list(self.records.values())
        ran = [r for r in recs if r["status"] not in ("planned", "skipped")]
        self.res.update(seconds=round(time.perf_counter() - self.start, 1), steps=recs,
                        passed=self.res.get("finished", False) and all(r["status"] == "ok" for r in ran)
                        and not any(r["status"] == "skipped" and r["must"] for r in recs))
        _write_atomic(self.out, json.dumps(self.res, indent=1, default=str) + "\n")
        if self.log is not None:
            parts = [f"# gpu_day {self.res.get('mode')}: commit {self.res['provenance'].get('commit')}, "
                     f"{self.res['provenance'].get('device')}, {self.res['seconds']} s of {self.res['budget_s']:g}"]
            for r in recs:
                if r["step"] in self.tails or r["status"] not in ("planned",):
                    head = f"== {r['step']}: {r['status']}, {r.get('seconds', 0)} s (deadline {r.get('deadline_s')} s)"
                    parts.append("\n".join(x for x in (head, "$ " + r["cmd"] if r.get("cmd") else "",
                                                       r.get("reuse", ""), r.get("reason", ""),
                                                       self.tails.get(r["step"], "")) if x))
            _write_atomic(self.log, "\n\n".join(parts) + "\n")


def _summarise(rec: dict, must: bool, estimate: int) -> tuple[dict, str]:
    """The JSON's record of a finished step (the output tail only when it did not pass) and its log tail."""
    tail = rec.pop("output_tail", "")
    rec.pop("log", None)
    if rec["status"] != "ok" and tail:
        rec["error_tail"] = tail[-2000:]
    return {"must": must, "estimate_s": estimate} | rec, tail


class _Interrupted(BaseException):
    pass


def _on_term(signum, frame):
    raise _Interrupted(signal.Signals(signum).name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--day", action="store_true", help="run the plan on the GPU machine")
    mode.add_argument("--dry-run", action="store_true", help="walk the plan on CPU: estimates, deadlines, the fit")
    ap.add_argument("--steps", default=None, help=f"comma-separated steps, in plan order (default all: "
                                                  f"{','.join(s.name for s in STEPS)})")
    ap.add_argument("--out", default=None, help="the JSON summary (default $OUT/gpu_day.json); the log goes "
                                                "beside it as <out>.log")
    ap.add_argument("--no-log", action="store_true", help="write only the JSON")
    ap.add_argument("--commit", default=None,
                    help="the commit being measured, where there is no .git (sets AREAL_FAST_COMMIT for the "
                         "build and every step)")
    ap.add_argument("--budget-s", type=float, default=DAY_BUDGET_S,
                    help=f"time for the whole command (default {DAY_BUDGET_S} s)")
    ap.add_argument("--work-dir", default=None, help="full logs, rows, JUnit file (default: a temporary folder, "
                                                     "removed at the end); never under --out's folder")
    ap.add_argument("--deep", action="store_true", help="with --dry-run: also run each step's CPU check")
    ap.add_argument("--wheelhouse", default=None, help="install missing requirements from these local wheels first")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        steps = select_steps(None if args.steps is None else [x for x in args.steps.split(",") if x])
    except ValueError as e:
        ap.error(f"--steps: {e}")
    if args.commit:
        os.environ["AREAL_FAST_COMMIT"] = args.commit
    if args.wheelhouse and args.day:
        wh = Path(args.wheelhouse)
        wheels = sorted(str(p) for p in wh.glob("*.whl")) if wh.is_dir() else []
        if not wheels:
            ap.error(f"--wheelhouse {wh}: no .whl files")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *wheels], cwd=ROOT,
                       check=False, timeout=120)
    # without areal_fast's _C: the install step may be about to replace it
    prov = provenance(native=False)
    out = Path(args.out) if args.out else default_out(prov, args.dry_run)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_day-"))
    if out.parent.resolve() in (work.resolve(), *work.resolve().parents):
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        ap.error(f"the work folder {work} is under {out.parent}: only the JSON and its log may be written "
                 "there (name another with --work-dir)")
    the_plan = plan(steps, args.budget_s, all_must=args.steps is not None)
    res = {"suite": "gpu_day", "mode": "dry-run" if args.dry_run else "day", "provenance": prov,
           "budget_s": args.budget_s, "plan": the_plan, "finished": False, "steps": []}
    report = Report(out, res, steps, start, log=not args.no_log)
    print(format_plan(the_plan), flush=True)
    try:
        if args.dry_run:
            return _dry_run(args, steps, report, work, the_plan)
        return _day(args, steps, report, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _dry_run(args, steps: list[Step], report: Report, work: Path, the_plan: dict) -> int:
    bad = 0
    for step in steps:
        rec = {"step": step.name, "status": "planned", "estimate_s": step.estimate_s, "deadline_s": step.deadline_s,
               "must": step.must, "cmd": shlex.join(_expand(step.argv, str(work / step.name)))}
        missing = check_step(step)
        tail = None
        if missing:
            rec.update(status="failed", error=f"missing {missing}")
        elif args.deep:
            r = run_step(step, str(work / step.name), 180, dry=True)
            rec["check"] = r.get("cmd", r.get("note"))
            tail = r.get("output_tail", "")
            if r["status"] != "ok":
                rec.update(status="failed", error=r.get("error", r["status"]), error_tail=tail[-2000:])
        bad += rec["status"] != "planned"
        report.set(rec, tail)
        print(f"[gpu_day] {step.name}: {rec['status']}" + (f" ({rec['error']})" if "error" in rec else ""), flush=True)
    report.res["finished"] = True
    report.write()
    ok = the_plan["fits"] and not bad
    print(f"[gpu_day] dry run: {'the plan fits' if ok else 'THE PLAN DOES NOT FIT OR A STEP IS MISSING'}; "
          f"wrote {report.out}", flush=True)
    return 0 if ok else 1


def _day(args, steps: list[Step], report: Report, work: Path) -> int:
    explicit = args.steps is not None  # named steps run with whatever is left, as must-run ones do
    old = signal.signal(signal.SIGTERM, _on_term)
    current = None
    try:
        for step in steps:
            left = args.budget_s - (time.perf_counter() - report.start)
            must = step.must or explicit
            if left < MIN_STEP_S or (not must and left < step.estimate_s):
                report.set({"step": step.name, "status": "skipped", "must": step.must, "estimate_s": step.estimate_s,
                            "seconds": 0, "reason": f"budget: {max(left, 0):.0f} s left, estimate {step.estimate_s} s"})
                print(f"[gpu_day] {step.name}: skipped: budget ({left:.0f} s left)", flush=True)
                report.write()
                continue
            deadline = min(step.deadline_s, left)
            current = {"step": step.name, "status": "running", "must": step.must, "estimate_s": step.estimate_s,
                       "deadline_s": round(deadline, 1), "started": _dt.datetime.now(_dt.timezone.utc).strftime(
                           "%H:%M:%SZ")}
            report.set(current)
            report.write()
            print(f"[gpu_day] {step.name} (deadline {deadline:.0f} s, estimate {step.estimate_s} s) ...", flush=True)

            def progress(key: dict, running: dict = current) -> None:  # so far: a kill now keeps it
                report.set(running | {"key": key})
                report.write()

            rec, tail = _summarise(run_step(step, str(work / step.name), deadline, dry=False, progress=progress),
                                   step.must, step.estimate_s)
            report.set(rec, tail)
            current = None
            report.write()
            print(f"[gpu_day] {step.name}: {rec['status']} ({rec.get('seconds', 0)} s)"
                  + (f"; {rec['reuse']}" if "reuse" in rec else ""), flush=True)
            if rec["status"] != "ok":
                print(rec.get("error", "") + "\n" + tail[-1500:], flush=True)
    except (_Interrupted, KeyboardInterrupt) as e:
        if current is not None:  # with the key numbers it had so far
            report.set(report.records.get(current["step"], current)
                       | {"status": "timeout", "error": f"the suite was interrupted ({e or 'SIGINT'})"})
        report.write()
        print(f"[gpu_day] interrupted ({e or 'SIGINT'}); wrote {report.out}", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    report.res["finished"] = True
    report.write()
    recs = list(report.records.values())
    print(f"[gpu_day] {'passed' if report.res['passed'] else 'FAILED'}: "
          + ", ".join(f"{r['step']} {r['status']}" for r in recs)
          + f" in {report.res['seconds']} s; wrote {report.out}", flush=True)
    return 0 if report.res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
