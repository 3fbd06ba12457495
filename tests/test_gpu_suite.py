"""The GPU suite's plan and its dry run: every step is found and every benchmark parses its arguments."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    assert sum(s.limit_s for s in gpu_suite.STEPS) <= gpu_suite.BUDGET_S == 20 * 60
    for s in gpu_suite.STEPS:
        for f in s.needs:
            assert (ROOT / f).exists(), f"step {s.name} needs {f}"
    assert gpu_suite.gpu_test_files(), "no test file carries a gpu mark"


def test_parts_fit_a_ten_minute_command_and_cover_every_step():
    limits = {s.name: s.limit_s for s in gpu_suite.STEPS}
    for part, steps in gpu_suite.PARTS.items():
        assert sum(limits[s] for s in steps) <= gpu_suite.PART_BUDGET_S < 600, part
        assert steps[0] in ("env", "install") and "install" in steps, f"part {part} must build the package first"
    assert {s for steps in gpu_suite.PARTS.values() for s in steps} == set(limits)


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
    assert res["dry_run"] and {"device", "commit", "date", "torch"} <= set(res["provenance"])
