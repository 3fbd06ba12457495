"""The GPU suite's plan and its dry run: every step is found and every benchmark parses its arguments;
parts fit a 10-minute command, results are written after every step, a timed-out step is killed
with its whole process group, and a second part on a warm machine reuses the build."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from shutil import which as shutil_which

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_suite  # noqa: E402


def _load_bench(script: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{Path(script).stem}", ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_steps_cover_the_gpu_work_within_the_budget():
    names = [s.name for s in gpu_suite.STEPS]
    for required in ("env", "install", "gpu_tests", "ppo_loss", "packing", "reshard", "trainer"):
        assert required in names
    assert sum(s.limit_s for s in gpu_suite.STEPS) <= gpu_suite.BUDGET_S
    for s in gpu_suite.STEPS:
        for f in s.needs:
            assert (ROOT / f).exists(), f"step {s.name} needs {f}"
    assert gpu_suite.gpu_test_files(), "no test file carries a gpu mark"


def test_parts_fit_a_ten_minute_command_and_cover_every_step():
    """Each part, its install included, within 9 minutes (the device kills a command at 10)."""
    limits = {s.name: s.limit_s for s in gpu_suite.STEPS}
    for part, steps in gpu_suite.PARTS.items():
        assert sum(limits[s] for s in steps) <= gpu_suite.PART_BUDGET_S, part
        assert steps[0] in ("env", "install") and "install" in steps, f"part {part} must build the package first"
    assert {s for steps in gpu_suite.PARTS.values() for s in steps} == set(limits)


# ends by itself after 30 s (so a budget that is not enforced fails the test instead of hanging it),
# long past the 2 s budget below
LONG = ("{py}", "-c", "import time; time.sleep(30)")


@pytest.mark.parametrize("how", ["budget", "part"])
def test_the_budget_cuts_a_step_and_skips_the_rest(tmp_path, monkeypatch, how):
    """The budget is enforced, not only declared: a step whose own limit is past the time left gets
    only the time left (it is killed at the budget, not at its 600 s limit) and the steps
    after it are skipped; ``--part`` runs under PART_BUDGET_S whatever ``--budget-s`` says."""
    steps = (gpu_suite.Step("hang", 600, LONG), gpu_suite.Step("after", 600, ("{py}", "-c", "pass")))
    monkeypatch.setattr(gpu_suite, "STEPS", steps)
    if how == "part":
        monkeypatch.setattr(gpu_suite, "PARTS", {"x": ("hang", "after")})
        monkeypatch.setattr(gpu_suite, "PART_BUDGET_S", 2)
        args = ["--part", "x", "--budget-s", "1200"]
    else:
        args = ["--budget-s", "2"]
    out = tmp_path / "suite.json"
    assert gpu_suite.main([*args, "--out", str(out)]) != 0
    res = json.loads(out.read_text())
    hang, after = res["steps"]
    # killed at the time left, or skipped when the suite's own start already spent the budget
    assert res["budget_s"] == 2 and hang["status"] in ("timeout", "skipped") and hang["limit_s"] <= 2
    assert after["status"] == "skipped" and "budget" in after["error"]


BENCH_STEPS = [s for s in gpu_suite.STEPS if s.name in ("ppo_loss", "packing", "reshard", "trainer")]


@pytest.mark.parametrize("step", BENCH_STEPS, ids=lambda s: s.name)
def test_every_benchmark_builds_its_cases_with_the_suite_arguments(step, tmp_path, capsys):
    """In process (no GPU): the bench's own main() with the suite's arguments and --dry-run."""
    argv = gpu_suite._expand(step.dry_argv, str(tmp_path))
    assert argv[0] == sys.executable and argv[-1] == "--dry-run"
    _load_bench(argv[1]).main(argv[2:])
    out = capsys.readouterr().out
    assert "[dry-run]" in out and " cases" in out
    assert not list(tmp_path.iterdir()), "a dry run must write no result rows"


def test_a_bad_argument_fails_the_bench(capsys):
    with pytest.raises(SystemExit) as e:
        _load_bench("bench/bench_reshard.py").main(["--parts", "plan,bogus", "--dry-run"])
    assert e.value.code == 2 and "bogus" in capsys.readouterr().err


def test_run_step_records_missing_files_failures_and_timeouts(tmp_path):
    missing = gpu_suite.Step("m", 10, ("{py}", "-c", "pass"), needs=("bench/no_such_bench.py",))
    assert gpu_suite.run_step(missing, str(tmp_path), 10, dry=False)["status"] == "failed"
    fails = gpu_suite.Step("f", 10, ("{py}", "-c", "import sys; print('boom'); sys.exit(3)"))
    rec = gpu_suite.run_step(fails, str(tmp_path), 10, dry=False)
    assert (rec["status"], rec["rc"]) == ("failed", 3) and "boom" in rec["output_tail"]
    # waits on an event nobody sets: only the step's limit can end it
    hangs = gpu_suite.Step("h", 1, ("{py}", "-c", "import threading; threading.Event().wait()"))
    rec = gpu_suite.run_step(hangs, str(tmp_path), 0.5, dry=False)
    assert rec["status"] == "timeout" and rec["timed_out"]
    assert gpu_suite.run_step(fails, str(tmp_path), 0, dry=False)["status"] == "skipped"


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, deadline_s: float = 20.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


# A step that starts a child (as torchrun / NCCL workers would) which sleeps, records its pid, then
# either waits forever (killed by the step's limit) or exits at once (leaving the child behind).
SPAWNS = textwrap.dedent("""
    import subprocess, sys, threading
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(str(child.pid))
    print("child", child.pid, flush=True)
    if sys.argv[2] == "hang":
        threading.Event().wait()
