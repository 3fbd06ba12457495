"""A pytest plugin that writes each test's result the moment it is known, for a run that may be killed.

    python -m pytest -p tools.results_log --results-log FILE ...

One JSON line per event, flushed as it is written, so a run killed at any point (the GPU day's
``gpu_tests`` step cut at its deadline) leaves every finished test's outcome and the test it was in:
``{"start": id}`` when a test begins, ``{"id", "outcome", "seconds"[, "error"]}`` when its setup,
call and teardown are over (``outcome``: passed, failed, error (setup or teardown), skipped), and
``{"collect_error": id}`` for a module that cannot be collected, ``{"exitstatus": n}`` at the end.
JUnit XML, by contrast, is written only when the session ends. :func:`read_results_log` reads the
file back, a line cut short by the kill included.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

ERROR_CHARS = 600  # of a failure's report, kept per failed test


def pytest_addoption(parser):
    parser.addoption("--results-log", default=None, metavar="FILE",
                     help="append one JSON line per test as it finishes (tools/results_log.py)")


def pytest_configure(config):
    path = config.getoption("--results-log")
    if path and not hasattr(config, "workerinput"):  # xdist workers report to the controller
        config.pluginmanager.register(_ResultsLog(Path(path)), "results_log_writer")


class _ResultsLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the whole session)
        self.reports: dict[str, list] = {}
        self.started: dict[str, float] = {}

    def _write(self, rec: dict) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def pytest_runtest_logstart(self, nodeid, location):
        self.started[nodeid] = time.perf_counter()
        self._write({"start": nodeid})

    def pytest_runtest_logreport(self, report):
        self.reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        reports = self.reports.pop(nodeid, [])
        outcome, error = "passed", None
        for r in reports:
            if r.failed:
                outcome = "failed" if r.when == "call" else "error"
                error = error or r.longreprtext[-ERROR_CHARS:]
            elif r.skipped and outcome == "passed":
                outcome = "skipped"
        rec = {"id": nodeid, "outcome": outcome,
               "seconds": round(time.perf_counter() - self.started.pop(nodeid, time.perf_counter()), 2)}
        if error:
            rec["error"] = error
        self._write(rec)

    def pytest_collectreport(self, report):
        if report.failed:
            self._write({"collect_error": report.nodeid or "<session>", "error": report.longreprtext[-ERROR_CHARS:]})

    def pytest_sessionfinish(self, session, exitstatus):
        self._write({"exitstatus": int(exitstatus)})

    def pytest_unconfigure(self, config):
        self.file.close()


def read_results_log(path: Path) -> dict | None:
    """What a results log says, or None when there is none: every finished test's
    ``[id, outcome, seconds]`` in order (``tests``), the counts, the failed and erroring ids with
    their errors, collection errors, the tests that had started and not finished (``running``: the
    ones a kill cut short) and whether the session ended (``finished``)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    tests, errors, collect_errors, running, status = [], {}, [], {}, None
    for ln in lines:
        try:
            rec = json.loads(ln)
        except ValueError:  # the last line, cut short by the kill
            continue
        if "start" in rec:
            running[rec["start"]] = True
        elif "id" in rec:
            tests.append([rec["id"], rec["outcome"], rec.get("seconds")])
            if rec.get("error"):
                errors[rec["id"]] = rec["error"]
            running.pop(rec["id"], None)
        elif "collect_error" in rec:
            collect_errors.append(rec["collect_error"])
        elif "exitstatus" in rec:
            status = rec["exitstatus"]
    counts = {k: sum(t[1] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    bad = [t[0] for t in tests if t[1] in ("failed", "error")]
    return {"finished": status is not None, "exitstatus": status, "running": list(running), **counts,
            "failed_ids": bad, "errors": {i: errors[i] for i in bad if i in errors}, "collect_errors": collect_errors,
            "tests": tests}
