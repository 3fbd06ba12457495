"""``areal-fast train``: the one driver of a run, for the local, Ray and Slurm launchers alike.

Read top to bottom, :func:`run_train` is the whole run:

1. hold the output directory (a second live run on it is refused) and, with
   ``experiment.resume=false``, move the previous run aside;
2. prepare the model (warm start) and check the reward with one real call, before any server starts;
3. decide where the servers come from (:func:`~areal_fast.backends.server_command.server_kind`:
   external, embedded or sglang) and start them, if the run launches them, with a fresh API key
   (SGLang's ``--api-key``, given in a private file ``<output_dir>/.secrets/*.yaml`` with ``--config``
   and removed once they are healthy; never on a command line, never in a file that stays: the saved
   configs hold ``api_key: null``). Rank processes get the key in their environment, the
   rank inside this process as an argument; the ranks' client and weight sync both read it from
   ``weights.resolved_api_key`` (:func:`run_api_key`): one key;
4. write the resolved trainer config and start the trainer ranks, which read only that file
   (``launch.rank``); rank 0 runs the controller. One local rank runs inside this process;
5. watch every process until rank 0 is done (a dead server is reported, a dead rank fails the run),
   then plot the metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from areal_fast.backends.server_command import ServerKind, server_kind
from areal_fast.checkpoint import CorruptCheckpoint, ResumeMismatch, checkpoints_dir
from areal_fast.launch.base import API_KEY_ENV, SECRETS_DIR, TRAINER_CONFIG_FILE, LaunchedProcess, ProcessDied
from areal_fast.launch.rank import run_rank, setup_logging
from areal_fast.launch.run_dir import NotARunDir, RunDirBusy, RunLock, UnsafeOutputDir, move_previous_run_aside
from areal_fast.metrics.sinks import ProgressBar, plot_run
from areal_fast.metrics_config import METRICS_KEY_ENV

log = logging.getLogger("areal_fast")
_WATCH_S = 0.5
_FOLLOWER_EXIT_S = 30.0  # ranks > 0 leave right after rank 0's 'stop'; longer means they hang


class RewardCheckFailed(RuntimeError):
    """The configured reward could not score a trivial input."""


class NoScrapeKey(ValueError):
    """An exposed Prometheus endpoint has no key of its own: the one it would take opens the servers."""


RUN_REFUSED = (RunDirBusy, ResumeMismatch, RewardCheckFailed, UnsafeOutputDir, NotARunDir, CorruptCheckpoint,
               NoScrapeKey)
"""Errors that refuse a run before it starts, with a message that says what to do (no traceback needed)."""


def run_train(cfg, *, progress: bool | None = None, say=None) -> dict:
    """Train one run; returns the controller's summary (also in ``<output_dir>/summary.json``)."""
    from areal_fast.config import save_config

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    progress = cfg.log.progress if progress is None else progress
    out = cfg.experiment.out.resolve()
    in_process = cfg.launcher == "local" and cfg.train.world_size == 1
    kind = server_kind(cfg.rollout)  # the one decision: external, embedded or sglang servers
    scrape_key = metrics_key(cfg, kind)  # before anything starts: NoScrapeKey
    with RunLock(out):
        if not cfg.experiment.resume:
            _stop_kept_servers(out)
            move_previous_run_aside(out, say)
        setup_logging(out, cfg.log.level, name="launcher.log")
        if in_process and cfg.train.gpus:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(cfg.train.gpus)
        save_config(cfg, out / "config.yaml")
        model = model_dir(cfg, say)
        check_data_and_reward(cfg, model)
        reused, api_key = kept_servers(cfg, kind, out, model, say)  # rollout.keep_servers (launch.reuse)
        api_key = api_key or run_api_key(cfg, kind)
        with open_launcher(cfg, out / "logs", out / SECRETS_DIR) as launcher:
            procs = run_servers(cfg, kind, launcher, model, api_key, say, reused=reused)
            urls = [p.url for p in procs] if kind.launched else [u.rstrip("/") for u in cfg.rollout.servers]
            log.info("inference servers (%s): %s; API key auth %s", kind.value, ", ".join(urls),
                     "on" if api_key else "off (neither api_key nor AREAL_FAST_API_KEY is set)")
            tcfg = trainer_run_config(cfg, model, urls, out)
            save_config(tcfg, out / TRAINER_CONFIG_FILE)
            with supervised_servers(cfg, kind, launcher, model, out, api_key, procs):
                if in_process:  # rank 0 here: the key as an argument (rank processes read their environment)
                    exposed = {"metrics_key": scrape_key} if scrape_key else {}  # an exposed Prometheus endpoint
                    summary = run_rank(tcfg, api_key=api_key, progress=progress, say=say, **exposed)
                else:
                    say(f"starting {cfg.train.world_size} trainer rank(s) ({cfg.launcher}); logs in {out / 'logs'}")
                    env = {API_KEY_ENV: api_key} if api_key else {}
                    if scrape_key:
                        env[METRICS_KEY_ENV] = scrape_key
                    ranks = launcher.start_trainer_ranks(cfg.train, out / TRAINER_CONFIG_FILE, env)
                    summary = _watch_ranks(launcher, ranks, out, ProgressBar(cfg.experiment.total_steps, 0,
                                                                              enabled=progress))
        if cfg.log.plots:
            plots = plot_run(out / "metrics.jsonl", out / "plots")
            if plots:
                say(f"plots: {', '.join(str(p) for p in plots)}")
        for sink, where in (summary.get("sinks") or {}).items():
            say(f"metrics ({sink}): {where}")
        return summary


