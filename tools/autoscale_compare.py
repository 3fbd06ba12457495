"""The server-count policy against every fixed split of the same servers, in real runs on this machine
(``bench/bench_autoscale_real.py``, ``docs/autoscale.md``): ``areal-fast train`` on the tiny recipe with
embedded servers and the local launcher, on the synthetic task whose strings lengthen over the run
(``data.synthetic.growth``), once with ``rollout.autoscale`` between 1 and ``max_servers`` servers and once
with each fixed count 1..``max_servers``, with the same seeds.

Each seed's warm start is built once, by its first run, and copied into the other runs' output directories
(the cache key is the same: only the server settings differ). The arms of a seed run one after the other in
an order that turns with the seed, so the machine's load falls on all alike; each row records the load
average around its run.

Per run: RL wall time (the run's time less its evaluations), held-out exact match (greedy, the held-out
rows spread evenly over the whole length range, so every length of the run weighs alike) at the end and
averaged over the evaluations after the start, the servers in the pool at each step, the largest staleness
of any step, and the policy's changes (step, new target, reason).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_reverse.yaml"

# The tiny recipe's strings lengthen over the run: median 3.6 characters at the start (the recipe's
# log_mean 0.5) to 14.2 at the end (mu 2.5), cut at 24; the centre moves over the rows of the run's
# steps (train.batch_size 16 prompts a step), in training order (so no shuffle). Every arm drops a group
# older than eta (strict staleness), so every trained step is within the bound.
BATCH = 16


def task_overrides(steps: int, end_log_mean: float = 2.5, max_len: int = 24) -> list[str]:
    rows = steps * BATCH
    return ["data.shuffle=false", f"data.synthetic.n_train={2 * rows}", f"data.synthetic.growth.rows={rows}",
            f"data.synthetic.growth.end_log_mean={end_log_mean}", f"data.synthetic.max_len={max_len}",
            "rollout.strict_staleness=true"]


def policy_overrides(max_servers: int, start: int) -> list[str]:
    # the tiny run's signals, as the real-run test's: a whole batch waiting when the trainer asks is "full";
    # staleness at half of eta (4) is "stale"
    return [f"rollout.n_servers={start}", "rollout.autoscale.enabled=true", "rollout.autoscale.min_servers=1",
            f"rollout.autoscale.max_servers={max_servers}", "rollout.autoscale.buffer_high=1",
            "rollout.autoscale.stale_high=0.5"]


def arms(max_servers: int, start: int) -> list[tuple[str, list[str]]]:
    return [("policy", policy_overrides(max_servers, start))] + \
        [(f"fixed{n}", [f"rollout.n_servers={n}"]) for n in range(1, max_servers + 1)]


def _runs_like(pattern: str) -> bool:
    """Whether another process whose command line holds ``pattern`` runs (the machine's other load)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if pattern in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    return True
            except OSError:
                continue
    return False


def read_run(out: Path) -> dict:
    """What one finished run measured (``metrics.jsonl``, ``summary.json``)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    changes = [{"step": r["step"], "target": r["autoscale/target"], "change": r["autoscale/change"],
                "reason": r["reason"]} for r in rows if r.get("kind") == "autoscale" and r["autoscale/change"]]
    summary = json.loads((out / "summary.json").read_text())
    servers = [int(r.get("sync/servers", 0)) for r in train]
    runs: list[list[int]] = []  # the pool per step, run-length encoded: [count, steps]
    for n in servers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    after = [e["eval_reward"] for e in evals if e["step"] > 0]
    return {"rl_s": round(summary["elapsed_s"] - summary["timers"].get("eval_s", 0.0), 2),
            "elapsed_s": round(summary["elapsed_s"], 2), "steps": len(train),
            "steps_contiguous": [r["step"] for r in train] == list(range(1, len(train) + 1)),
            "eval_first": evals[0]["eval_reward"] if evals else None,
            "eval_final": evals[-1]["eval_reward"] if evals else None,
            "eval_mean": sum(after) / len(after) if after else None,
            "evals": [[e["step"], e["eval_reward"]] for e in evals],
            "staleness_max": max((r["staleness_max"] for r in train), default=None),
            "wait_frac": sum(r["wait_s"] for r in train) / max(sum(r["wait_s"] + r["train_s"] + r["sync_s"]
                                                                  for r in train), 1e-9),
            "gen_len_first10": _mean([r["gen_len_mean"] for r in train[:10]]),
            "gen_len_last10": _mean([r["gen_len_mean"] for r in train[-10:]]),
            "server_steps": runs, "server_mean": _mean(servers), "changes": changes}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def run_arm(out: Path, seed: int, steps: int, eval_every: int, extra: list[str], warm: Path | None,
            recipe: Path = RECIPE, timeout_s: float = 1800) -> dict:
    """One ``areal-fast train`` run (the local launcher starts its embedded servers); ``warm``: a warm start
    to copy in first (None: the run builds it)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if warm is not None:
        shutil.copytree(warm, out / "warm_start")
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(recipe), f"experiment.seed={seed}",
           f"experiment.total_steps={steps}", f"experiment.output_dir={out}", "checkpoint.every_steps=0",
           "log.progress=false", "log.tensorboard=false", "log.plots=false", f"eval.every_steps={eval_every}",
           "weights.method=distributed", *task_overrides(steps), *extra]
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=log, timeout=timeout_s)
    return read_run(out)


