"""Shared helpers of the benchmark scripts: provenance (device, versions, commit, date) and
result files under bench/results/."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """Where and with what a number was measured."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name()
            info["cuda"] = torch.version.cuda
        else:
            info["device"] = "cpu"
    except ImportError:
        info["device"] = "cpu"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def write_result(name: str, rows: list[dict], out: str | os.PathLike | None = None) -> Path:
    """Write ``{"provenance": ..., "rows": rows}`` as JSON; default path bench/results/<name>-<device>.json."""
    prov = provenance()
    if out is None:
        device = prov["device"].replace(" ", "_").replace("/", "_")
        out = RESULTS_DIR / f"{name}-{device}.json"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=2) + "\n")
    return out


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