# ----------------------------------------------------------------------------- the steps


def run_api_key(cfg, kind: ServerKind) -> str | None:
    """The one API key of a run: a fresh one for servers we launch, else the external servers' own
    key (``api_key``, else $AREAL_FAST_API_KEY: ``WeightSyncConfig.resolved_api_key``). It
    reaches rank processes in their environment and the rank inside the launcher's process as an
    argument; their client and weight sync both read it from ``weights.resolved_api_key`` (the
    trainer config file holds ``api_key: null``)."""
    if not kind.launched:
        return cfg.weights.resolved_api_key
    return secrets.token_hex(32)  # hex: a key starting with "-" would be read as a flag by the server


def metrics_key(cfg, kind: ServerKind, environ=os.environ) -> str | None:
    """The bearer key of a Prometheus endpoint bound beyond loopback (None on loopback: no key there),
    a key that opens nothing else: $AREAL_FAST_METRICS_KEY when the user set it; else, for servers the
    run launches (each run gives them a fresh key of their own), the key the user gave the run
    (``api_key`` or $AREAL_FAST_API_KEY). With servers started by hand that key is theirs, so a scraper
    holding it could drive them: the run is refused (:class:`NoScrapeKey`) unless
    $AREAL_FAST_METRICS_KEY names another. It reaches rank 0 as an argument or in its environment
    ($AREAL_FAST_METRICS_KEY), never in a file."""
    from areal_fast.metrics_config import is_loopback

    p = cfg.metrics.prometheus
    if not p.enabled or is_loopback(p.host):
        return None
    own, given = environ.get(METRICS_KEY_ENV) or None, cfg.weights.resolved_api_key
    if kind.launched:
        return own or given
    if own is None or own == given:
        why = "is not set" if own is None else "is that key too"
        raise NoScrapeKey(f"metrics.prometheus.host {p.host!r} needs a bearer key on every scrape, and with servers "
                          f"started by hand (rollout.servers) the run's key (api_key or $AREAL_FAST_API_KEY) is "
                          f"theirs: a scraper holding it could drive them. Set ${METRICS_KEY_ENV} to a key of its "
                          f"own for the scrapes ({METRICS_KEY_ENV} {why}; docs/observability.md)")
    return own


def run_servers(cfg, kind: ServerKind, launcher, model: str, api_key: str | None, say=print,
                reused: list[LaunchedProcess] = ()) -> list[LaunchedProcess]:
    """The servers the run launches: none for external ones (``rollout.servers``), the ``reused``
    ones kept by the previous run (adopted; the supervisor starts any missing), else
    ``rollout.n_servers`` servers of ``kind`` started now with ``api_key`` (healthy on return)."""
    if not kind.launched:
        return []
    if reused:
        for p in reused:
            launcher.adopt(p)
        return list(reused)
    say(f"starting {cfg.rollout.n_servers} {kind.value} server(s) (API key required)...")
    return launcher.start_servers(cfg.rollout, model, seed=cfg.experiment.seed, api_key=api_key)


