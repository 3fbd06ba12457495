"""The sweep harness of the training-loop ablations (``bench_staleness``, ``bench_mismatch_ablation``,
``bench_pause_modes_cpu``): arms x seeds, each run one ``run_train`` of a recipe in a forked child,
warm starts built once per seed, one server set per seed reset between runs, ``--resume``, paired
statistics with 95 % t intervals and the report's files. A driver supplies its arms (``name``,
``overrides()``, optionally ``server_overrides()``) and its summary (docs/staleness_ablation.md).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import add_harness_args, append_rows, csv_list, print_dry_run, provenance, refuse_dirty

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "tiny_reverse.yaml"
# Settings of every run that are not the recipe's business: no checkpoints, plots or TensorBoard files
# (time and disk), no progress bar (the sweep prints one line per run), and a fresh start.
RUN_SETTINGS = ("experiment.resume=false", "checkpoint.every_steps=0", "checkpoint.save_hf=false",
                "log.tensorboard=false", "log.progress=false", "log.plots=false")
DIAGNOSTICS = ("behav_kl", "clip_fraction", "token_mis_masked_fraction", "approx_kl", "tis_truncated_fraction",
               "seq_mis_masked_fraction", "m2po_masked_fraction", "mismatch_k3")


@dataclass(frozen=True)
class Run:
    arm: Any  # the driver's arm: name, eta, objective, advantage, overrides()
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}_s{self.seed}"


def run_overrides(run: Run, steps: int, eval_every: int, extra=(), batch_size: int | None = None) -> list[str]:
    """The dotted overrides of one run on top of the recipe: the sweep's settings, ``extra`` (the user's
    word wins except over the arm's own keys, which are what the sweep varies), the arm's, the seed."""
    batch = [] if batch_size is None else [f"train.batch_size={batch_size}"]
    return [*RUN_SETTINGS, f"experiment.total_steps={steps}", f"eval.every_steps={eval_every}", *batch, *extra,
            *run.arm.overrides(), f"experiment.seed={run.seed}"]


# ----------------------------------------------------------------------------- per-run result


def staleness_hist(train_rows: list[dict]) -> dict[int, int]:
    """Trained groups per staleness value, from the per-step ``staleness`` lists of metrics.jsonl."""
    return dict(sorted(Counter(int(s) for r in train_rows for s in r["staleness"]).items()))


def at_bound_fraction(train_rows: list[dict], eta: int) -> float | None:
    """Share of trained groups as stale as the bound allows at their step, min(eta, step - 1)."""
    n = hit = 0
    for r in train_rows:
        bound = min(eta, r["step"] - 1)
        n += len(r["staleness"])
        hit += sum(1 for s in r["staleness"] if s >= bound)
    return hit / n if n else None


def hist_stats(hist: dict) -> dict:
    hist = {int(k): v for k, v in hist.items()}
    n = sum(hist.values())
    if n == 0:
        return {"mean": None, "max": None, "groups": 0}
    return {"mean": sum(k * v for k, v in hist.items()) / n, "max": max(k for k, v in hist.items() if v),
            "groups": n}


def summarise_run(run: Run, rows: list[dict], wall_s: float) -> dict:
    """One run's result from its metrics.jsonl rows."""
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not train or not evals:
        raise ValueError(f"{run.name}: metrics.jsonl has {len(train)} train and {len(evals)} eval rows")
    trained = [e["eval_reward"] for e in evals if e["step"] > 0]
    hist = staleness_hist(train)
    st = hist_stats(hist)
    return {
        "run": run.name, "arm": run.arm.name, "eta": run.arm.eta, "objective": run.arm.objective,
        "advantage": run.arm.advantage, "seed": run.seed, "steps": train[-1]["step"],
        "eval_first": evals[0]["eval_reward"], "eval_final": evals[-1]["eval_reward"],
        "eval_best": max(trained) if trained else evals[-1]["eval_reward"],
        "eval_curve": [[e["step"], e["eval_reward"]] for e in evals],
        "train_reward_curve": [[r["step"], r["reward"]] for r in train],
        "trained_samples": sum(len(r.get("staleness", ())) for r in train),  # groups; times group_size below
        "trained_samples_per_s": train[-1]["trained_samples_per_s"],
        "elapsed_s": train[-1]["time"], "wall_s": wall_s,
        "staleness_hist": {str(k): v for k, v in hist.items()}, "staleness_mean": st["mean"],
        "staleness_max": st["max"], "staleness_at_bound_fraction": at_bound_fraction(train, run.arm.eta),
        "dropped_stale": train[-1].get("dropped_stale", 0),
        # how off-policy the data was and how much the trust region acted (means over steps)
        **{f"{k}_mean": _mean_of(train, f"train/{k}") for k in DIAGNOSTICS},
    }


