"""The benchmark harness every ``bench/`` script uses (docs/benchmarks.md, "The harness"): timing
(:func:`time_fn`), provenance (:func:`provenance`), result rows (:func:`append_rows`, :func:`save`), the
shared options (:func:`add_harness_args`) and the refusal of a dirty tree (:func:`refuse_dirty`), a
process tree read from ``/proc`` (:func:`proc_children` and friends), stand-in servers in a spawned
process (:func:`server_process`) and datasheet peaks (:func:`device_peaks`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parents[1]
ALLOW_DIRTY_ENV = "AREAL_FAST_BENCH_ALLOW_DIRTY"  # set by --allow-dirty; a bench's own subprocesses inherit it

# Datasheet peaks (SXM parts): HBM GB/s and dense bf16 tensor-core TFLOP/s. H200 has the H100's
# compute with HBM3e. Matched by substring of torch.cuda.get_device_name().
_PEAKS = {"H200": (4800.0, 989.0), "H100": (3350.0, 989.0), "A100": (2039.0, 312.0)}


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    peak_mem_bytes: int | None = None  # device memory above the start, when asked for

    def as_row(self, prefix: str = "") -> dict:
        return {f"{prefix}{k}": v for k, v in asdict(self).items() if v is not None and k != "reps"}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_fn(fn: Callable[[], object], *, warmup: int = 2, reps: int = 10, cuda: bool | None = None,
            memory: bool = False) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``reps`` timed ones (see the module docstring).

    ``cuda=None`` uses CUDA events when torch sees a GPU. ``memory=True`` (GPU) also reports the
    peak allocated bytes above what was allocated before the timed calls.
    """
    if reps < 1:
        raise ValueError(f"time_fn: reps must be >= 1, got {reps}")
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    times = []
    peak = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        if memory:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        if memory:
            peak = torch.cuda.max_memory_allocated() - base
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), _percentile(times, 0.1), _percentile(times, 0.9), reps, peak)


