"""The GPU day (tools/gpu_suite.py) on CPU: the plan's must-run steps fit the budget and the dry run
walks it; with fake steps, the summary is rewritten after every step, a step past its deadline is
killed with its process group and the next one runs, at most two files land beside --out, --steps
runs only the named steps; every benchmark parses the day's arguments; the build is reused."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from shutil import which as shutil_which

import pytest

ROOT = Path(__file__).resolve().parents[2]
from tools import gpu_suite  # noqa: E402


def _load_bench(script: str):
    return importlib.import_module(f"bench.{Path(script).stem}")


# ----------------------------------------------------------------------------- the plan


def test_the_plan_covers_the_gpu_work_and_its_must_run_steps_fit_the_day():
    names = [s.name for s in gpu_suite.STEPS]
    assert names[:5] == ["env", "install", "gpu_tests", "loss", "trainer"], "the most valuable checks first"
    for required in ("packing", "reshard", "loss_baselines"):
        assert required in names
    assert all(s.must for s in gpu_suite.STEPS[:5]) and not any(s.must for s in gpu_suite.STEPS[5:])
    must = gpu_suite.STARTUP_S + sum(s.estimate_s for s in gpu_suite.STEPS if s.must)
    assert must <= gpu_suite.DAY_BUDGET_S < gpu_suite.DAY_WALL_S <= 8 * 60
    for s in gpu_suite.STEPS:
        assert 0 < s.estimate_s <= s.deadline_s <= gpu_suite.DAY_BUDGET_S, s.name
        assert not gpu_suite.check_step(s), (s.name, gpu_suite.check_step(s))
    assert gpu_suite.gpu_test_files(), "no test file carries a gpu mark"


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_dry_run_fits_the_budget_and_writes_one_json_with_every_step_planned(tmp_path, capsys):
    out = tmp_path / "out" / "gpu_day.json"
    assert gpu_suite.main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["mode"] == "dry-run" and res["finished"] and res["plan"]["fits"]
    assert res["budget_s"] == gpu_suite.DAY_BUDGET_S
    assert [(s["step"], s["status"]) for s in res["steps"]] == [(s.name, "planned") for s in gpu_suite.STEPS]
    assert res["plan"]["must_estimate_s"] <= gpu_suite.DAY_BUDGET_S
    for s in gpu_suite.STEPS:  # printed: every step with its estimate and deadline, then the totals
        assert re.search(rf"^{s.name}\s+{s.estimate_s}\s+{s.deadline_s}\s", printed, re.M), s.name
    assert "must-run: " in printed and "fits" in printed
    assert len(_files(out.parent)) <= 2, _files(out.parent)


def test_the_dry_run_fails_a_plan_that_does_not_fit_or_a_missing_script(tmp_path, monkeypatch):
    out = tmp_path / "gpu_day.json"
    assert gpu_suite.main(["--dry-run", "--budget-s", "200", "--out", str(out)]) == 1
    assert not json.loads(out.read_text())["plan"]["fits"]
    monkeypatch.setattr(gpu_suite, "STEPS", (*gpu_suite.STEPS[:1], gpu_suite.Step(
        "gone", 1, 5, ("{py}", "bench/no_such_bench.py"))))
    assert gpu_suite.main(["--dry-run", "--out", str(out)]) == 1
    steps = {s["step"]: s for s in json.loads(out.read_text())["steps"]}
    assert steps["env"]["status"] == "planned" and steps["gone"]["status"] == "failed"
    assert "bench/no_such_bench.py" in steps["gone"]["error"]


def test_the_plan_skips_optional_steps_past_the_budget_never_must_run_ones():
    steps = [gpu_suite.Step("a", 100, 200, ("true",), must=True), gpu_suite.Step("b", 50, 60, ("true",)),
             gpu_suite.Step("c", 10, 20, ("true",))]
    p = gpu_suite.plan(steps, 150)
    assert [r["expected"] for r in p["steps"]] == ["run", "skipped: budget", "run"]
    assert p["fits"] and p["must_estimate_s"] == 100 + gpu_suite.STARTUP_S
    assert not gpu_suite.plan(steps, 150, all_must=True)["fits"]
    assert not gpu_suite.plan(steps, 100)["fits"]


# ----------------------------------------------------------------------------- the day, with fake steps


def _py(code: str, *args: str) -> tuple[str, ...]:
    return ("{py}", "-c", code, *args)


def _day(tmp_path, monkeypatch, steps, *args) -> tuple[int, dict, Path]:
    monkeypatch.setattr(gpu_suite, "STEPS", tuple(steps))
    out = tmp_path / "out" / "gpu_day.json"
    rc = gpu_suite.main(["--day", "--out", str(out), *args])
    return rc, json.loads(out.read_text()), out


# reads the summary as it stands while this step runs: every earlier step finished and recorded
CHECKS_JSON = """import json, sys
res = json.load(open(sys.argv[1]))
st = {s["step"]: s["status"] for s in res["steps"]}
want = dict(x.split("=") for x in sys.argv[2].split(","))
assert all(st[k] == v for k, v in want.items()), st
print("seen", st)
"""


def test_the_day_records_each_step_rewrites_the_json_after_each_and_goes_on_past_a_timeout(tmp_path, monkeypatch):
    out = tmp_path / "out" / "gpu_day.json"
    steps = [
        gpu_suite.Step("first", 1, 30, _py("print('first ran')"), must=True),
        gpu_suite.Step("sees_first", 1, 30, _py(CHECKS_JSON, str(out), "first=ok,sees_first=running,slow=planned")),
        # waits on an event nobody sets: only its deadline ends it
        gpu_suite.Step("slow", 1, 1, _py("import threading; print('slow began', flush=True); "
                                         "threading.Event().wait()")),
        gpu_suite.Step("fails", 1, 30, _py("import sys; print('boom'); sys.exit(3)")),
        gpu_suite.Step("sees_all", 1, 30, _py(CHECKS_JSON, str(out), "slow=timeout,fails=failed")),
        gpu_suite.Step("too_big", 10_000, 10_000, _py("raise SystemExit('must not run')")),
    ]
    t0 = time.monotonic()
    rc, res, out = _day(tmp_path, monkeypatch, steps)
    assert time.monotonic() - t0 < 60
    st = {s["step"]: s for s in res["steps"]}
    assert [s["step"] for s in res["steps"]] == [s.name for s in steps]
    assert [s["status"] for s in res["steps"]] == ["ok", "ok", "timeout", "failed", "ok", "skipped"]
    assert rc == 1 and res["finished"] and not res["passed"]
    assert st["slow"]["deadline_s"] == 1 and "slow began" in st["slow"]["error_tail"]
    assert st["fails"]["rc"] == 3 and "boom" in st["fails"]["error_tail"]
    assert "error_tail" not in st["first"] and st["first"]["seconds"] >= 0
    assert st["too_big"]["reason"].startswith("budget")
    assert _files(out.parent) == ["gpu_day.json", "gpu_day.log"]
    log = (out.parent / "gpu_day.log").read_text()
    assert "first ran" in log and "boom" in log and "== slow: timeout" in log


def test_the_budget_cuts_a_must_run_step_and_skips_the_rest(tmp_path, monkeypatch):
    """Enforced, not only declared: a must-run step whose deadline is past the time left gets only
    the time left; the next must-run step, with under MIN_STEP_S left, is skipped."""
    steps = [gpu_suite.Step("hang", 1, 600, _py("import time; time.sleep(30)"), must=True),
             gpu_suite.Step("after", 1, 600, _py("pass"), must=True)]
    monkeypatch.setattr(gpu_suite, "MIN_STEP_S", 1)
    rc, res, _ = _day(tmp_path, monkeypatch, steps, "--budget-s", "3")
    hang, after = res["steps"]
    assert rc == 1 and res["budget_s"] == 3 and hang["status"] == "timeout" and hang["deadline_s"] <= 3
    assert after["status"] == "skipped" and "budget" in after["reason"] and not res["passed"]


def test_steps_runs_only_the_named_ones_and_the_install_they_need(tmp_path, monkeypatch):
    ran = tmp_path / "ran"
    ran.mkdir()

    def mark(name, **kw):
        return gpu_suite.Step(name, 1, 30, _py(f"open({str(ran / name)!r}, 'w')"), **kw)

    steps = [mark("install"), mark("a"), mark("b", after_install=True), mark("c"), mark("d")]
    rc, res, _ = _day(tmp_path, monkeypatch, steps, "--steps", "d,a")
    assert rc == 0 and res["passed"] and [s["step"] for s in res["steps"]] == ["a", "d"]
    assert _files(ran) == ["a", "d"]
    rc, res, _ = _day(tmp_path, monkeypatch, steps, "--steps", "b")
    assert rc == 0 and [s["step"] for s in res["steps"]] == ["install", "b"]
    with pytest.raises(SystemExit):
        gpu_suite.main(["--day", "--steps", "nope", "--out", str(tmp_path / "x.json")])


def test_the_work_folder_may_not_be_under_the_out_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "STEPS", (gpu_suite.Step("a", 1, 5, _py("pass")),))
    with pytest.raises(SystemExit):
        gpu_suite.main(["--day", "--out", str(tmp_path / "gpu_day.json"), "--work-dir", str(tmp_path / "w")])
    rc = gpu_suite.main(["--day", "--out", str(tmp_path / "o" / "gpu_day.json"), "--work-dir", str(tmp_path / "w")])
    assert rc == 0 and (tmp_path / "w" / "a" / "a.log").exists()


def test_default_out(tmp_path):
    prov = {"device": "NVIDIA H100 80GB HBM3"}
    assert gpu_suite.default_out(prov, False, environ={"OUT": str(tmp_path)}) == tmp_path / "gpu_day.json"
    here = gpu_suite.default_out(prov, True, environ={})
    assert here.parent == ROOT / "bench" / "results" and here.name.startswith("gpu_day-dry-NVIDIA_H100")


# ----------------------------------------------------------------------------- the key numbers

ENV_OUT = json.dumps({"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
                      "gpu": "NVIDIA H100 80GB HBM3", "missing": []}) + """
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
name, memory.total [MiB], driver_version, clocks.max.sm [MHz]
NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 1980 MHz
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="2" tests="5" time="61.2"><testcase classname="tests.ops.test_ppo_loss_kernels" name="test_a[x]" time="1"/>
<testcase classname="tests.ops.test_ppo_loss_kernels" name="test_b" time="1"><failure message="m">tb</failure>
</testcase></testsuite></testsuites>"""


def test_the_key_numbers_of_env_tests_and_benchmarks(tmp_path):
    env = gpu_suite.env_key(ENV_OUT, str(tmp_path))
    assert env["gpu"] == "NVIDIA H100 80GB HBM3" and env["triton"] == "3.6.0" and env["nvcc"] == "13.0"
    assert env["nvidia_smi"].startswith("NVIDIA H100 80GB HBM3, 81559 MiB")
    (tmp_path / "gpu_tests.xml").write_text(JUNIT)
    key = gpu_suite.tests_key("...\n1 failed, 2 passed, 2 skipped in 61.20s (0:01:01)\n", str(tmp_path))
    assert (key["tests"], key["failures"], key["skipped"], key["passed"]) == (5, 1, 2, 2)
    assert key["failed_ids"] == ["tests/ops/test_ppo_loss_kernels.py::test_b"] and "1 failed" in key["summary"]
    (tmp_path / "gpu_tests.xml").write_text(JUNIT[:80])  # cut short by the deadline
    assert "unreadable" in gpu_suite.tests_key("", str(tmp_path))["junit"]
    (tmp_path / "loss.jsonl").write_text(json.dumps({"T": 1, "provenance": {}}) + "\n")
    assert gpu_suite.rows_key("", str(tmp_path)) == {"rows": {"loss": [{"T": 1}]}}


# A GPU test run cut short: the fourth test kills pytest's whole process group, as the step's limit
# would, before the fifth runs and before pytest could write its JUnit file.
CUT_TESTS = """
import os, signal, pytest
def test_a(): pass
def test_b(): assert 1 == 2, "b is wrong"
def test_c(): pytest.skip("not here")
def test_d(): os.killpg(os.getpgid(0), signal.SIGKILL)
def test_e(): pass
"""


def test_a_cut_gpu_test_run_still_reports_each_finished_test(tmp_path):
    """The gpu_tests step's pytest writes each result as it finishes (tools/results_log.py), so a
    step killed mid-run keeps every finished test's outcome, the failure, and the test it was in;
    run here as the GPU image would, without pytest-xdist (which the suite's options do not need)."""
    (tmp_path / "test_cut.py").write_text(CUT_TESTS)
    results = tmp_path / "results"
    argv = ("{py}", "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"), "-p", "no:xdist",
            "-p", "no:cacheprovider", "-p", "tools.results_log", str(tmp_path / "test_cut.py"),
            "--junitxml", "{results}/gpu_tests.xml", "--results-log", "{results}/" + gpu_suite.RESULTS_LOG)
    rec = gpu_suite.run_step(gpu_suite.Step("gpu_tests", 1, 60, argv, key=gpu_suite.tests_key), str(results), 60,
                             dry=False)
    key, mod = rec["key"], str(tmp_path / "test_cut.py").lstrip("/")
    assert rec["rc"] == -9 and not (results / "gpu_tests.xml").exists(), rec["output_tail"]
    ids = [t[0].split("::")[1] for t in key["per_test"]]
    assert ids == ["test_a", "test_b", "test_c"] and [t[1] for t in key["per_test"]] == ["passed", "failed", "skipped"]
    assert (key["tests"], key["passed"], key["failures"], key["skipped"]) == (3, 1, 1, 1)
    assert [i.split("::")[1] for i in key["failed_ids"]] == ["test_b"] and mod.endswith(key["failed_ids"][0]
                                                                                           .split("::")[0])
    assert "b is wrong" in key["errors_by_id"][key["failed_ids"][0]]
    assert [i.split("::")[1] for i in key["running_when_cut"]] == ["test_d"] and not key["session_finished"]