def _mean_of(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return statistics.fmean(xs) if xs else None


# ----------------------------------------------------------------------------- statistics


def mean_spread(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation over seeds (spread 0 for one seed)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


# two-sided 95 % quantile of Student's t by degrees of freedom (1-10); 1.96 beyond 30
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def ci95_halfwidth(xs: list[float]) -> float | None:
    """Half-width of the 95 % t confidence interval of the mean (None below 2 values)."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    df = len(xs) - 1
    t = _T975.get(df, 2.04 if df <= 30 else 1.96)  # 2.04 ~ t(30): conservative between 11 and 30
    return t * statistics.stdev(xs) / math.sqrt(len(xs))


def eval_mean(result: dict) -> float:
    """Mean held-out EM over the evaluations after step 0 (the area under the learning curve)."""
    xs = [v for s, v in result["eval_curve"] if s > 0] or [result["eval_final"]]
    return statistics.fmean(xs)


def mean_curve(curves: list[list]) -> list[list]:
    """Mean over seeds at each step that every curve has."""
    steps = set.intersection(*(set(s for s, _ in c) for c in curves)) if curves else set()
    return [[s, statistics.fmean(v for c in curves for t, v in c if t == s)] for s in sorted(steps)]


_METRICS = (("eval_final", lambda x: x["eval_final"]), ("eval_mean", eval_mean))


def _diff_stats(row: dict, deltas_by_key: dict[str, list[float]]) -> dict:
    for key, deltas in deltas_by_key.items():
        row[f"{key}_diff_mean"], row[f"{key}_diff_spread"] = mean_spread(deltas)
        row[f"{key}_diff_ci95"] = ci95_halfwidth(deltas)
    return row


def contrast(results: list[dict], a: str = "recompute", b: str = "naive") -> list[dict]:
    """Objective ``a`` minus objective ``b`` at each eta and advantage, paired by seed: final EM and mean
    EM over the run, with 95 % t intervals. Where two or more stale etas have pairs, a last row per
    advantage (``eta = "pooled"``) averages each seed's differences over them first; a seed enters it
    only if it has a pair at every one of those etas."""
    runs = {(r["objective"], r["eta"], r["advantage"], r["seed"]): r for r in results}
    out = []
    for adv in sorted({r["advantage"] for r in results}):
        per_eta: dict[int, dict[int, tuple[dict, dict]]] = {}
        for eta in sorted({r["eta"] for r in results if r["advantage"] == adv}):
            pairs = {s: (runs[(a, eta, adv, s)], runs[(b, eta, adv, s)]) for (o, e, d, s) in runs
                     if o == a and e == eta and d == adv and (b, eta, adv, s) in runs}
            if not pairs:
                continue
            per_eta[eta] = pairs
            row = {"eta": eta, "advantage": adv, "a": a, "b": b, "seeds": sorted(pairs)}
            out.append(_diff_stats(row, {k: [f(x) - f(y) for x, y in pairs.values()] for k, f in _METRICS}))
        stale = [e for e in per_eta if e > 0]
        seeds = sorted(set.intersection(*(set(per_eta[e]) for e in stale))) if len(stale) > 1 else []
        if seeds:
            row = {"eta": "pooled", "etas": stale, "advantage": adv, "a": a, "b": b, "seeds": seeds}
            out.append(_diff_stats(row, {k: [statistics.fmean(f(per_eta[e][s][0]) - f(per_eta[e][s][1])
                                                              for e in stale) for s in seeds]
                                         for k, f in _METRICS}))
    return out


# ----------------------------------------------------------------------------- work directory


def sweep_key(config: str, steps: int, eval_every: int, extra: list[str], servers: str = "shared",
              batch_size: int | None = None) -> dict:
    """What every run of a sweep shares; a resumed sweep must have the same."""
    text = Path(config).read_text()
    return {"config": str(Path(config).resolve()), "config_sha1": hashlib.sha1(text.encode()).hexdigest()[:12],
            "steps": steps, "batch_size": batch_size, "eval_every": eval_every, "overrides": list(extra),
            "servers": servers}


def open_work_dir(work: Path, key: dict, resume: bool) -> None:
    """Create the sweep's directory, or check that the one to resume ran the same settings."""
    marker = work / "sweep.json"
    if marker.is_file():
        if not resume:
            raise SystemExit(f"sweep: {work} already holds a sweep; pass --resume {work} to continue it "
                             f"or choose another --work")
        old = json.loads(marker.read_text())
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        if diff:
            raise SystemExit(f"sweep: cannot resume {work}: its {', '.join(diff)} differ "
                             f"({', '.join(f'{k}: {old.get(k)!r} -> {key.get(k)!r}' for k in diff)})")
        return
    if resume:
        raise SystemExit(f"sweep: --resume {work}: no sweep there (no sweep.json)")
    work.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(key, indent=1) + "\n")


def result_path(work: Path, run: Run) -> Path:
    return work / "results" / f"{run.name}.json"


def pending(runs: list[Run], work: Path) -> list[Run]:
    """The runs without a result file (a finished run is never run again)."""
    return [r for r in runs if not result_path(work, r).is_file()]


def load_results(runs: list[Run], work: Path) -> list[dict]:
    return [json.loads(result_path(work, r).read_text()) for r in runs if result_path(work, r).is_file()]


def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def warm_dir(work: Path, seed: int) -> Path:
    return work / "warm" / f"seed{seed}"


# ----------------------------------------------------------------------------- running


def _build_warm_start(config: str, overrides: list[str], work: Path, seed: int) -> None:
    import torch

    from areal_fast.config import load_config
    from areal_fast.launch.train import model_dir

    torch.set_num_threads(1)  # one core each; seeds are built side by side
    model_dir(load_config(config, [*overrides, f"experiment.seed={seed}",
                                   f"experiment.output_dir={warm_dir(work, seed)}"]))


def build_warm_starts(config: str, overrides: list[str], work: Path, seeds) -> dict[int, Path]:
    """Each seed's warm-started model, built side by side in forked children (the parent runs no torch
    op). A cached one is checked against the recipe's warm-start signature and rebuilt if it differs."""
    ctx = multiprocessing.get_context("fork")
    procs = {s: ctx.Process(target=_build_warm_start, args=(config, overrides, work, s), name=f"warm_start_seed{s}")
             for s in seeds}
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.join()
    out = {}
    for s, p in procs.items():
        path = warm_dir(work, s) / "warm_start"
        if p.exitcode != 0 or not path.is_dir():
            raise RuntimeError(f"warm start of seed {s} failed (exit code {p.exitcode}); see {work / 'warm'}")
        out[s] = path
    return out


def _child(run: Run, config: str, overrides: list[str], work: Path, api_key: str | None = None) -> None:
    """One run, in a forked child: warm start (shared per seed), run_train, result file."""
    log_path = work / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from areal_fast.config import load_config
    from areal_fast.launch.base import API_KEY_ENV
    from areal_fast.launch.train import run_train

    if api_key is not None:  # the shared servers' key (rollout.servers given: run_train takes it from here)
        os.environ[API_KEY_ENV] = api_key
    t0 = time.perf_counter()
    out = work / "runs" / run.name
    cfg = load_config(config, [*overrides, f"experiment.output_dir={out}"])
    if cfg.model.warm_start.enabled:  # the same signature (seed, task, model): run_train reuses the copy
        shutil.rmtree(out / "warm_start", ignore_errors=True)
        shutil.copytree(warm_dir(work, run.seed) / "warm_start", out / "warm_start")
    run_train(cfg, progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    res = summarise_run(run, rows, time.perf_counter() - t0)
    res["trained_samples"] *= cfg.rollout.group_size
    res["batch_size"], res["group_size"] = cfg.train.batch_size, cfg.rollout.group_size
    res["overrides"] = overrides
    write_json_atomic(result_path(work, run), res)
    sys.stdout.flush()
    sys.stderr.flush()


def execute(run: Run, config: str, overrides: list[str], work: Path, api_key: str | None = None,
            timeout_s: float | None = None) -> bool:
    """Run one arm and seed in a forked child; True when its result file was written. A child still
    running after ``timeout_s`` is stopped (SIGTERM, then SIGKILL) and the run counts as failed."""
    # fork: the parent imported torch / transformers / areal_fast once (about 4 s a run saved) and has
    # run no torch op (no thread pools to inherit); every server is a fresh exec'd process.
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_child, args=(run, config, overrides, work, api_key), name=run.name)
    p.start()
    p.join(timeout_s)
    if p.is_alive():
        print(f"{run.name}: still running after {timeout_s:.0f} s; stopping it", flush=True)
        p.terminate()
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
        return False
    return p.exitcode == 0 and result_path(work, run).is_file()


class SharedServers:
    """The embedded engine server(s) of one seed, started once and reset before every run of that seed.

    A start costs 6-11 s on 2 busy cores, as much as a whole run's training; a reset well under a
    second. A reset server is in a fresh one's state (no request, not paused, no weight update group,
    the seed's warm-start weights at version 0) except for its sampling RNG."""

    def __init__(self, config: str, overrides: list[str], work: Path, seed: int, model_path: Path):
        import secrets

        from areal_fast.config import load_config
        from areal_fast.launch.local import LocalLauncher

        self.model_path = str(model_path.resolve())
        self.api_key = secrets.token_hex(32)
        cfg = load_config(config, [*overrides, f"experiment.seed={seed}"])
        self.seed = seed
        self.group_name = cfg.weights.group_name
        self.launcher = LocalLauncher(work / "servers" / f"seed{seed}")
        procs = self.launcher.start_servers(cfg.rollout, self.model_path, seed=seed, api_key=self.api_key)
        self.urls = [p.url for p in procs]

    def override(self) -> str:
        return "rollout.servers=[" + ", ".join(f'"{u}"' for u in self.urls) + "]"

    def _post(self, url: str, path: str, body: dict, check: bool = True) -> dict:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                text = r.read().decode() or "{}"
        except urllib.error.HTTPError as e:
            if check:
                raise RuntimeError(f"{url}{path}: HTTP {e.code}: {e.read()[:300]!r}") from None
            return {}
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}

    def reset(self) -> None:
        for url in self.urls:
            self._post(url, "/abort_request", {"abort_all": True})
            self._post(url, "/continue_generation", {})
            # a run that crashed may have left its group; normally the run's weight sync destroyed it
            self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, check=False)
            r = self._post(url, "/update_weights_from_disk", {"model_path": self.model_path, "weight_version": "0",
                                                                "abort_all_requests": True})
            if not r.get("success", False):
                raise RuntimeError(f"{url}: reloading {self.model_path} failed: {r}")

    def close(self) -> None:
        self.launcher.shutdown()