def kept_servers(cfg, kind: ServerKind, out: Path, model: str, say=print) -> tuple[list[LaunchedProcess], str | None]:
    """``rollout.keep_servers``: the previous run's servers fit for reuse and their key when resuming
    (``launch.reuse``: their version checked against the checkpoint); every kept server stopped when
    the run starts afresh. ([], None) otherwise."""
    from areal_fast.launch import reuse

    if not kind.launched or not cfg.rollout.keep_servers:
        return [], None
    if cfg.launcher != "local":
        raise ValueError("rollout.keep_servers: only the local launcher keeps and reuses its servers")
    if not cfg.experiment.resume:
        return [], None  # move_previous_run_aside stopped the previous run's kept servers
    from areal_fast.checkpoint import newest_readable_state

    found = newest_readable_state(checkpoints_dir(out))
    return reuse.reuse_kept_servers(out, model, int(found[1]["version"]) if found else 0, say,
                                    group_name=cfg.weights.group_name, rollout_cfg=cfg.rollout)


@contextmanager
def supervised_servers(cfg, kind: ServerKind, launcher, model: str, out: Path, api_key: str | None,
                       procs: list[LaunchedProcess]):
    """The launched servers kept at their target (``elastic.supervisor.ServerSupervisor``) while the block
    runs; with ``rollout.keep_servers`` their key is kept, and a failing block leaves them running."""
    from areal_fast.elastic.members import servers_dir
    from areal_fast.elastic.supervisor import ServerSupervisor
    from areal_fast.launch import reuse

    if not kind.launched:
        for name in ("members.json", "target.json"):  # a previous run's: these servers are not launched
            (servers_dir(out) / name).unlink(missing_ok=True)
        yield None
        return
    (servers_dir(out) / "target.json").unlink(missing_ok=True)  # a target is for the run it was given to
    keep = cfg.rollout.keep_servers
    if keep:
        reuse.save_key(out, api_key)
    sup = ServerSupervisor(launcher, cfg.rollout, model, out, seed=cfg.experiment.seed, api_key=api_key,
                           servers=procs, secrets_dir=out / SECRETS_DIR, target=cfg.rollout.n_servers)
    sup.start()
    try:
        yield sup
    except BaseException:
        sup.stop()
        if keep:
            launcher.release([*sup.members.values(), *(s.proc for s in sup.starting)])
            log.warning("rollout.keep_servers: the servers stay up for a resume of %s", out)
        raise
    else:
        sup.stop()
        if keep:
            reuse.remove_key(out)


def _stop_kept_servers(out: Path) -> None:
    """A fresh start stops the servers a failed run of ``out`` kept (``rollout.keep_servers``)."""
    from areal_fast.launch import reuse

    reuse.stop_kept(reuse.kept_processes(out), "the run starts afresh (experiment.resume=false)")
    reuse.remove_key(out)


def model_dir(cfg, say=print) -> str:
    """The model the run starts from: ``model.path``, or the warm-started tiny model (built once, cached)."""
    if not cfg.model.warm_start.enabled:
        return str(Path(cfg.model.path).resolve()) if Path(cfg.model.path).exists() else cfg.model.path
    from areal_fast.data.warm_start import ensure_warm_start

    t0 = time.perf_counter()
    last = [0.0]

    def progress(step, total, loss):
        if time.perf_counter() - last[0] > 5 or step == total:
            last[0] = time.perf_counter()
            say(f"warm start: step {step}/{total}, loss {loss:.3f}")

    path = ensure_warm_start(cfg.warm_start_recipe(), progress)
    say(f"model: {path} ({time.perf_counter() - t0:.1f} s)")
    return str(Path(path).resolve())


def check_data_and_reward(cfg, model: str) -> None:
    """Before any server starts: the data order matches the checkpoint to resume (when resuming), and
    the reward scores a real task."""
    from areal_fast.data import load_tokenizer
    from areal_fast.launch.rank import load_data, resume_key

    prompts, _ = load_data(cfg, load_tokenizer(cfg.model.tokenizer or model))
    if cfg.experiment.resume:
        check_resume(checkpoints_dir(cfg.experiment.out.resolve()), resume_key(cfg, prompts))
    check_reward(cfg, prompts.rows[0].task)


def check_resume(ckpt_dir: Path, key: dict) -> None:
    """Refuse (ResumeMismatch, naming the changed keys) when the newest readable checkpoint was written
    with another data order. Rank 0 checks again when it restores; this check saves starting servers.
    CorruptCheckpoint when checkpoints exist and none is readable."""
    from areal_fast.checkpoint import check_resume_key, newest_readable_state

    found = newest_readable_state(ckpt_dir)
    if found is not None:
        check_resume_key(found[1], key, found[0])


