"""``areal-fast train``: prepare the model and data, launch the servers, run the controller.

World size 1 (default): servers are subprocesses, the trainer lives inside this process next to
the controller (its step runs in a thread). World size > 1: this process launches the servers
and ``torchrun`` with the trainer ranks; rank 0 of torchrun runs the controller against the
already running servers and the other ranks follow it (``runtime.follower_loop``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import yaml

from areal_fast.config import AppConfig, to_dict
from areal_fast.controller import Controller, ControllerSettings, latest_checkpoint
from areal_fast.launch.local import LocalLauncher, ProcessDied, die_with_parent, find_free_port, http_ok
from areal_fast.launch.metrics import JsonlSink, ProgressBar, TensorBoardSink, plot_run, read_jsonl, truncate_jsonl

log = logging.getLogger("areal_fast")
_WATCH_S = 0.5


def setup_logging(out: Path, level: str, console: bool = True) -> None:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(out / "logs" / "controller.log")]
    if console:
        h = logging.StreamHandler(sys.stderr)
        h.setLevel(logging.WARNING)  # the progress bar owns the terminal; details go to the log file
        handlers.append(h)
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def model_dir(cfg: AppConfig, say=print) -> str:
    if not cfg.model.warm_start.enabled:
        return cfg.model.path
    from areal_fast.data.warm_start import ensure_warm_start

    t0 = time.perf_counter()
    last = [0.0]

    def progress(step, total, loss):
        if time.perf_counter() - last[0] > 5 or step == total:
            last[0] = time.perf_counter()
            say(f"warm start: step {step}/{total}, loss {loss:.3f}")

    path = ensure_warm_start(cfg, progress)
    say(f"model: {path} ({time.perf_counter() - t0:.1f} s)")
    return str(path)


def load_data(cfg: AppConfig, tokenizer):
    from areal_fast.data import PromptStream, load_split

    seed = cfg.experiment.seed
    train = load_split(cfg.data, "train", seed, tokenizer)
    n0 = len(train)
    train = [r for r in train if len(tokenizer.encode(r.text)) <= cfg.data.max_prompt_tokens]
    if len(train) < n0:
        log.warning("skipped %d of %d training prompts longer than data.max_prompt_tokens=%d",
                    n0 - len(train), n0, cfg.data.max_prompt_tokens)
    evals = load_split(cfg.data, "eval", seed, tokenizer)
    if cfg.eval.size is not None:
        evals = evals[: cfg.eval.size]
    return PromptStream(train, seed, cfg.data.shuffle), evals


def controller_settings(cfg: AppConfig, tokenizer) -> ControllerSettings:
    r = cfg.rollout
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = {"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k, "stop_token_ids": stop}
    eval_sampling = {"max_new_tokens": cfg.eval.max_new_tokens or r.max_new_tokens, "temperature": 0.0,
                     "stop_token_ids": stop}
    return ControllerSettings(
        batch_size=cfg.train.batch_size, group_size=r.group_size, max_staleness=r.max_staleness,
        total_steps=cfg.experiment.total_steps, sampling=sampling, eval_sampling=eval_sampling,
        strict_staleness=r.strict_staleness, eval_every=cfg.eval.every_steps, eval_at_start=cfg.eval.at_start,
        checkpoint_every=cfg.checkpoint.every_steps, keep_last=cfg.checkpoint.keep_last,
        output_dir=cfg.experiment.out, dump_samples=cfg.log.samples,
        eval_reward=cfg.eval.reward)


def trainer_config(cfg: AppConfig, model_path: str):
    from areal_fast.trainer import TrainerConfig

    t = cfg.train
    optim = t.optim
    if optim.total_steps == 0 and optim.lr_schedule != "constant":
        import dataclasses

        optim = dataclasses.replace(optim, total_steps=cfg.experiment.total_steps)
    return TrainerConfig(model_path=model_path, ppo=t.ppo, optim=optim, max_tokens_per_mb=t.max_tokens_per_mb,
                         attn_impl=t.attn_impl, param_dtype=t.param_dtype,
                         gradient_checkpointing=t.gradient_checkpointing, seed=cfg.experiment.seed,
                         device=t.device)


# ----------------------------------------------------------------------------- the run


def run_train(cfg: AppConfig, *, progress: bool | None = None, say=None) -> dict:
    """Train one run; returns the controller's summary (also written to <out>/summary.json)."""
    out = cfg.experiment.out
    out.mkdir(parents=True, exist_ok=True)
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    rank = int(os.environ.get("RANK", "0"))
    under_torchrun = "LOCAL_RANK" in os.environ
    if under_torchrun:
        die_with_parent()  # a rank must not outlive its torchrun agent (which dies with the launcher)
    setup_logging(out, cfg.log.level, console=rank == 0)
    if cfg.train.world_size > 1 and not under_torchrun:
        return _run_torchrun(cfg, say, cfg.log.progress if progress is None else progress)
    if cfg.train.gpus and not under_torchrun:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.train.gpus
    import torch

    # one thread: 2 OpenMP threads on 2 busy cores spin and run ~10x slower than one (measured)
    torch.set_num_threads(cfg.train.threads)
    path = model_dir(cfg, say) if rank == 0 or not cfg.model.warm_start.enabled else cfg.model.path
    if rank > 0:
        return _follower(cfg, path)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    with LocalLauncher(out / "logs") as launcher:
        if cfg.rollout.servers:
            urls = [u.rstrip("/") for u in cfg.rollout.servers]
        else:
            say(f"starting {cfg.rollout.n_servers} {cfg.rollout.engine} server(s)...")
            urls = [p.url for p in launcher.start_servers(cfg.rollout, path, seed=cfg.experiment.seed)]
        summary = asyncio.run(_run_async(cfg, path, urls, launcher, say,
                                         cfg.log.progress if progress is None else progress))
    if cfg.log.plots:
        plots = plot_run(out / "metrics.jsonl", out / "plots")
        if plots:
            say(f"plots: {', '.join(str(p) for p in plots)}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _follower(cfg: AppConfig, path: str) -> dict:
    from areal_fast.launch.runtime import follower_loop
    from areal_fast.trainer import PPOActor

    actor = PPOActor(trainer_config(cfg, path))
    follower_loop(actor)
    return {}


def _run_torchrun(cfg: AppConfig, say, progress: bool) -> dict:
    out = cfg.experiment.out
    path = model_dir(cfg, say)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    with LocalLauncher(out / "logs") as launcher:
        servers = cfg.rollout.servers
        if not servers:
            say(f"starting {cfg.rollout.n_servers} {cfg.rollout.engine} server(s)...")
            servers = [p.url for p in launcher.start_servers(cfg.rollout, path, seed=cfg.experiment.seed)]
        overrides = [f"model.path={path}", "model.warm_start.enabled=false", f"rollout.servers={json.dumps(servers)}",
                     "log.progress=false"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.train.world_size),
               "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()),
               "-m", "areal_fast.cli", "train", str(out / "config.yaml"), *overrides]
        say(f"starting {cfg.train.world_size} trainer ranks (torchrun); log {out / 'logs' / 'trainer.log'}")
        env = {"OMP_NUM_THREADS": str(cfg.train.threads)}
        if cfg.train.gpus:
            env["CUDA_VISIBLE_DEVICES"] = cfg.train.gpus
        trainer = launcher.start("trainer", cmd, env=env)
        bar = ProgressBar(cfg.experiment.total_steps, 0, enabled=progress)
        metrics = out / "metrics.jsonl"
        seen = 0
        try:
            while trainer.alive():
                for p in launcher.dead():
                    if p is not trainer:
                        log.warning("%s", p.death_message())
                rows = read_jsonl(metrics) if metrics.is_file() else []
                for m in rows[seen:]:
                    bar(m)
                seen = len(rows)
                time.sleep(_WATCH_S)
            for m in (read_jsonl(metrics) if metrics.is_file() else [])[seen:]:
                bar(m)
        finally:
            bar.close()
        if trainer.proc.returncode != 0:
            raise ProcessDied(trainer.death_message())
    summary_path = out / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}