# Imported once in the parent so that no run pays for them (~5 s of transformers / torch.distributed
# imports per run on 2 busy cores); importing runs no torch op, so the forked children inherit no pools.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2",
           "torch.distributed.checkpoint", "torch.distributed.fsdp", "areal_fast.config", "areal_fast.controller",
           "areal_fast.launch.train", "areal_fast.launch.rank", "areal_fast.launch.runtime", "areal_fast.trainer",
           "areal_fast.trainer.actor", "areal_fast.trainer.model", "areal_fast.trainer.attention",
           "areal_fast.rollout.client", "areal_fast.reward", "areal_fast.weights", "areal_fast.data.warm_start")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a module moved: the run imports what it needs itself, only slower
            print(f"sweep: preload of {name} failed ({e}); continuing", flush=True)


def recipe_commit(config: str) -> str:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %cI", "--", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "uncommitted"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _server_overrides(run: Run) -> list[str]:
    return list(getattr(run.arm, "server_overrides", list)())


def run_all(runs: list[Run], args, work: Path, after_run=None) -> list[str]:
    """Run the pending runs in order (one server set per seed and serving overrides, reset before each
    run, started afresh after a failure); ``after_run(run, result, work)`` may add to a finished run's
    result. Returns the names of the failed runs; appends the invocation to ``invocations.jsonl``."""
    todo = pending(runs, work)
    print(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} already finished, {len(todo)} to run; "
          f"work dir {work}", flush=True)
    _preload()
    t_start = time.perf_counter()
    models = build_warm_starts(args.config, args.overrides, work, sorted({r.seed for r in todo}))
    print(f"warm starts of seeds {sorted(models)} ready in {time.perf_counter() - t_start:.0f} s", flush=True)
    servers, server_key, durations, failed = None, None, [], []

    def start(run):
        return SharedServers(args.config, [*args.overrides, *_server_overrides(run)], work, run.seed, models[run.seed])

    try:
        for i, run in enumerate(todo, 1):
            t0 = time.perf_counter()
            overrides = run_overrides(run, args.steps, args.eval_every, args.overrides, args.batch_size)
            ok = False
            try:
                if args.servers == "shared":
                    if servers is not None and server_key != (run.seed, *_server_overrides(run)):
                        servers.close()
                        servers = None
                    if servers is None:
                        servers, server_key = start(run), (run.seed, *_server_overrides(run))
                    try:
                        servers.reset()
                    except Exception as e:  # noqa: BLE001 - a server died or hangs: start them again, once
                        print(f"{run.name}: server reset failed ({e}); starting the servers again", flush=True)
                        servers.close()
                        servers = start(run)
                        servers.reset()
                    overrides = [*overrides, servers.override()]
                ok = execute(run, args.config, overrides, work, servers.api_key if servers else None,
                             args.run_timeout)
                if ok:
                    res = json.loads(result_path(work, run).read_text())
                    if after_run is not None:
                        after_run(run, res, work)
                        write_json_atomic(result_path(work, run), res)
            except Exception as e:  # noqa: BLE001 - one run's failure is reported, the sweep goes on
                print(f"{run.name}: {type(e).__name__}: {e}", flush=True)
                ok = False
                if servers is not None:  # start the seed's servers afresh for the next run
                    servers.close()
                    servers = None
            durations.append(time.perf_counter() - t0)
            left = (len(todo) - i) * statistics.fmean(durations)
            eta_clock = (datetime.datetime.now() + datetime.timedelta(seconds=left)).strftime("%H:%M")
            if ok:
                what = (f"EM {res['eval_first']:.3f} -> {res['eval_final']:.3f} (best {res['eval_best']:.3f}), "
                        f"staleness mean {res['staleness_mean']:.2f} max {res['staleness_max']}, "
                        f"{res['trained_samples_per_s']:.0f} samples/s")
            else:
                failed.append(run.name)
                what = f"FAILED (log: {work / 'logs' / (run.name + '.log')}); rerun with --resume {work}"
            print(f"[{i}/{len(todo)}] {run.name}: {what}; {durations[-1]:.0f} s; sweep done in ~{left / 60:.0f} "
                  f"min (~{eta_clock})", flush=True)
    finally:
        if servers is not None:
            servers.close()
    wall = time.perf_counter() - t_start
    print(f"sweep wall time {wall / 60:.1f} min; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}",
          flush=True)
    with open(work / "invocations.jsonl", "a") as f:
        f.write(json.dumps({"wall_s": wall, "runs": len(todo), "failed": len(failed)}) + "\n")
    return failed


