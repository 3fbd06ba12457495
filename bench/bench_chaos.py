"""Chaos benchmark: a tiny run while faults are injected on a schedule; per fault, the time to recover,
the steps delayed and the throughput dip; per run, every prompt position accounted for (0 lost, 0
duplicated). Two phases: ``main`` (launched servers, gloo weight sync, reward workers; server,
reward and controller faults) and ``proxy`` (a server behind :class:`tools.chaos_lib.StallingProxy`).
The faults, the figures' definitions and the last results: docs/chaos.md; the pure logic is in
``tools/chaos_lib.py``.

    nice -n 5 python bench/bench_chaos.py                       # both phases, default schedules
    python bench/bench_chaos.py --phases main --schedule "20:server_kill 60:controller_kill"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.chaos_reward import HANG_FILE_ENV  # noqa: E402
from bench.common import (  # noqa: E402
    add_harness_args,
    proc_alive,
    proc_children,
    proc_cmdline,
    proc_ppid,
    provenance,
)
from tools.chaos_lib import FAULTS, Arrival, StallingProxy, account, fault_figures, parse_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "tiny_reverse.yaml")
GROUP_SIZE = 4
# the shrunken tiny task of tests/launch/test_e2e.py, with groups of 4, batches of 4 and eta 2
BASE = [
    "model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
    "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
    "model.warm_start.num_key_value_heads=1", "data.synthetic.max_len=6", "data.synthetic.n_train=5000",
    "data.synthetic.n_eval=8", f"rollout.group_size={GROUP_SIZE}", "rollout.max_new_tokens=8",
    "rollout.max_staleness=2", "rollout.max_concurrent=8", "train.batch_size=4", "eval.every_steps=0",
    "log.tensorboard=false", "log.progress=false", "log.plots=false", "log.samples=true",
    "weights.method=distributed", "reward.workers=2", "reward.timeout=3",
    # deadlines short enough that a hang costs seconds, not the defaults' minutes (docs/deadlines.md)
    "rollout.hang_timeout=5", "rollout.control_timeout=10", "weights.timeout_s=20",
]
MAIN = ["rollout.n_servers=3", "rollout.keep_servers=true", "checkpoint.every_steps=10",
        "reward.name=bench.chaos_reward:reward"]
# a step takes ~0.3 s here and a relaunched server ~30-60 s to join: faults ~60 s apart; the server
# left stopped comes last (what follows it is bounded by weights.timeout_s per step, docs/chaos.md)
MAIN_SCHEDULE = ("40:server_kill 220:server_stop:20 380:reward_kill 440:reward_hang:15 580:controller_kill "
                 "990:server_stop:never")
MAIN_STEPS = 1000
PROXY_SCHEDULE = "40:proxy_slow:30:1.0 250:proxy_slow:20:30"
PROXY_STEPS = 400
POLL_S = 0.2
RUN_TIMEOUT_S = 1800


def say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def signal_pid(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


class Watcher(threading.Thread):
    """Polls the run's files: the arrival of each train step, the pool's and the members' sizes."""

    def __init__(self, out: Path, t0: float):
        super().__init__(name="chaos-watcher", daemon=True)
        self.out, self.t0 = out, t0
        self.arrivals: list[Arrival] = []
        self.events: list[dict] = []  # every train event seen, each lineage's (a resume cuts the file back)
        self.pool: list[tuple[float, int]] = []
        self.members: list[tuple[float, int]] = []
        self.incarnation = 0
        self._seen: set[tuple[int, int]] = set()
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def max_step(self) -> int:
        with self.lock:
            return max((a.step for a in self.arrivals), default=0)

    def run(self) -> None:
        while not self._halt.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.poll()

    def poll(self) -> None:
        t = self.now()
        rows = [r for r in read_jsonl(self.out / "metrics.jsonl") if r.get("kind") == "train"]
        pool = read_json(self.out / "servers" / "pool.json")
        members = read_json(self.out / "servers" / "members.json")
        with self.lock:
            for r in rows:
                key = (self.incarnation, int(r["step"]))
                if key in self._seen:
                    continue
                self._seen.add(key)
                self.events.append({**r, "incarnation": self.incarnation, "seen_t": t})
                self.arrivals.append(Arrival(t, int(r["step"]), len(r.get("positions", [])) * GROUP_SIZE,
                                             int(r.get("tokens", 0)), self.incarnation))
            if isinstance(pool, dict):
                n = len(pool.get("urls", []))
                if not self.pool or self.pool[-1][1] != n:
                    self.pool.append((t, n))
            if isinstance(members, dict):
                n = len(members.get("servers", []))
                if not self.members or self.members[-1][1] != n:
                    self.members.append((t, n))