def test_the_documented_tables_match_the_plan():
    """docs/benchmarks.md names each step with its estimate and deadline (the one table of them)."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    for s in gpu_suite.STEPS:
        assert re.search(rf"^\| `{s.name}` \| {s.estimate_s} \| {s.deadline_s} \| {'yes' if s.must else 'no'} \|",
                         docs, re.M), f"docs/benchmarks.md: {s.name}"
    assert "--part" not in docs.split("## The GPU day")[1].split("\n## ")[0]



BENCH_STEPS = [s for s in gpu_suite.STEPS if s.argv[1:2] and s.argv[1].startswith("bench/")]


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
    missing = gpu_suite.Step("m", 1, 10, ("{py}", "-c", "pass"), needs=("bench/no_such_bench.py",))
    assert gpu_suite.run_step(missing, str(tmp_path), 10, dry=False)["status"] == "failed"
    fails = gpu_suite.Step("f", 1, 10, ("{py}", "-c", "import sys; print('boom'); sys.exit(3)"))
    rec = gpu_suite.run_step(fails, str(tmp_path), 10, dry=False)
    assert (rec["status"], rec["rc"]) == ("failed", 3) and "boom" in rec["output_tail"]
    # waits on an event nobody sets: only the step's limit can end it
    hangs = gpu_suite.Step("h", 1, 1, ("{py}", "-c", "import threading; threading.Event().wait()"))
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
    step = gpu_suite.Step("spawn", 1, 30, ("{py}", "-c", SPAWNS, str(pid_file), how))
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


def _driver(tmp_path: Path, out: Path, steps_src: str) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        from tools import gpu_suite as g
        g.STEPS = {steps_src}
        sys.exit(g.main(["--day", "--out", {str(out)!r}, "--work-dir", {str(tmp_path / "work")!r}]))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)


def _wait_for(out: Path, p: subprocess.Popen, want: list[tuple[str, str]]) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        if out.exists() and [(s["step"], s["status"]) for s in json.loads(out.read_text())["steps"]] == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"the suite never reached {want} (exit {p.poll()})")


# the second step records its pid, then waits forever
STUCK = ('g.Step("stuck", 1, 600, ("{py}", "-c", "import os, sys, threading; open(sys.argv[1], \'w\').write('
         'str(os.getpid())); threading.Event().wait()", PID))')


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_a_killed_day_keeps_its_finished_steps_and_takes_its_step_along(tmp_path):
    """Killed with SIGKILL mid-step (as a command limit would), the day leaves a valid summary with
    the finished step and the one it was in, and the step (in its own session) dies with it."""
    out = tmp_path / "out" / "gpu_day.json"
    pid_file = tmp_path / "stuck.pid"
    p = _driver(tmp_path, out, f'(g.Step("quick", 1, 60, ("{{py}}", "-c", "print(1)")), '
                               f'{STUCK.replace("PID", repr(str(pid_file)))})')
    try:
        _wait_for(out, p, [("quick", "ok"), ("stuck", "running")])
        end = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(p.pid, 9)  # the suite alone, not its steps' groups
        p.wait()
        assert _wait_gone(int(pid_file.read_text())), "the step outlived the killed suite"
    finally:
        os.killpg(p.pid, 9) if p.poll() is None else None
        if pid_file.exists() and not _gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)
    res = json.loads(out.read_text())
    assert [(s["step"], s["status"]) for s in res["steps"]] == [("quick", "ok"), ("stuck", "running")]
    assert not res["finished"] and not res["passed"]
    assert _files(out.parent) == ["gpu_day.json", "gpu_day.log"], "a temporary file of an atomic write was left"


def test_sigterm_ends_the_step_and_records_it(tmp_path):
    out = tmp_path / "out" / "gpu_day.json"
    pid_file = tmp_path / "stuck.pid"
    p = _driver(tmp_path, out, f'({STUCK.replace("PID", repr(str(pid_file)))},)')
    try:
        _wait_for(out, p, [("stuck", "running")])
        end = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        p.send_signal(15)
        assert p.wait(timeout=30) == 130
        assert _wait_gone(int(pid_file.read_text()))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        if pid_file.exists() and not _gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)
    (stuck,) = json.loads(out.read_text())["steps"]
    assert stuck["status"] == "timeout" and "SIGTERM" in stuck["error"]


# A step that says it started, then waits until told (a file) to finish.
WAITS_FOR_GO = ("import os, sys, time\nprint('started', flush=True)\n"
                "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.01)\nprint('done', flush=True)")


def test_a_running_step_puts_its_results_so_far_in_the_summary(tmp_path, monkeypatch):
    """While a step runs, its key numbers so far reach the day's summary every PROGRESS_S (a kill
    from outside then keeps them): here the step finishes only once its first progress was seen."""
    monkeypatch.setattr(gpu_suite, "PROGRESS_S", 0.05)
    go = tmp_path / "go"
    seen = []

    def progress(key: dict) -> None:
        seen.append(key)
        if key.get("lines") == ["started"]:
            go.touch()

    def key(output: str, results: str) -> dict:
        return {"lines": output.split()}

    step = gpu_suite.Step("waits", 1, 60, ("{py}", "-c", WAITS_FOR_GO, str(go)), key=key)
    rec = gpu_suite.run_step(step, str(tmp_path / "results"), 60, dry=False, progress=progress)
    assert rec["status"] == "ok" and rec["key"] == {"lines": ["started", "done"]}
    assert {"lines": ["started"]} in seen and all(k["lines"][:1] in ([], ["started"]) for k in seen)


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
    step = gpu_suite.Step("install", 1, 30, ("{py}", "-c", f"open({str(ran)!r}, 'w')"),
                          reuse=lambda: (True, "same inputs"), done=lambda: calls.append("done"))
    rec = gpu_suite.run_step(step, str(tmp_path), 30, dry=False)
    assert rec["status"] == "ok" and rec["reused"] and not ran.exists() and calls == []
    step = gpu_suite.Step("install", 1, 30, step.argv, reuse=lambda: (False, "inputs changed"),
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
def test_deep_dry_run_of_the_whole_plan(tmp_path):
    """Each step's CPU check: the GPU tests collected as on the GPU image (without the optional
    packages: the same tests as with them), each bench's own dry run."""
    out = tmp_path / "out" / "gpu_day.json"
    rc = gpu_suite.main(["--dry-run", "--deep", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    res = json.loads(out.read_text())
    failed = {s["step"]: s.get("error_tail", s.get("error")) for s in res["steps"] if s["status"] != "planned"}
    assert rc == 0 and not failed, failed
    assert [s["step"] for s in res["steps"]] == [s.name for s in gpu_suite.STEPS]
    assert res["finished"] and {"device", "commit", "date", "torch"} <= set(res["provenance"])
    steps = {s["step"]: s for s in res["steps"]}
    # collected as the real step selects (-m gpu tests), checked by check_gpu_collection
    assert " -m gpu tests " in steps["gpu_tests"]["check"] + " " and "--collect-only" in steps["gpu_tests"]["check"]
    assert len(_files(out.parent)) <= 2
    # that collection ran where the optional packages cannot be imported (the GPU image's interpreter):
    # it collected exactly the GPU tests an interpreter with every package collects from the files that
    # carry a gpu mark (tests/tools/test_collect_without_optional.py: why)
    from test_collect_without_optional import _collect

    blocked = (tmp_path / "work" / "gpu_tests" / "gpu_tests-dry.log").read_text(errors="replace")
    full = _collect(["-m", "gpu", "-p", "no:cacheprovider", *gpu_suite.gpu_test_files()], dict(os.environ))
    want, got = gpu_suite.collected_gpu_tests(full.stdout), gpu_suite.collected_gpu_tests(blocked)
    assert len(want) > 0 and sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))


def test_the_dry_run_and_the_real_step_select_the_same_tests():
    step = next(s for s in gpu_suite.STEPS if s.name == "gpu_tests")
    real, dry = gpu_suite._expand(step.argv, "R"), gpu_suite._expand(step.dry_argv, "R")
    sel = gpu_suite._expand(gpu_suite.GPU_TEST_ARGS, "R")
    assert "tools.results_log" in sel  # the plugin loads in the CPU check too
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