def git_commit() -> str:
    """``git rev-parse --short HEAD`` (``-dirty`` with uncommitted changes), or "unknown" without git."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                             timeout=10)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


COMMIT_ENV = "AREAL_FAST_COMMIT"


def commit_and_source() -> tuple[str, str]:
    """The commit measured and where it was read: ``git``, else ``$AREAL_FAST_COMMIT`` (passed in,
    e.g. ``gpu_suite.py --commit``), else the installed build's ``areal_fast._build_info`` (CMake
    writes it at build time), else ``("unknown", "none")``. A GPU machine may get a copy of the
    working tree without ``.git``, so ``git`` alone would leave every result unnamed."""
    commit = git_commit()
    if commit != "unknown":
        return commit, "git"
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV], COMMIT_ENV
    try:
        from areal_fast import _build_info

        if _build_info.COMMIT and _build_info.COMMIT != "unknown":
            return _build_info.COMMIT, "build"
    except Exception:  # noqa: BLE001 - not built by CMake yet, or an older build without the file
        pass
    return "unknown", "none"


def provenance(native: bool = True) -> dict:
    """Where and with what a number was measured. ``native=False`` leaves out whether areal_fast's
    ``_C`` has CUDA (so as not to load a ``_C`` that an install is about to replace)."""
    commit, source = commit_and_source()
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "commit_from": source,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": "cpu",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name()
            info["device_count"] = torch.cuda.device_count()
            info["cuda"] = torch.version.cuda
            info["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
    except ImportError:
        pass
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    if native:
        try:
            from areal_fast import dispatch

            info["areal_fast_cuda_core"] = bool(dispatch.native().has_cuda())
        except Exception:  # noqa: BLE001 - provenance never fails a benchmark
            pass
    return info


def device_peaks(device_name: str) -> dict:
    """``{"hbm_gbs": ..., "bf16_tflops": ...}`` from the datasheet for a known device, else Nones."""
    for key, (gbs, tflops) in _PEAKS.items():
        if key in device_name:
            return {"hbm_gbs": gbs, "bf16_tflops": tflops}
    return {"hbm_gbs": None, "bf16_tflops": None}


def append_rows(name: str, rows: list[dict], results_dir: str | os.PathLike | None = None,
                prov: dict | None = None) -> Path:
    """Append ``rows`` (with ``bench`` and ``provenance`` added) to ``<results_dir>/<name>.jsonl``."""
    if not name or "/" in name:
        raise ValueError(f"append_rows: bad benchmark name {name!r}")
    prov = provenance() if prov is None else prov
    path = Path(results_dir) if results_dir is not None else RESULTS_DIR
    refuse_dirty(path, prov.get("commit"))
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"{name}.jsonl"
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({"bench": name, **row, "provenance": prov}, default=str) + "\n")
    return path


def save_run(name: str, title: str, rows: list[dict], meta: dict, md: str, results_dir: str | os.PathLike,
             stamp: str, prov: dict) -> None:
    """A measured run's three results: ``<name>_<stamp>.json`` (rows, settings, provenance), ``.md``
    (``title``, the settings, the table ``md``) and its rows, with the settings, in ``<name>.jsonl``."""
    res = Path(results_dir)
    refuse_dirty(res, prov.get("commit"))
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{name}_{stamp}.json").write_text(json.dumps({"rows": rows, "settings": meta, "provenance": prov},
                                                         indent=1))
    (res / f"{name}_{stamp}.md").write_text(f"# {title}\n\n{json.dumps(meta)}\n\n{md}")
    append_rows(name, [{**r, **meta} for r in rows], res, prov)


def refuse_dirty(path: str | os.PathLike, commit: str | None = None) -> None:
    """Refuse (SystemExit) to write results into the repository from a tree with uncommitted changes:
    a committed number must name the commit that measured it. ``--allow-dirty`` (or
    ``$AREAL_FAST_BENCH_ALLOW_DIRTY=1``) lets it through, the commit stamped ``-dirty``. Results
    written outside the repository (a test's temporary folder) are not refused."""
    commit = git_commit() if commit is None else commit
    if not commit.endswith("-dirty") or os.environ.get(ALLOW_DIRTY_ENV) == "1":
        return
    if Path(path).resolve().is_relative_to(REPO):
        raise SystemExit(f"refusing to write results to {path} from a tree with uncommitted changes "
                         f"({commit}): commit first, or pass --allow-dirty to stamp them {commit!r}")


class _AllowDirty(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        os.environ[ALLOW_DIRTY_ENV] = "1"
        setattr(namespace, self.dest, True)


def add_harness_args(ap: argparse.ArgumentParser, *, results: bool = True,
                     dry_run: str = "build and print the cases with their estimated sizes, run nothing"
                     ) -> argparse.ArgumentParser:
    """The options every script shares: ``--allow-dirty``; with ``results``, ``--results DIR`` and
    ``--no-results``; with a ``dry_run`` help text, ``--dry-run``. With ``results``, parsing refuses
    a dirty tree at once (:func:`refuse_dirty`) unless nothing will be written, not after the run."""
    ap.add_argument("--allow-dirty", action=_AllowDirty, nargs=0, default=False,
                    help="write results from a tree with uncommitted changes (stamped -dirty)")
    if results:
        ap.add_argument("--results", default=str(RESULTS_DIR), metavar="DIR",
                        help="append result rows to DIR/<bench>.jsonl (default: bench/results)")
        ap.add_argument("--no-results", action="store_true", help="print only; write no result rows")
    if dry_run:
        ap.add_argument("--dry-run", action="store_true", help=dry_run)
    if results:
        parse = ap.parse_args

        def parse_and_check(*a, **kw):
            args = parse(*a, **kw)
            if not args.no_results and not getattr(args, "dry_run", False):
                refuse_dirty(args.results)
            return args

        ap.parse_args = parse_and_check
    return ap


def csv_list(choices=None, cast=str):
    """An argparse type: a comma-separated list (empty items dropped), each ``cast`` and, with ``choices``,
    one of them (else the error names the culprit)."""
    def parse(text: str) -> list:
        items = [cast(x.strip()) for x in text.split(",") if x.strip()]
        if choices is not None and (bad := [x for x in items if x not in choices]):
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(map(str, choices))}")
        return items
    return parse


def save(name: str, rows: list[dict], args: argparse.Namespace, prov: dict | None = None) -> Path | None:
    """Append the rows unless ``--no-results`` / ``--dry-run``; prints where they went."""
    if getattr(args, "no_results", False) or getattr(args, "dry_run", False) or not rows:
        return None
    path = append_rows(name, rows, args.results, prov)
    print(f"appended {len(rows)} rows to {path}")
    return path


def print_dry_run(name: str, cases: list[dict]) -> None:
    print(f"[dry-run] {name}: {len(cases)} cases")
    for c in cases:
        print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in c.items()))


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ----------------------------------------------------------------------------- processes (Linux /proc)


def proc_children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def proc_cmdline(pid: int) -> str:
    """The command line of ``pid``, space-separated ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def proc_ppid(pid: int) -> int:
    """The parent of ``pid`` (-1 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def proc_alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie waiting for its reaper counts as gone)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ----------------------------------------------------------------------------- stand-in servers


def serve_until_stopped(handle, port_q, stop_ev, client_max_size: int = 1 << 20) -> None:
    """In the server's process: serve ``handle`` (an aiohttp handler) for every method and path on
    127.0.0.1, at a free port put on ``port_q``, until ``stop_ev`` is set."""
    import asyncio

    from aiohttp import web

    async def amain():
        app = web.Application(client_max_size=client_max_size)
        app.router.add_route("*", "/{t:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(site._server.sockets[0].getsockname()[1])
        while not stop_ev.is_set():
            await asyncio.sleep(0.1)
        await runner.cleanup()

    asyncio.run(amain())


@contextlib.contextmanager
def server_process(target: Callable, args: tuple = (), start_timeout_s: float = 60.0):
    """Run ``target(*args, port_q, stop_ev)`` (which ends in :func:`serve_until_stopped`) in a spawned
    process; yields its URL once it reported its port; at the end asks it to stop, and kills it
    after 10 s."""
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, q, stop), daemon=True)
    proc.start()
    try:
        yield f"http://127.0.0.1:{q.get(timeout=start_timeout_s)}"
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