class Phase:
    """One run under faults: its command, its process (relaunched after a controller kill), the watcher."""

    def __init__(self, name: str, out: Path, cmd: list[str], env: dict, schedule: list, total_steps: int):
        self.name, self.out, self.cmd, self.env = name, out, cmd, env
        self.schedule, self.total_steps = schedule, total_steps
        self.proc: subprocess.Popen | None = None
        self.launches = 0
        self.watch = Watcher(out, time.monotonic())
        self.injected: list[dict] = []
        self.exits: list[dict] = []
        self.stopped_never: list[int] = []
        self.proxy: StallingProxy | None = None
        self.timers: list[threading.Timer] = []

    def launch(self, resume: bool) -> None:
        log = open(self.out.parent / f"{self.name}_driver{self.launches}.log", "wb")
        cmd = self.cmd + (["experiment.resume=true"] if resume else [])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     preexec_fn=lambda: os.nice(5))
        self.launches += 1
        say(f"{self.name}: run launched (pid {self.proc.pid}{', resume' if resume else ''})")

    def members(self) -> list[dict]:
        d = read_json(self.out / "servers" / "members.json") or {}
        return [m for m in d.get("servers", []) if m.get("pid") and proc_alive(int(m["pid"]))
                and int(m["pid"]) not in self.stopped_never]


def reward_workers(run_pid: int) -> list[int]:
    """The reward service's worker processes: children of its multiprocessing forkserver."""
    kids = proc_children(run_pid)
    return [k for k in kids if "forkserver" in proc_cmdline(k) and "forkserver" in proc_cmdline(proc_ppid(k))]


def inject(phase: Phase, fault) -> dict:
    """Inject ``fault`` now; what was done (the pid, the target) for the report."""
    k, rec = fault.kind, {}
    if k in ("server_kill", "server_stop"):
        ms = phase.members()
        if not ms:
            return {"skipped": "no live member"}
        m = ms[0] if k == "server_kill" else ms[-1]
        pid = int(m["pid"])
        rec = {"server": m["url"], "pid": pid}
        if k == "server_kill":
            signal_pid(pid, signal.SIGKILL)
        else:
            signal_pid(pid, signal.SIGSTOP)
            if fault.duration_s is None:
                phase.stopped_never.append(pid)
            else:
                t = threading.Timer(fault.duration_s, signal_pid, (pid, signal.SIGCONT))
                t.start()
                phase.timers.append(t)
    elif k == "reward_kill":
        ws = reward_workers(phase.proc.pid)
        if not ws:
            return {"skipped": "no reward worker found"}
        signal_pid(ws[0], signal.SIGKILL)
        rec = {"pid": ws[0], "workers_before": len(ws)}
    elif k == "reward_hang":
        (phase.out / "chaos_hang").write_text(str(time.time() + fault.duration_s))
    elif k == "controller_kill":
        pid = phase.proc.pid
        signal_pid(pid, signal.SIGKILL)
        phase.proc.wait()
        rec = {"pid": pid, "last_step": phase.watch.max_step, "t_exit": phase.watch.now()}
        kept = [m["url"] for m in phase.members()]
        rec["servers_alive_after_kill"] = len(kept)
        phase.watch.incarnation += 1
        phase.launch(resume=True)
    elif k == "proxy_slow":
        phase.proxy.delay_s = fault.delay_s
        t = threading.Timer(fault.duration_s, setattr, (phase.proxy, "delay_s", 0.0))
        t.start()
        phase.timers.append(t)
    return rec