async def _run_async(cfg: AppConfig, path: str, urls: list[str], launcher: LocalLauncher, say,
                     progress: bool) -> dict:
    from areal_fast.data import load_tokenizer
    from areal_fast.launch.runtime import (
        ActorTrainer,
        ClientRollout,
        DiskSync,
        DistributedSync,
        ManagerGate,
        ServiceReward,
    )
    from areal_fast.reward import RewardService
    from areal_fast.rollout.client import RolloutClient
    from areal_fast.rollout.staleness import StalenessManager
    from areal_fast.trainer import PPOActor

    out = cfg.experiment.out
    tok = load_tokenizer(cfg.model.tokenizer or path)
    prompts, evals = load_data(cfg, tok)
    resume = latest_checkpoint(out / "checkpoints") if cfg.experiment.resume else None
    if resume is None:  # a fresh start: nothing of an earlier attempt may mix into this run's records
        for f in ("metrics.jsonl", "samples.jsonl", "summary.json"):
            (out / f).unlink(missing_ok=True)
        if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
            aside = out / f"checkpoints.old-{time.strftime('%Y%m%d-%H%M%S')}"
            (out / "checkpoints").rename(aside)
            say(f"experiment.resume=false: moved the earlier checkpoints to {aside}")
    start_step = int(resume.name.split("_")[1]) if resume is not None else 0
    truncate_jsonl(out / "metrics.jsonl", start_step)
    if resume is not None:
        say(f"resuming from {resume}")

    def is_dead(url: str) -> bool:
        for p in launcher.procs:
            if p.url == url:
                return not p.alive()
        return not http_ok(url + "/health")

    client = RolloutClient(urls, request_timeout_s=cfg.rollout.request_timeout, down_cooldown_s=2.0)
    service = RewardService(num_workers=cfg.reward.workers, timeout_s=cfg.reward.timeout,
                            default_reward=cfg.reward.name)
    metrics_sink = JsonlSink(out / "metrics.jsonl")
    sinks = [lambda m: m.get("kind") == "samples" or metrics_sink(m)]
    closers = [metrics_sink]
    if cfg.log.samples:
        truncate_jsonl(out / "samples.jsonl", start_step)
        samples_sink = JsonlSink(out / "samples.jsonl")
        sinks.append(lambda m: m.get("kind") == "samples" and samples_sink(m))
        closers.append(samples_sink)
    if cfg.log.tensorboard:
        closers.append(TensorBoardSink(out / "tensorboard"))
        sinks.append(closers[-1])
    bar = ProgressBar(cfg.experiment.total_steps, start_step, enabled=progress)
    sinks.append(bar)
    closers.append(bar)
    trainer = None
    try:
        async with client:
            await service.start()
            actor = await asyncio.to_thread(PPOActor, trainer_config(cfg, path))
            trainer = ActorTrainer(actor)
            rollout = ClientRollout(client, is_dead=is_dead)
            if cfg.weights.method == "distributed":
                syncer = DistributedSync(trainer, rollout, urls, out / "weights_sync", cfg.weights.bucket_bytes,
                                         cfg.weights.timeout, actor.device.type)
            else:
                syncer = DiskSync(trainer, rollout, out / "weights_sync")
            r = cfg.rollout
            gate = ManagerGate(StalenessManager(cfg.train.batch_size, r.max_staleness, r.max_concurrent,
                                                strict=r.strict_staleness))
            ctl = Controller(controller_settings(cfg, tok), prompts, tok, rollout, ServiceReward(service), trainer,
                             syncer, gate, eval_prompts=evals, callbacks=sinks)
            watch = asyncio.create_task(_watchdog(launcher, rollout))
            run = asyncio.create_task(ctl.run(resume))
            done, _ = await asyncio.wait({watch, run}, return_when=asyncio.FIRST_COMPLETED)
            if run not in done:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                watch.result()  # raises the watchdog's error
            watch.cancel()
            summary = run.result()
            if cfg.checkpoint.save_hf:
                await asyncio.to_thread(trainer.export, out / "final")
                _copy_tokenizer(Path(cfg.model.tokenizer or path), out / "final")
            summary["reward_stats"] = service.stats()
            return summary
    finally:
        if trainer is not None:
            trainer.stop()
        service.close()
        for s in closers:
            s.close()


def _copy_tokenizer(src: Path, dest: Path) -> None:
    """Tokenizer files travel with the exported weights so that final/ is a complete model dir."""
    import shutil

    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (dest / f.name).exists():
            shutil.copy(f, dest / f.name)


async def _watchdog(launcher: LocalLauncher, rollout) -> None:
    """Drop dead servers from the pool; fail fast when none is left or a critical process died."""
    while True:
        for p in launcher.check():
            if p.url and p.url in rollout.urls:
                logging.getLogger("areal_fast").warning("server %s died; continuing with %d server(s)", p.url,
                                                        len(rollout.urls) - 1)
                if len(rollout.urls) == 1:
                    raise ProcessDied(f"the last inference server died: {p.death_message()}")
                rollout.remove_server(p.url)
        await asyncio.sleep(_WATCH_S)