# ----------------------------------------------------------------------------- report and command line


def report(name: str, title: str, runs: list[Run], work: Path, args, summary) -> Path | None:
    """Write ``<out>/<name>_<date>[_<tag>].json`` and ``.md`` and append the summary rows to
    ``<out>/<name>.jsonl``. ``summary(results, stamp)`` returns (extra JSON fields, markdown body, rows)."""
    results = load_results(runs, work)
    if not results:
        return None
    wall_s = None
    if (work / "invocations.jsonl").is_file() and not pending(runs, work):
        # a sweep finished over one or more invocations (--resume, more seeds or arms): the sum of their walls
        wall_s = sum(json.loads(x)["wall_s"] for x in (work / "invocations.jsonl").read_text().splitlines() if x)
    # where and on what commit the runs ran, not where this reports
    pf = work / "provenance.json"
    prov = json.loads(pf.read_text()) if pf.is_file() else provenance()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M") + (f"_{args.tag}" if args.tag else "")
    key = json.loads((work / "sweep.json").read_text())
    # a sweep run from an exported copy (no .git) has the recipe of the commit its provenance names
    rc = recipe_commit(args.config) if prov.get("commit_from", "git") == "git" else f"commit {prov.get('commit')}"
    res = {"date": stamp, "provenance": prov, "sweep": key, "recipe_commit": rc, "runs_done": len(results),
           "runs_planned": len(runs), "sweep_wall_s": wall_s, "sum_run_wall_s": sum(r["wall_s"] for r in results)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra, body, rows = summary(results, stamp)
    res |= {**extra, "runs": results}
    (out / f"{name}_{stamp}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = (f"# {title}, {stamp} UTC\n\nRecipe `{Path(args.config).name}` at {rc}; {key['steps']} steps x "
          f"{results[0].get('batch_size')} groups x {results[0].get('group_size')} samples per run, eval every "
          f"{key['eval_every']}; overrides {' '.join(key['overrides']) or 'none'}; {len(results)}/{len(runs)} runs; "
          f"sweep wall time {'-' if wall_s is None else f'{wall_s / 60:.1f} min'} (sum of run times "
          f"{res['sum_run_wall_s'] / 60:.1f} min); commit {prov.get('commit')}, {prov.get('cpu_count')} CPUs.\n\n"
          + body)
    (out / f"{name}_{stamp}.md").write_text(md)
    append_rows(name, rows, out, prov)
    print(md)
    print(f"results: {out / f'{name}_{stamp}.json'}, .md")
    return out / f"{name}_{stamp}.json"


ints, names = csv_list(cast=int), csv_list()


def add_sweep_args(ap: argparse.ArgumentParser, name: str, *, seeds=(1, 2, 3), steps: int = 40,
                   batch_size: int | None = None, eval_every: int = 10, run_timeout: float = 900.0) -> None:
    """The options every sweep shares (the driver adds its arms' lists)."""
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--seeds", type=ints, default=list(seeds))
    ap.add_argument("--steps", type=int, default=steps, help="trainer steps per run (the same for every arm)")
    ap.add_argument("--batch-size", type=int, default=batch_size,
                    help="train.batch_size (groups per step) of every run (default: %(default)s; None: the recipe's)")
    ap.add_argument("--eval-every", type=int, default=eval_every, help="held-out evaluation every K steps")
    ap.add_argument("--servers", choices=("shared", "per-run"), default="shared",
                    help="shared: one embedded engine per seed, reset before each run (saves 6-11 s a run); "
                         "per-run: run_train launches its own server every run")
    ap.add_argument("--run-timeout", type=float, default=run_timeout,
                    help="seconds after which a run that has not ended is stopped and counted as failed")
    ap.add_argument("--work", default=f"/tmp/areal_bench_{name}", help="run directories and per-run results")
    ap.add_argument("--resume", metavar="DIR", help="continue the sweep in DIR, skipping finished runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the table and JSON go")
    ap.add_argument("--tag", default="", help=f"suffix of the result files' names ({name}_<date>_<tag>.*)")
    ap.add_argument("--report-only", action="store_true", help="write the report from the work dir, run nothing")
    add_harness_args(ap, results=False, dry_run="print the run list and each run's overrides, run nothing")
    ap.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the recipe for every run")


def check_sweep_args(ap: argparse.ArgumentParser, args) -> None:
    for flag in ("steps", "eval_every", "batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        ap.error(f"--tag must be letters, digits, '-' or '_', got {args.tag!r}")
    if not args.seeds:
        ap.error("--seeds: at least one seed")


def main(name: str, runs: list[Run], args, write_report, after_run=None) -> None:
    """A sweep's command: the dry run, the refusal of a dirty tree, the work dir, the runs, the report
    (``write_report(runs, work, args)``); exits non-zero when a run failed."""
    work = Path(args.resume or args.work)
    if args.dry_run:
        print_dry_run(name, [dict(run=r.name, overrides=" ".join(run_overrides(r, args.steps, args.eval_every,
                                                                              args.overrides, args.batch_size)))
                             for r in runs])
        print(f"recipe: {args.config} ({recipe_commit(args.config)}); work dir {work}")
        return
    key = sweep_key(args.config, args.steps, args.eval_every, args.overrides, args.servers, args.batch_size)
    refuse_dirty(args.out)
    if not args.report_only:
        open_work_dir(work, key, resume=bool(args.resume))
        if not (work / "provenance.json").is_file():
            write_json_atomic(work / "provenance.json", provenance())
        failed = run_all(runs, args, work, after_run)
    write_report(runs, work, args)
    if not args.report_only and failed:
        raise SystemExit(1)