def drive(phase: Phase) -> None:
    """Launch, inject each fault at its step, wait for the run to end (an unexpected exit is resumed once)."""
    phase.watch.start()
    phase.launch(resume=False)
    todo = list(phase.schedule)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        rc = phase.proc.poll()
        if rc is not None:
            phase.exits.append({"t": phase.watch.now(), "rc": rc, "launch": phase.launches})
            if rc == 0:
                break
            say(f"{phase.name}: the run exited with {rc} (not a fault of the schedule)")
            if sum(e["rc"] != 0 for e in phase.exits) > 1:
                break
            phase.watch.incarnation += 1
            phase.launch(resume=True)
            continue
        if todo and phase.watch.max_step >= todo[0].step:
            f = todo.pop(0)
            t = phase.watch.now()
            say(f"{phase.name}: step {phase.watch.max_step}: injecting {f.label()}")
            phase.injected.append({"fault": f, "t": t, "step_seen": phase.watch.max_step, **inject(phase, f)})
        time.sleep(POLL_S)
    else:
        say(f"{phase.name}: the run did not end within {RUN_TIMEOUT_S} s; stopping it")
        phase.proc.send_signal(signal.SIGTERM)
        phase.proc.wait(120)
        phase.exits.append({"t": phase.watch.now(), "rc": "timeout", "launch": phase.launches})
    for t in phase.timers:
        t.cancel()
    phase.watch.stop()
    for f in todo:
        phase.injected.append({"fault": f, "t": None, "skipped": "the run ended before this step"})


def cleanup_servers(phase: Phase) -> None:
    """No server of the run may outlive it: SIGCONT then SIGKILL any member (or server still starting) alive."""
    d = read_json(phase.out / "servers" / "members.json") or {}
    for m in [*d.get("servers", []), *(d.get("starting") or [])]:
        pid = m.get("pid")
        if pid and proc_alive(int(pid)) and "areal_fast" in proc_cmdline(int(pid)):
            signal_pid(int(pid), signal.SIGCONT)
            signal_pid(int(pid), signal.SIGKILL)


def accounting(out: Path) -> dict:
    """0 lost, 0 duplicated? From the final lineage of metrics.jsonl, samples.jsonl and the last checkpoint."""
    from areal_fast.buffer import checkpoint_groups
    from areal_fast.checkpoint import latest_checkpoint, read_state

    ck = latest_checkpoint(out / "checkpoints")
    if ck is None:
        return {"error": "no checkpoint"}
    st = read_state(ck)
    buffered = [g.position for g in checkpoint_groups(ck, st)]
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "train"]
    per_group = {int(g["position"]): len(g["samples"]) for r in read_jsonl(out / "samples.jsonl")
                 for g in r.get("groups", []) if g.get("position") is not None}
    acc = account(events, st, buffered, per_group, GROUP_SIZE).to_dict()
    acc["checkpoint"] = ck.name
    for k in ("lost", "duplicated", "unknown", "short_groups"):
        acc[k] = acc[k][:50]
    return acc


def figures(phase: Phase) -> list[dict]:
    w = phase.watch
    return fault_rows(phase.name, phase.injected, w.arrivals, w.pool, w.events)


def fault_rows(name: str, injected: list[dict], arrivals: list[Arrival], pool: list, events: list[dict]) -> list[dict]:
    """Each fault's figures, from its injection to the next fault's (a recovery after that is not its own)."""
    rows = []
    times = sorted(r["t"] for r in injected if r.get("t") is not None and not r.get("skipped"))
    end_run = arrivals[-1].t if arrivals else None
    for rec in injected:
        f = rec["fault"]
        row = {"fault": f.label(), "kind": f.kind, "what": FAULTS[f.kind][2], "phase": name,
               **{k: v for k, v in rec.items() if k != "fault"}}
        if rec.get("t") is None or rec.get("skipped"):
            rows.append(row)
            continue
        t0 = rec["t"]
        end_t = min([t for t in times if t > t0] or [end_run if end_run is not None else t0])
        mine = [a for a in arrivals if a.t <= end_t]
        server = f.kind in ("server_kill", "server_stop", "proxy_slow")
        sizes = [n for t, n in pool if t <= t0]
        size = sizes[-1] if sizes and server else None
        window = [(t, n) for t, n in pool if t <= end_t]
        progress = rec.get("last_step") if f.kind == "controller_kill" else None
        row.update(fault_figures(mine, t0, pool=window if server else None, pool_size=size,
                                 progress_step=progress, end_t=end_t))
        row["until_next_fault_s"] = end_t - t0
        row["pool_before"] = sizes[-1] if sizes else None
        row["pool_min_after"] = min([n for t, n in window if t >= t0] + ([row["pool_before"]] if sizes else []),
                                    default=None)
        if f.kind == "server_kill":
            row["distributed_sync_after"] = all("sync/broadcast_s" in e and "sync/disk_sync_s" not in e
                                                for e in events if t0 <= e["seen_t"] <= end_t)
        rows.append(row)
    return rows