""")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
@pytest.mark.parametrize("how", ["hang", "exit"])
def test_a_step_is_killed_with_its_whole_process_group(tmp_path, how):
    pid_file = tmp_path / "child.pid"
    step = gpu_suite.Step("spawn", 30, ("{py}", "-c", SPAWNS, str(pid_file), how))
    try:
        rec = gpu_suite.run_step(step, str(tmp_path), 2 if how == "hang" else 60, dry=False)
        child = int(pid_file.read_text())
        assert _wait_gone(child), f"the step's child {child} survived the step ({rec['status']})"
        if how == "hang":
            assert rec["status"] == "timeout" and f"child {child}" in rec["output_tail"]
        else:  # finished: not held up by the child (which holds no pipe of the suite), which is killed
            assert rec["status"] == "ok" and rec["killed_leftovers"]
    finally:
        if pid_file.exists() and not _gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)


def test_a_killed_suite_keeps_its_finished_steps(tmp_path):
    """The result file is written before and after every step: the suite killed (as the device kills
    a command at 10 minutes) in its second step still has the first step's result and rows."""
    out = tmp_path / "suite.json"
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import gpu_suite as g
        row = "import json, sys; open(sys.argv[1] + '/quick.jsonl', 'a').write(json.dumps({{'x': 1}}) + chr(10))"
        g.STEPS = (g.Step("quick", 60, ("{{py}}", "-c", row, "{{results}}")),
                   g.Step("stuck", 600, ("{{py}}", "-c", "import threading; threading.Event().wait()")))
        sys.exit(g.main(["--out", {str(out)!r}]))
    """))
    p = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        end = time.monotonic() + 60
        res = None
        while time.monotonic() < end and p.poll() is None:
            if out.exists():
                res = json.loads(out.read_text())
                if [s["step"] for s in res["steps"]] == ["quick", "stuck"]:
                    break
            time.sleep(0.1)
        assert p.poll() is None, "the suite ended by itself"
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    res = json.loads(out.read_text())
    assert [(s["step"], s["status"]) for s in res["steps"]] == [("quick", "ok"), ("stuck", "running")]
    assert res["rows"] == {"quick": [{"x": 1}]} and not res["finished"] and not res["passed"]
    assert (tmp_path / "suite.rows" / "quick.jsonl").exists()
    assert not list(tmp_path.glob(".suite.json.*")), "a temporary file of the atomic write was left"


def test_default_out_goes_under_OUT_when_set(tmp_path):
    prov = {"device": "NVIDIA H100 80GB HBM3"}
    out = gpu_suite.default_out(prov, "b", False, environ={"OUT": str(tmp_path)})
    assert out.parent == tmp_path and out.name.startswith("gpu_suite-partb-NVIDIA_H100_80GB_HBM3-")
    assert out.suffix == ".json"
    here = gpu_suite.default_out(prov, None, True, environ={})
    assert here.parent == ROOT / "bench" / "results" and here.name.startswith("gpu_suite-dry-NVIDIA_H100")


# ----------------------------------------------------------------------------- reusing the build


def test_install_is_skipped_only_for_the_same_build_inputs(tmp_path):
    stamp = tmp_path / "build" / "stamp.json"
    ok, bad = ("{py}", "-c", "print('cuda core here')"), ("{py}", "-c", "raise SystemExit('_C without CUDA')")
    assert gpu_suite.reusable_build(stamp, "abc", ok) == (False, f"no install recorded at {stamp}")
    gpu_suite.record_install(stamp, "abc")
    reused, why = gpu_suite.reusable_build(stamp, "abc", ok)
    assert reused and "cuda core here" in why
    reused, why = gpu_suite.reusable_build(stamp, "abd", ok)
    assert not reused and "abc -> abd" in why
    reused, why = gpu_suite.reusable_build(stamp, "abc", bad)
    assert not reused and "_C without CUDA" in why


def test_a_reused_install_runs_nothing_and_a_passed_one_is_recorded(tmp_path):
    calls = []
    ran = tmp_path / "ran"
    step = gpu_suite.Step("install", 30, ("{py}", "-c", f"open({str(ran)!r}, 'w')"),
                          reuse=lambda: (True, "same inputs"), done=lambda: calls.append("done"))
    rec = gpu_suite.run_step(step, str(tmp_path), 30, dry=False)
    assert rec["status"] == "ok" and rec["reused"] and not ran.exists() and calls == []
    step = gpu_suite.Step("install", 30, step.argv, reuse=lambda: (False, "inputs changed"),
                          done=lambda: calls.append("done"))
    rec = gpu_suite.run_step(step, str(tmp_path), 30, dry=False)
    assert rec["status"] == "ok" and ran.exists() and calls == ["done"] and rec["reuse"] == "inputs changed"


def _tree(root: Path) -> None:
    for rel, text in {"CMakeLists.txt": "project(x)", "pyproject.toml": "[project]", "csrc/a.cu": "k",
                      "areal_fast/__init__.py": "", "kernels/k.py": ""}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_build_inputs_hash_follows_sources_settings_and_module_names(tmp_path, monkeypatch):
    _tree(tmp_path)
    monkeypatch.setattr(gpu_suite, "ROOT", tmp_path)
    h0 = gpu_suite.build_inputs_hash()
    os.utime(tmp_path / "csrc" / "a.cu", (1, 1))  # a fresh copy of the tree: new times, same bytes
    (tmp_path / "areal_fast" / "__init__.py").write_text("x = 1")  # Python edits: the editable install has them
    assert gpu_suite.build_inputs_hash() == h0
    (tmp_path / "csrc" / "a.cu").write_text("k2")
    h1 = gpu_suite.build_inputs_hash()
    assert h1 != h0
    (tmp_path / "areal_fast" / "new.py").write_text("")
    assert gpu_suite.build_inputs_hash() != h1
    assert gpu_suite.build_inputs_hash(gpu_suite.INSTALL_ENV | {"CMAKE_ARGS": "-DCMAKE_CUDA_ARCHITECTURES=80"}) \
        != gpu_suite.build_inputs_hash()


# ----------------------------------------------------------------------------- provenance


def test_the_commit_without_git_comes_from_the_flag_or_the_build(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import common

    monkeypatch.setattr(common, "git_commit", lambda: "unknown")
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "areal_fast._build_info", types.SimpleNamespace(COMMIT="b1d5eed"))
    assert common.commit_and_source() == ("b1d5eed", "build")
    monkeypatch.setenv(common.COMMIT_ENV, "f1a9000")
    prov = common.provenance(native=False)
    assert (prov["commit"], prov["commit_from"]) == ("f1a9000", common.COMMIT_ENV)
    assert "areal_fast_cuda_core" not in prov
    monkeypatch.delenv(common.COMMIT_ENV)
    monkeypatch.setitem(sys.modules, "areal_fast._build_info", types.SimpleNamespace(COMMIT="unknown"))
    assert common.commit_and_source() == ("unknown", "none")


@pytest.mark.skipif(not shutil_which("cmake"), reason="no cmake on PATH")
def test_cmake_writes_the_commit_into_the_build_info(tmp_path):
    """The block of CMakeLists.txt that writes areal_fast/_build_info.py, configured on its own
    (no compiler, no pybind11) outside any git checkout: the commit comes from AREAL_FAST_COMMIT."""
    text = (ROOT / "CMakeLists.txt").read_text()
    a = text.index("# Provenance where there is no .git")
    b = text.index("\n", text.index('message(STATUS "areal_fast: build of commit')) + 1
    assert "install(FILES ${CMAKE_CURRENT_BINARY_DIR}/_build_info.py DESTINATION areal_fast)" in text
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.24)\nproject(t LANGUAGES NONE)\n"
                                        "set(AREAL_WITH_CUDA ON)\n" + text[a:b])
    env = os.environ | {"AREAL_FAST_COMMIT": "c0ffee1", "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    p = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "b")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    info = {}
    exec((tmp_path / "b" / "_build_info.py").read_text(), info)
    assert info["COMMIT"] == "c0ffee1" and info["WITH_CUDA"] is True and info["DATE"].endswith("Z")


def test_packing_bench_writes_each_row_as_it_is_measured(tmp_path, monkeypatch):
    """Killed during its second case (here: the timer raises once a row is on disk), the packing
    benchmark has already written the first case's row."""
    bench = _load_bench("bench/bench_packing_kernels.py")
    rows_file = tmp_path / "packing_kernels.jsonl"

    def timer(fn, device, reps):
        if rows_file.exists():
            raise RuntimeError("killed at the step's limit")
        fn()
        return 1.0

    monkeypatch.setattr(bench, "time_ms", timer)
    with pytest.raises(RuntimeError, match="killed"):
        bench.main(["--batch", "3", "--max-len", "16", "--hidden", "8", "--reps", "1", "--results", str(tmp_path)])
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["op"] and rows[0]["B"] == 3


