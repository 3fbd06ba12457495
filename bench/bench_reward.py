"""Reward service throughput and overhead: math (plain numbers and LaTeX) and code rewards/s through
the service against direct calls, a no-op reward's overhead one call at a time and many in flight,
and the sandbox's cost per run (interpreter start, sandboxed run with and without a cgroup).

    python bench/bench_reward.py [--n 400] [--workers N] [--results DIR | --no-results | --dry-run]

Rows go to bench/results/reward.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_fast.reward import RewardService, sandbox  # noqa: E402
from areal_fast.reward.cgroup import RunCgroup  # noqa: E402
from areal_fast.reward.code import code_reward  # noqa: E402
from areal_fast.reward.math import math_reward  # noqa: E402
from areal_fast.reward.sandbox import SandboxLimits, isolation  # noqa: E402
from bench.common import add_harness_args, print_dry_run, print_table, save, time_fn  # noqa: E402


def noop(task, completion):
    """The no-op reward used to measure the service's own cost per call."""
    return 1.0


MATH_NUMBERS = [({"reward": "math", "answer": str(i)}, f"... so the answer is \\boxed{{{i + i % 2}}}.")
                for i in range(64)]
MATH_LATEX = [({"reward": "math", "answer": f"\\frac{{{i}}}{{{i + 1}}}"},
               f"we get $\\boxed{{\\dfrac{{{2 * i}}}{{{2 * i + 2}}}}}$") for i in range(1, 65)]
CODE = ({"reward": "code", "tests": [{"input": "2 3\n", "output": "5\n"}]},
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```")


async def service_rate(svc: RewardService, items: list, n: int) -> tuple[float, dict]:
    calls = [items[i % len(items)] for i in range(n)]
    t = time.perf_counter()
    results = await asyncio.gather(*(svc.score(task, c) for task, c in calls))
    dt = time.perf_counter() - t
    statuses = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return n / dt, statuses


def direct_rate(fn, items: list, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        task, c = items[i % len(items)]
        fn(task, c)
    return n / (time.perf_counter() - t)


async def run(args) -> list[dict]:
    rows = []
    async with RewardService(num_workers=args.workers, timeout_s=30) as svc:
        # warm-up: every worker touches math-verify and the sandbox once
        await service_rate(svc, MATH_LATEX, 4 * svc.num_workers)
        await service_rate(svc, [CODE], 2 * svc.num_workers)
        for name, items, fn in (("math (plain numbers, fast path)", MATH_NUMBERS, math_reward),
                                ("math (LaTeX, math-verify)", MATH_LATEX, math_reward)):
            direct_rate(fn, items, 8)  # warm this process
            rate, st = await service_rate(svc, items, args.n)
            rows.append({"reward": name, "service_per_s": rate, "direct_1proc_per_s": direct_rate(fn, items, args.n),
                         "statuses": str(st)})
        n_code = max(args.n // 8, 16)
        rate, st = await service_rate(svc, [CODE], n_code)
        rows.append({"reward": "code (trivial, 1 stdio test)", "service_per_s": rate,
                     "direct_1proc_per_s": direct_rate(code_reward, [CODE], n_code // 2), "statuses": str(st)})

        noop_task = ({"reward": "bench_reward:noop"}, "x")
        lat = []
        for _ in range(args.n):
            t = time.perf_counter()
            await svc.score(*noop_task)
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(args.n):
            noop(*noop_task)
        direct_us = (time.perf_counter() - t) / args.n * 1e6
        rate, st = await service_rate(svc, [noop_task], args.n * 4)
        rows.append({"reward": "no-op: overhead per call", "service_per_s": rate,
                     "direct_1proc_per_s": 1e6 / direct_us, "statuses": str(st),
                     "latency_median_us": statistics.median(lat) * 1e6,
                     "latency_p99_us": sorted(lat)[int(0.99 * len(lat))] * 1e6})
        print("service stats:", {k: v for k, v in svc.stats().items() if k != "by_reward"})
    cols = ["reward", "service_per_s", "direct_1proc_per_s", "latency_median_us", "latency_p99_us", "statuses"]
    return [{c: r.get(c, "") for c in cols} for r in rows]


def sandbox_cases(iso: sandbox.Isolation) -> list[tuple[str, object]]:
    """(name, fn) of the per-run costs, one run at a time."""
    argv = [iso.python, "-I", "-c", "pass"]
    limits = SandboxLimits()

    def checked(i):
        def fn():
            r = sandbox._run(i, argv, b"", {}, limits)
            assert r.ok, r
        return fn

    bare_no_site = [iso.python, "-I", "-S", "-c", "pass"]  # the host's site-packages (.pth files) excluded
    cases = [("interpreter start, bare", lambda: subprocess.run(argv, check=True)),
             ("interpreter start, bare, no site", lambda: subprocess.run(bare_no_site, check=True)),
             (f"sandboxed run ({iso.mode}, {'cgroup' if iso.cgroup else 'RLIMIT fallback'})", checked(iso))]
    if iso.cgroup is not None:
        cases.append((f"sandboxed run ({iso.mode}, RLIMIT fallback)", checked(dataclasses.replace(iso, cgroup=None))))
        sup = iso.cgroup
        cases.append((f"run cgroup create + remove (v{sup.version})",
                      lambda: RunCgroup(sup, memory_bytes=1 << 30, pids_max=33).remove()))
    return cases


def sandbox_rows(iso: sandbox.Isolation, reps: int) -> list[dict]:
    """Wall time per run, and the CPU time of the run's processes (less sensitive to a busy machine)."""
    rows = []
    for name, fn in sandbox_cases(iso):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time_fn(fn, warmup=3, reps=reps, cuda=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / (reps + 3) * 1e3
        rows.append({"sandbox": name, "median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
                     "runs_per_s": 1e3 / t.median_ms, "child_cpu_ms": cpu, "reps": reps,
                     "loadavg_1m": os.getloadavg()[0]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="calls per measurement (code uses n/8, sandbox rows n/10)")
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count)")
    add_harness_args(ap)
    args = ap.parse_args()
    iso = isolation()
    cg = iso.cgroup.describe() if iso.cgroup else "none (RLIMIT fallback)"
    print(f"sandbox: mode {iso.mode}, python {iso.python}, {len(iso.layout)} root layout entries, cgroup: {cg}")
    if args.dry_run:
        print_dry_run("reward", [{"case": name} for name, _ in sandbox_cases(iso)]
                      + [{"case": "service rates: math numbers, math LaTeX, code, no-op", "n": args.n}])
        return
    rows = asyncio.run(run(args))
    print_table(rows)
    sb = sandbox_rows(iso, max(args.n // 10, 10))
    print_table(sb)
    save("reward", rows + sb, args)


if __name__ == "__main__":
    main()