def reanalyze(path: Path) -> dict:
    """The fault rows of a results JSON again from its saved arrivals and pool (samples: a full batch a step)."""
    from tools.chaos_lib import Fault

    res = json.loads(path.read_text())
    for ph in res["phases"]:
        per_step = ph.get("samples_per_step", 16)
        arr = [Arrival(t, step, per_step, 0, inc) for inc, step, t in ph["steps_seen"]]
        injected = []
        for r in ph["faults"]:
            step, kind, *args = r["fault"].split(":")
            injected.append({**{k: r[k] for k in ("t", "step_seen", "server", "pid", "last_step", "skipped",
                                                  "servers_alive_after_kill", "workers_before") if k in r},
                             "fault": Fault(int(step), kind, tuple(args))})
        ph["faults"] = fault_rows(ph["phase"], injected, arr, [tuple(x) for x in ph["pool"]], [])
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy within {timeout:g} s")


def start_engines(work: Path, n: int) -> tuple[list[subprocess.Popen], list[str], str]:
    """``n`` embedded engines on the warm-started tiny model (built or found in the cache), healthy."""
    from areal_fast.config import load_config
    from areal_fast.launch.base import server_command, server_env
    from areal_fast.launch.train import model_dir

    cfg = load_config(EXAMPLE, [*BASE, f"experiment.output_dir={work / 'model_probe'}"])
    model = model_dir(cfg, say=say)
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        cmd = server_command(cfg.rollout, model, "127.0.0.1", port, seed=i, api_key_file=None)
        log = open(work / f"proxy_engine{i}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **server_env(cfg.rollout)}, preexec_fn=lambda: os.nice(5)))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_healthy(u)
    return procs, urls, model


def run_phase(name: str, work: Path, schedule: list, steps: int) -> dict:
    out = work / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           HANG_FILE_ENV: str(out / "chaos_hang")}
    base = [sys.executable, "-m", "areal_fast.cli", "train", EXAMPLE, f"experiment.output_dir={out}", *BASE,
            f"experiment.total_steps={steps}"]
    engines: list[subprocess.Popen] = []
    proxy = None
    if name == "main":
        cmd = base + MAIN
    else:
        engines, urls, model = start_engines(work, 2)
        proxy = StallingProxy(("127.0.0.1", int(urls[1].rsplit(":", 1)[1])))
        via = f"http://127.0.0.1:{proxy.start()}"
        cmd = base + [f"rollout.servers={json.dumps([urls[0], via])}", f"model.path={model}",
                      "model.warm_start.enabled=false", "checkpoint.every_steps=20"]
    phase = Phase(name, out, cmd, env, schedule, steps)
    phase.proxy = proxy
    try:
        drive(phase)
    finally:
        cleanup_servers(phase)
        for p in engines:
            p.kill()
            p.wait()
        if proxy is not None:
            proxy.stop()
    result = {"phase": name, "command": " ".join(cmd[1:]), "schedule": [f.label() for f in schedule],
              "total_steps": steps, "samples_per_step": 4 * GROUP_SIZE,
              "launches": phase.launches, "exits": phase.exits,
              "faults": figures(phase), "accounting": accounting(out),
              "steps_seen": [(a.incarnation, a.step, round(a.t, 2)) for a in phase.watch.arrivals],
              "pool": phase.watch.pool, "members": phase.watch.members,
              "summary": read_json(out / "summary.json")}
    if name == "proxy":
        result["proxy_chunks"] = proxy.chunks
    return result