def test_collect_rows_gathers_every_bench_file(tmp_path):
    (tmp_path / "ppo_loss.jsonl").write_text(json.dumps({"bench": "ppo_loss", "T": 1, "provenance": {"x": 1}}) + "\n")
    (tmp_path / "reshard.jsonl").write_text("\n".join(json.dumps({"part": p}) for p in ("plan", "cuda_copy")) + "\n")
    rows = gpu_suite.collect_rows(str(tmp_path))
    assert rows == {"ppo_loss": [{"bench": "ppo_loss", "T": 1}], "reshard": [{"part": "plan"}, {"part": "cuda_copy"}]}


@pytest.mark.slow
def test_dry_run_of_the_whole_suite(tmp_path):
    out = tmp_path / "suite.json"
    rc = gpu_suite.main(["--dry-run", "--out", str(out)])
    res = json.loads(out.read_text())
    failed = {s["step"]: s.get("output_tail", s.get("error")) for s in res["steps"] if s["status"] != "ok"}
    assert rc == 0 and not failed, failed
    assert [s["step"] for s in res["steps"]] == [s.name for s in gpu_suite.STEPS]
    assert res["dry_run"] and res["finished"] and {"device", "commit", "date", "torch"} <= set(res["provenance"])
    steps = {s["step"]: s for s in res["steps"]}
    # collected as the real step selects (-m gpu tests), checked by check_gpu_collection
    assert " -m gpu tests " in steps["gpu_tests"]["cmd"] + " " and "--collect-only" in steps["gpu_tests"]["cmd"]
    assert "reuse" in steps["install"]
    assert (tmp_path / "suite.rows" / "gpu_tests-dry.log").exists()


