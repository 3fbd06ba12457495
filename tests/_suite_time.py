"""The suite's own time, recorded: a pytest plugin (``tests/conftest.py`` loads it) that, when
``$AREAL_FAST_SUITE_TIME`` names a file, appends one JSON line to it at the end of the session.

``.ci/run`` names ``bench/results/suite_time.jsonl``, so a clean-clone run leaves the measurement the
README quotes (``tests/package/test_docs_numbers.py`` checks the README against the newest row). A row:
``{"bench": "suite_time", "selection": the -m expression or "all", "passed", "failed", "skipped",
"xfailed", "xpassed", "errors", "tests_s": the session's seconds as pytest's summary line counts them,
"total_s": seconds since $AREAL_FAST_SUITE_START (``.ci/run``'s start, the install included) or null,
"not_slow_s" / "slow_s": the seconds (setup + call + teardown) of the tests without / with the
``slow`` mark, "not_slow_passed", "exitstatus", "workers": the worker processes (pytest-xdist's ``-n``; 1 without),
"provenance": bench.common.provenance()}``. With workers, the tier seconds add up the workers' and
exceed the session's.

Like a benchmark's, the row refuses a tree with uncommitted changes (checked at the session's start,
not after it ran) unless ``$AREAL_FAST_BENCH_ALLOW_DIRTY=1``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ENV = "AREAL_FAST_SUITE_TIME"
START_ENV = "AREAL_FAST_SUITE_START"
_IMPORTED = time.monotonic()
_STATE: dict = {}


def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput"):  # a worker of the suite: the process that started them writes
        return
    # taken out of the environment: the pytest sessions the tests start themselves (collections, GPU-suite dry
    # runs) are not the suite and must neither write a row nor see the tree this session's row will change
    path = os.environ.pop(ENV, None)
    if not path:
        return
    from bench.common import provenance, refuse_dirty

    try:
        refuse_dirty(path)
    except SystemExit as e:
        raise pytest.UsageError(f"${ENV}: {e}") from None
    _STATE.update(path=Path(path), t0=_IMPORTED, tiers={"slow": 0.0, "not_slow": 0.0}, not_slow_passed=0,
                  provenance=provenance(native=False))  # the commit tested, before the row itself dirties the tree


def pytest_runtest_logreport(report):
    if "path" not in _STATE:
        return
    tier = "slow" if "slow" in report.keywords else "not_slow"
    _STATE["tiers"][tier] += report.duration
    if tier == "not_slow" and report.when == "call" and report.passed:
        _STATE["not_slow_passed"] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if "path" not in _STATE:
        return
    stats = terminalreporter.stats
    start_pytest = getattr(terminalreporter, "_session_start", None)  # pytest's own "in N s" (pytest >= 8)
    tests_s = start_pytest.elapsed().seconds if start_pytest is not None else time.monotonic() - _STATE["t0"]
    start = os.environ.get(START_ENV)
    row = {"bench": "suite_time", "selection": config.option.markexpr or "all",
           **{k: len(stats.get(k, ())) for k in ("passed", "failed", "skipped", "xfailed", "xpassed")},
           "errors": len(stats.get("error", ())),
           "tests_s": round(tests_s, 1),
           "total_s": round(time.time() - float(start), 1) if start else None,
           "not_slow_s": round(_STATE["tiers"]["not_slow"], 1), "slow_s": round(_STATE["tiers"]["slow"], 1),
           "not_slow_passed": _STATE["not_slow_passed"], "exitstatus": int(exitstatus),
           "workers": getattr(config.option, "numprocesses", None) or 1,
           "provenance": _STATE["provenance"]}
    _STATE["path"].parent.mkdir(parents=True, exist_ok=True)
    with open(_STATE["path"], "a") as f:
        f.write(json.dumps(row) + "\n")
    terminalreporter.write_line(f"suite time: {row['tests_s']} s of tests appended to {_STATE['path']}")