def compare(out_dir: str | Path, seeds: list[int], steps: int, max_servers: int, start: int, eval_every: int,
            other_load: str = "bench_mismatch_ablation"):
    """Every arm for every seed; yields one row per (seed, arm) as it finishes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = arms(max_servers, start)
    for seed in seeds:
        k = seed % len(plan)
        order = plan[k:] + plan[:k]
        warm = None
        for arm, extra in order:
            out = out_dir / f"s{seed}_{arm}"
            load0, t0 = os.getloadavg(), time.time()
            try:
                res = run_arm(out, seed, steps, eval_every, extra, warm)
            except subprocess.CalledProcessError as e:  # once more: a run may die starting up on a loaded machine
                print(f"seed {seed} {arm}: the run failed ({e.returncode}), see {out}.log; running it again",
                      flush=True)
                shutil.copy(out.parent / f"{out.name}.log", out.parent / f"{out.name}.failed.log")
                res = run_arm(out, seed, steps, eval_every, extra, warm)
                res["retried"] = True
            if warm is None:
                warm = out / "warm_start"
            row = {"seed": seed, "arm": arm, "servers": None if arm == "policy" else int(arm[len("fixed"):]),
                   "policy_bounds": [1, max_servers] if arm == "policy" else None,
                   "start_servers": start if arm == "policy" else int(arm[len("fixed"):]),
                   "total_steps": steps, "eval_every": eval_every, "eta": 4, **res,
                   "load_1m_start": round(load0[0], 2), "load_1m_end": round(os.getloadavg()[0], 2),
                   "other_load_running": _runs_like(other_load), "started": t0}
            print(json.dumps({k: v for k, v in row.items() if k not in ("evals",)}), flush=True)
            yield row


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm over seeds: the means of the quoted numbers (the docs' table)."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        out.append({"arm": arm, "seeds": len(rs), **{k: _mean([r[k] for r in rs if r[k] is not None])
                                                     for k in ("rl_s", "eval_final", "eval_mean", "server_mean",
                                                               "staleness_max")}})
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.bench_autoscale_real``: rows to ``bench/results/autoscale_real.jsonl``, one per run as
    it finishes (a partial sweep counts), then the per-arm means."""
    import argparse

    from bench.common import add_harness_args, append_rows, print_table, provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds; every arm runs each")
    ap.add_argument("--steps", type=int, default=80, help="trainer steps of each run (the growth spans them)")
    ap.add_argument("--max-servers", type=int, default=2, help="the policy's maximum and the largest fixed split")
    ap.add_argument("--start", type=int, default=2, help="servers the policy's run starts with")
    ap.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N steps (and at 0)")
    ap.add_argument("--out", default="runs/autoscale_real", help="the runs' output directories")
    ap.add_argument("--run", default=None, help="the sweep's stamp for the rows (default: now); an earlier sweep's "
                    "stamp adds seeds to it (the docs read the newest stamp's rows)")
    a = add_harness_args(ap, dry_run="print the arms and their overrides, run nothing").parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    if not 1 <= a.start <= a.max_servers:
        ap.error(f"--start: must be in 1..--max-servers ({a.max_servers}), got {a.start}")
    if a.dry_run:
        for arm, extra in arms(a.max_servers, a.start):
            print(arm, " ".join([*task_overrides(a.steps), *extra]))
        return
    stamp = a.run or time.strftime("%Y%m%d_%H%M", time.gmtime())
    prov = provenance()  # the tree as the sweep starts (its own rows then make the results file differ)
    rows = []
    for row in compare(a.out, seeds, a.steps, a.max_servers, a.start, a.eval_every):
        rows.append(row)
        if not a.no_results:
            append_rows("autoscale_real", [{"run": stamp, **row}], a.results, prov=prov)
    print_table(summarize(rows))