def test_the_dry_run_and_the_real_step_select_the_same_tests():
    step = next(s for s in gpu_suite.STEPS if s.name == "gpu_tests")
    real, dry = gpu_suite._expand(step.argv, "R"), gpu_suite._expand(step.dry_argv, "R")
    sel = list(gpu_suite.GPU_TEST_ARGS)
    assert any(real[i:i + len(sel)] == sel for i in range(len(real)))
    assert any(dry[i:i + len(sel)] == sel for i in range(len(dry)))
    env = gpu_suite._step_env(step, dry=True)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(gpu_suite.WITHOUT_OPTIONAL)
    assert "PYTHONPATH" not in gpu_suite._step_env(step, dry=False) or \
        str(gpu_suite.WITHOUT_OPTIONAL) not in gpu_suite._step_env(step, dry=False)["PYTHONPATH"]


GOOD = """tests/test_a.py::test_x[cuda]
tests/test_b.py::test_y

2/40 tests collected (38 deselected) in 3.1s
"""


def test_the_collection_check_names_what_is_wrong(monkeypatch):
    monkeypatch.setattr(gpu_suite, "gpu_test_files", lambda: ["tests/test_a.py", "tests/test_b.py"])
    assert gpu_suite.check_gpu_collection(GOOD) is None
    errors = ("tests/test_a.py::test_x[cuda]\nERROR tests/test_scan.py\n"
              "!!! Interrupted: 1 error during collection !!!\n1/40 tests collected (39 deselected), 1 error in 3s\n")
    assert "tests/test_scan.py" in gpu_suite.check_gpu_collection(errors)
    monkeypatch.setattr(gpu_suite, "gpu_test_files", lambda: ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"])
    assert "tests/test_c.py" in gpu_suite.check_gpu_collection(GOOD)
    assert "no GPU test" in gpu_suite.check_gpu_collection("\nno tests collected (40 deselected) in 1s\n")