def _f(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown(res: dict) -> str:
    lines = [f"# Chaos benchmark, {res['date']}", "", f"commit {res['provenance'].get('commit')}, "
             f"{res['provenance'].get('cpu', '')}", "", "```", res["command"], "```", ""]
    for ph in res["phases"]:
        acc = ph["accounting"]
        lines += [f"## Phase {ph['phase']}", "", "```", ph["command"], "```", "",
                  f"launches {ph['launches']}, exits {ph['exits']}; accounting: {acc.get('issued')} positions "
                  f"handed out, {acc.get('trained')} trained, {acc.get('buffered')} buffered, {acc.get('pending')} "
                  f"pending at the end: **lost {acc.get('lost_n')}, duplicated {acc.get('duplicated_n')}**, "
                  f"steps missing {acc.get('steps_missing')}, repeated {acc.get('steps_repeated')}, "
                  f"short groups {acc.get('short_groups')}", "",
                  "| fault | at step | pool before / min after | recovery s | pool back s | steps delayed | "
                  "baseline samples/s | window samples/s | dip | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in ph["faults"]:
            notes = r.get("skipped") or ", ".join(f"{k}={r[k]}" for k in ("server", "distributed_sync_after",
                                                                              "servers_alive_after_kill", "last_step")
                                                  if k in r)
            dip = None if r.get("dip") is None else f"{100 * r['dip']:.0f}%"
            lines.append(f"| {r['fault']} | {r.get('step_seen', '-')} | {_f(r.get('pool_before'))} / "
                         f"{_f(r.get('pool_min_after'))} | {_f(r.get('recovery_s'))} | {_f(r.get('pool_back_s'))} | "
                         f"{_f(r.get('steps_delayed'))} | {_f(r.get('baseline_samples_per_s'))} | "
                         f"{_f(r.get('window_samples_per_s'))} | {dip or '-'} | {notes} |")
        rs = (ph.get("summary") or {}).get("reward_stats")
        if rs:
            lines += ["", "reward service (last launch): " + ", ".join(
                f"{k} {rs.get(k)}" for k in ("calls", "timeout", "error", "worker_restarts", "worker_deaths",
                                             "retries", "retried_ok", "workers"))]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default="main,proxy")
    ap.add_argument("--schedule", default=MAIN_SCHEDULE, help="main phase: STEP:KIND[:ARG...] items")
    ap.add_argument("--proxy-schedule", default=PROXY_SCHEDULE)
    ap.add_argument("--steps", type=int, default=MAIN_STEPS)
    ap.add_argument("--proxy-steps", type=int, default=PROXY_STEPS)
    ap.add_argument("--work", default=None, help="where the runs go (default: /tmp/chaos_<time>)")
    add_harness_args(ap, dry_run=None)
    ap.add_argument("--reanalyze", default=None, help="recompute the fault rows of a results JSON and rewrite its .md")
    a = ap.parse_args(argv)
    if a.reanalyze:
        res = reanalyze(Path(a.reanalyze))
        Path(a.reanalyze).write_text(json.dumps(res, indent=1, default=str) + "\n")
        Path(a.reanalyze).with_suffix(".md").write_text(markdown(res) + "\n")
        print(markdown(res))
        return 0
    stamp = dt.datetime.now().strftime("%Y%m%d_%H%M")
    work = Path(a.work or f"/tmp/chaos_{stamp}")
    work.mkdir(parents=True, exist_ok=True)
    plans = {"main": (parse_schedule(a.schedule), a.steps), "proxy": (parse_schedule(a.proxy_schedule), a.proxy_steps)}
    for name, (sched, _) in plans.items():
        wrong = [f.label() for f in sched if f.phase != name]
        if wrong:
            flag = "schedule" if name == "main" else "proxy-schedule"
            raise SystemExit(f"--{flag}: {wrong} belong to the other phase")
    command = " ".join(["python", "bench/bench_chaos.py", *(argv or sys.argv[1:])])
    res = {"bench": "chaos", "date": stamp, "command": command,
           "provenance": provenance(native=False), "phases": []}
    for name in a.phases.split(","):
        say(f"phase {name}: schedule {[f.label() for f in plans[name][0]]}, {plans[name][1]} steps, in {work / name}")
        res["phases"].append(run_phase(name, work, *plans[name]))
    md = markdown(res)
    print(md)
    if not a.no_results:
        d = Path(a.results)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"chaos_{stamp}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        (d / f"chaos_{stamp}.md").write_text(md + "\n")
        say(f"results: {d / f'chaos_{stamp}.json'} and .md")
    return 0 if all(p["accounting"].get("ok") for p in res["phases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