def check_reward(cfg, task: dict) -> None:
    """Score ``task`` (a real training task) with an empty completion, for ``reward.name`` and
    ``eval.reward``, in the reward service's own worker: a reward that cannot be imported or fails on a
    real task stops the run now (naming it), instead of training the whole run on zero rewards."""
    from areal_fast.reward import RewardService

    checks = [("reward.name", cfg.reward.name)] + ([("eval.reward", cfg.eval.reward)] if cfg.eval.reward else [])

    async def smoke() -> list[tuple[str, str, object]]:
        async with RewardService(num_workers=1, timeout_s=cfg.reward.timeout, default_reward=cfg.reward.name) as s:
            return [(key, name, await s.score({**task, "reward": name}, "")) for key, name in checks]

    for key, name, res in asyncio.run(smoke()):
        if res.status != "ok":
            raise RewardCheckFailed(f"{key} = {name!r}: a test call (first training prompt, empty completion) "
                                    f"ended with status {res.status!r}: {res.detail or 'no detail'}")
    log.info("reward check: %s scored a test input", ", ".join(f"{k}={n!r}" for k, n in checks))


def trainer_run_config(cfg, model: str, urls: list[str], out: Path):
    """The config the trainer ranks read: this run's, with the model resolved, the warm start done,
    the servers filled in and the output directory absolute."""
    from areal_fast.config import AppConfig, from_dict, to_dict

    d = to_dict(cfg)
    d["experiment"]["output_dir"] = str(out)
    d["model"]["path"] = model
    d["model"]["warm_start"]["enabled"] = False
    d["rollout"]["servers"] = list(urls)
    d["log"]["progress"] = False
    d["api_key"] = None  # never in a file: the ranks are given the run's key (run_api_key)
    if cfg.launcher in ("ray", "slurm"):
        d["train"]["gpus"] = []  # Ray or Slurm gives each rank its GPU (CUDA_VISIBLE_DEVICES)
    return from_dict(AppConfig, d)


@contextmanager
def open_launcher(cfg, log_dir: Path, secrets_dir: Path | None = None):
    """The launcher of ``cfg.launcher``, shut down (every process stopped) on exit. ``secrets_dir``
    holds the servers' API key file while they start (in the output dir: every Ray node sees it)."""
    if cfg.launcher == "ray":
        from areal_fast.launch.ray_launcher import open_ray_launcher

        with open_ray_launcher(cfg.ray, log_dir, secrets_dir) as launcher:
            yield launcher
    elif cfg.launcher == "slurm":
        from areal_fast.launch.slurm import SlurmLauncher

        with SlurmLauncher(log_dir, cfg.slurm, run_dir=log_dir.parent, secrets_dir=secrets_dir) as launcher:
            yield launcher
    else:
        from areal_fast.launch.local import LocalLauncher

        with LocalLauncher(log_dir, secrets_dir=secrets_dir) as launcher:
            yield launcher


def _watch_ranks(launcher, ranks: list[LaunchedProcess], out: Path, bar) -> dict:
    """Follow the ranks (and the progress from metrics.jsonl) until rank 0 is done; a critical death
    raises ProcessDied with its log tail."""
    metrics_pos = 0
    finished_at = None
    try:
        while any(p.alive() for p in ranks):
            launcher.check()
            metrics_pos = _follow_metrics(out / "metrics.jsonl", metrics_pos, bar)
            if finished_at is None and ranks[0].returncode == 0:
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > _FOLLOWER_EXIT_S:
                log.warning("trainer ranks still running %.0f s after rank 0 finished; stopping them",
                            _FOLLOWER_EXIT_S)
                break
            time.sleep(_WATCH_S)
        launcher.check()
        _follow_metrics(out / "metrics.jsonl", metrics_pos, bar)
    finally:
        bar.close()
    if ranks[0].returncode != 0:
        raise ProcessDied(ranks[0].death_message())
    summary_path = out / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}


def _follow_metrics(path: Path, pos: int, bar) -> int:
    """Feed the progress bar with the metrics.jsonl lines written since byte ``pos``."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < pos:  # rank 0 cut the file back on resume
                pos = 0
            f.seek(pos)
            chunk = f.read()
    except OSError:
        return pos
    end = chunk.rfind(b"\n") + 1  # only whole lines
    for line in chunk[:end].splitlines():
        try:
            bar(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return pos + end
