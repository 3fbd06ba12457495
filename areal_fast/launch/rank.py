"""One trainer rank of a run: ``python -m areal_fast.launch.rank TRAINER_CONFIG``.

The launcher writes the resolved config of the run (model path resolved, warm start done, the
servers' URLs filled in) to ``<output_dir>/trainer_config.yaml``; every rank reads it, nothing else.
The API key of the servers comes in the environment (``AREAL_FAST_API_KEY``), or as an argument of
:func:`run_rank` for the rank inside the launcher's process; never on a command line or in the config
file. The client and the weight sync both take ``weights.resolved_api_key`` (filled from the run's ``api_key``).

Rank 0 builds the real parts, wraps them in the controller's ports (``launch.runtime``) and runs the
controller; ranks > 0 follow rank 0's announced trainer calls (``runtime.follower_loop``). With
``train.world_size = 1`` on the local launcher, rank 0 runs inside the launching process
(:func:`run_rank`), which saves a second interpreter and its imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from areal_fast.controller import Controller, ControllerSettings
from areal_fast.diskutil import write_private
from areal_fast.elastic.liveness import DEFAULT_HANG_TIMEOUT_S, server_is_dead, server_state
from areal_fast.launch.base import PrivateFileHandler
from areal_fast.metrics.services import RecordFilter, open_sinks  # noqa: F401 - RecordFilter: also here
from areal_fast.procutil import die_with_parent

log = logging.getLogger("areal_fast")
_WATCH_S = 0.5
_UNREACHABLE_ROUNDS = 3  # a server is declared dead after this many refused connections in a row


def setup_logging(out: Path, level: str, console: bool = True, name: str = "controller.log") -> None:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [PrivateFileHandler(out / "logs" / name)]
    if console:
        h = logging.StreamHandler(sys.stderr)
        h.setLevel(logging.WARNING)  # the progress bar owns the terminal; details go to the log file
        handlers.append(h)
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def load_data(cfg, tokenizer):
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


def resume_key(cfg, prompts) -> dict:
    """What the data order and the meaning of a saved position depend on: a checkpoint written
    with other values cannot be resumed without training some prompts twice."""
    h = hashlib.sha256()
    for row in prompts.rows:
        h.update(row.text.encode())
        h.update(b"\0")
    return {"experiment.seed": cfg.experiment.seed, "data.train": cfg.data.train, "data.shuffle": cfg.data.shuffle,
            "data.rows": len(prompts.rows), "data.sha256": h.hexdigest()[:16],
            "train.batch_size": cfg.train.batch_size, "rollout.group_size": cfg.rollout.group_size}


def controller_settings(cfg, tokenizer, key: dict) -> ControllerSettings:
    r = cfg.rollout
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = {"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k, "stop_token_ids": stop}
    eval_sampling = {"max_new_tokens": cfg.eval.max_new_tokens or r.max_new_tokens, "temperature": 0.0,
                     "stop_token_ids": stop}
    return ControllerSettings(
        batch_size=cfg.train.batch_size, group_size=r.group_size, total_steps=cfg.experiment.total_steps,
        sampling=sampling, eval_sampling=eval_sampling, eval_every=cfg.eval.every_steps,
        eval_at_start=cfg.eval.at_start, checkpoint_every=cfg.checkpoint.every_steps,
        keep_last=cfg.checkpoint.keep_last, output_dir=cfg.experiment.out, dump_samples=cfg.log.samples,
        eval_reward=cfg.eval.reward, resume_key=key, workflow=r.workflow, workflow_args=dict(r.workflow_args),
        tool_timeout=r.tool_timeout, buffer_memory_mb=r.buffer_memory_mb)


def trainer_config(cfg, model_path: str):
    """The run's trainer section (``cfg.train`` is the trainer's own config, its derived values
    filled in) for the model at ``model_path``."""
    return dataclasses.replace(cfg.train, model_path=model_path)


# ----------------------------------------------------------------------------- one rank


def run_rank(cfg, *, api_key: str | None = None, progress: bool = False, say=None,
             metrics_key: str | None = None) -> dict:
    """Run this process's trainer rank of the run described by ``cfg`` (a trainer config: model
    path resolved, ``rollout.servers`` filled in). Returns rank 0's summary ({} on other ranks).

    ``api_key``: the servers' key, given by a launcher that runs the rank in its own process; it
    becomes the run's ``api_key`` (and so ``weights.api_key``) of a copy of ``cfg``. Without it the key is
    ``weights.resolved_api_key`` as configured (a rank process: $AREAL_FAST_API_KEY from the launcher).
    ``metrics_key``: the bearer key of an exposed Prometheus endpoint (a rank process: $AREAL_FAST_METRICS_KEY)."""
    if api_key is not None:
        cfg = dataclasses.replace(cfg, api_key=api_key, weights=dataclasses.replace(cfg.weights))  # a copy to fill
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = cfg.experiment.out
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(out, cfg.log.level, console=rank == 0)
    import torch

    from areal_fast.trainer.model import shutdown_process_group

    # one thread: 2 OpenMP threads on 2 busy cores spin and run ~10x slower than one (measured)
    torch.set_num_threads(cfg.train.threads)
    if rank > 0:
        from areal_fast.launch.runtime import follower_loop
        from areal_fast.trainer import PPOActor

        follower_loop(PPOActor(trainer_config(cfg, cfg.model.path)))
        shutdown_process_group(barrier=False)  # rank 0's "stop" was the last collective, after success or failure
        return {}
    from areal_fast.metrics_config import METRICS_KEY_ENV
    from areal_fast.rollout.loop import run_event_loop  # uvloop where installed (AREAL_FAST_EVENT_LOOP)

    metrics_key = metrics_key or os.environ.get(METRICS_KEY_ENV)
    exposed = {"metrics_key": metrics_key} if metrics_key else {}  # only an exposed endpoint has one
    summary = run_event_loop(_rank0(cfg, cfg.weights.resolved_api_key, say, progress, **exposed))  # the sync's key too
    write_summary(out, summary)
    if "RANK" in os.environ:  # a rank process of its own (an in-process rank 0 keeps the caller's group)
        shutdown_process_group(barrier=False)  # "stop" was announced: the followers are done
    return summary


def write_summary(out: Path, summary: dict) -> None:
    """``<out>/summary.json`` (a planted symlink there is refused, not followed: ``diskutil.write_private``)."""
    write_private(Path(out) / "summary.json", json.dumps(summary, indent=1).encode())


async def _rank0(cfg, api_key: str | None, say, progress: bool, metrics_key: str | None = None) -> dict:
    from areal_fast.data import load_tokenizer
    from areal_fast.elastic.empty_pool import refill_empty_pool
    from areal_fast.elastic.pool_watch import watch_members
    from areal_fast.launch.runtime import ActorTrainer, ServiceReward, make_sync_port
    from areal_fast.metrics.prometheus import start_exporter
    from areal_fast.reward import RewardService
    from areal_fast.rollout.staleness import StalenessManager
    from areal_fast.trainer import PPOActor

    out, path, urls = cfg.experiment.out, cfg.model.path, [u.rstrip("/") for u in cfg.rollout.servers]
    tok = load_tokenizer(cfg.model.tokenizer or path)
    prompts, evals = load_data(cfg, tok)
    r = cfg.rollout
    gate = StalenessManager(cfg.train.batch_size, r.max_staleness, r.max_concurrent, strict=r.strict_staleness)
    service = RewardService(num_workers=cfg.reward.workers, timeout_s=cfg.reward.timeout,
                            default_reward=cfg.reward.name)
    closers: list = []
    trainer = None
    where: dict = {}  # sink -> where it writes (summary["sinks"]: the launcher prints them at the end)
    try:
        exporter = start_exporter(cfg, metrics_key)  # listening before the long start: a taken port fails now
        if exporter is not None:
            closers.append(exporter)
            where["prometheus"] = exporter.where()
            say(f"prometheus: {exporter.where()}")
        lora = cfg.train.lora
        width = experts = None
        if r.return_routed_experts:  # routing replay's record: decoder layers x top-k ids a position
            from areal_fast.moe_routing import routing_shape

            width, experts = routing_shape(path)
        async with rollout_port(r, urls, api_key, lora.name if lora else None, width, experts) as rollout:
            await service.start()
            actor = await asyncio.to_thread(PPOActor, trainer_config(cfg, path))
            trainer = ActorTrainer(actor)
            from areal_fast.backends.registry import lora_transport, weight_transport

            if lora is not None:  # adapter-only updates (weights/lora_sync.py)
                from areal_fast.weights.lora_port import LoRASync

                syncer = LoRASync(trainer, rollout, out / "weights_sync", cfg.weights, lora=lora,
                                  transport=lora_transport(r.api), base_model=path)
            else:  # the servers' API's transport of weights.method
                syncer = make_sync_port(cfg.weights, trainer, rollout, out / "weights_sync",
                                        transport=weight_transport(r.api, cfg.weights.method))
            ctl = Controller(controller_settings(cfg, tok, resume_key(cfg, prompts)), prompts, tok,
                             exporter.metered(rollout) if exporter else rollout,
                             ServiceReward(service), trainer, syncer, gate, eval_prompts=evals)
            resumed = ctl.restore_newest() if cfg.experiment.resume else None
            if resumed is not None:
                say(f"resuming from {resumed}")
            if lora is not None and ctl.version == 0:  # the servers hold no adapter yet; requests name it
                await syncer.sync(0)
            ctl.callbacks = open_sinks(cfg, ctl.version, progress, closers, where)
            if exporter is not None:
                ctl.callbacks.append(exporter.observe)
                sampler = asyncio.create_task(exporter.sample_forever(ctl, rollout))
            empty = empty_pool(cfg, rollout, syncer)
            watch = asyncio.create_task(_watch_servers(rollout, out / "logs", r.hang_timeout, empty))
            follow = asyncio.create_task(watch_members(rollout, syncer, out, hang_timeout_s=r.hang_timeout,
                                                       external=urls))  # elastic servers (pool_watch)
            refill = asyncio.create_task(refill_empty_pool(rollout, syncer, ctl.sync_between_steps, empty=empty))
            scaler = autoscaler(cfg, rollout, syncer, ctl)  # the server-count policy (docs/autoscale.md), or None
            run = asyncio.create_task(ctl.run())
            done, _ = await asyncio.wait({watch, run}, return_when=asyncio.FIRST_COMPLETED)
            if run not in done:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                watch.result()  # raises the watchdog's error
            watch.cancel()
            follow.cancel()
            refill.cancel()
            if scaler is not None:
                scaler.cancel()
            if exporter is not None:
                sampler.cancel()
            summary = run.result()
            summary["sinks"] = where
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


def autoscaler(cfg, rollout, syncer, ctl) -> asyncio.Task | None:
    """With ``rollout.autoscale.enabled``: the policy as a callback of the controller (one decision a
    step, through the launcher's target) and the task that applies ``areal-fast scale``'s bound at once
    (``elastic.autoscale``); None when off."""
    r = cfg.rollout
    if not r.autoscale.enabled:
        return None
    from areal_fast.elastic.autoscale import Autoscaler
    from areal_fast.elastic.members import read_members

    members = read_members(cfg.experiment.out)
    if members is None:  # servers of rollout.servers: no launcher to start or stop any
        raise ValueError("rollout.autoscale.enabled: the policy adds and removes the servers the launcher starts; "
                         "this run's servers were given (rollout.servers): leave them out, or turn autoscale off")
    scaler = Autoscaler(r.autoscale, cfg.experiment.out, rollout, syncer, ctl._emit,
                        servers=len(members), eta=r.max_staleness,
                        batch_groups=cfg.train.batch_size)
    ctl.callbacks.append(scaler.on_record)
    return asyncio.create_task(scaler.watch(), name="autoscale")


def empty_pool(cfg, rollout, syncer):
    """The watchdog's :class:`~areal_fast.elastic.empty_pool.EmptyPool`: the pool may become empty
    when a server can come back (launched servers relaunched, or servers of ``rollout.servers``,
    which ``elastic.rejoin`` offers again) and the rollout port can wait for one (not the sharded
    client); then ``rollout.allow_empty`` is set and the wait lasts ``rollout.empty_pool_timeout``."""
    from areal_fast.elastic.empty_pool import EmptyPool
    from areal_fast.elastic.members import read_members

    r, out = cfg.rollout, cfg.experiment.out

    def can_come_back() -> bool:  # asked late: the launcher publishes members.json once it watches them
        return r.relaunch_servers or read_members(out) is None

    waits = hasattr(rollout, "allow_empty") and can_come_back()
    if waits:
        rollout.allow_empty = True
    return EmptyPool(r.empty_pool_timeout if waits else None, out / "logs", can_come_back,
                     getattr(syncer, "membership", None))


@contextlib.asynccontextmanager
async def rollout_port(r, urls: list[str], api_key: str | None, lora_name: str | None = None,
                       routed_experts_width: int | None = None, num_experts: int | None = None):
    """The controller's rollout port over the servers at ``urls``, started, and closed on exit:
    ``ClientRollout`` over one ``RolloutClient`` in this process, or with ``rollout.client_processes``
    > 1 a ``ShardedRollout`` (the same port over clients in worker processes). Either forgets a
    server that :func:`server_is_dead` says is gone or hung (``rollout.hang_timeout``)."""
    is_dead = functools.partial(server_is_dead, hang_timeout_s=r.hang_timeout)
    options = dict(api_key=api_key, request_timeout_s=r.request_timeout, control_timeout_s=r.control_timeout,
                   down_cooldown_s=2.0, pause_mode=r.pause_mode)
    if lora_name is not None:  # a LoRA run: every request names the adapter (docs/lora.md)
        options["lora_name"] = lora_name
    if routed_experts_width:  # every request asks for its routing (docs/moe.md), ids below the model's experts
        options["routed_experts_width"] = routed_experts_width
        options["num_experts"] = num_experts
    from areal_fast.backends.registry import client_class, client_options, make_client  # the API's adapter

    if r.client_processes > 1:
        from areal_fast.rollout.sharded import ShardedRollout

        async with ShardedRollout(urls, r.client_processes, client_class=client_class(r.api), is_dead=is_dead,
                                  **client_options(r), **options) as port:
            yield port
    else:
        from areal_fast.rollout.port import ClientRollout

        async with make_client(r, urls, **options) as client:
            yield ClientRollout(client, is_dead=is_dead)


def _copy_tokenizer(src: Path, dest: Path) -> None:
    """Tokenizer files travel with the exported weights so that final/ is a complete model dir."""
    import shutil

    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (dest / f.name).exists():
            shutil.copy(f, dest / f.name)


async def _watch_servers(rollout, log_dir, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, empty=None) -> None:
    """Drop servers that stopped answering from the pool. The last one too when a server can come
    back (``empty``: :class:`~areal_fast.elastic.empty_pool.EmptyPool`, which fails the run past
    ``rollout.empty_pool_timeout``); without ``empty``, or when none can, fail instead.

    Dead means the connection is refused (or reset) several times in a row; hung, that it was taken
    and GET /model_info got no answer within ``hang_timeout_s`` (once is enough: that is the
    deadline). Any HTTP answer, a 503 from a server paused for a weight update included, is alive.
    Every server is asked at once, so a hung one delays nobody else's check."""
    from areal_fast.elastic.empty_pool import EmptyPool

    empty = empty or EmptyPool(None, log_dir)
    misses: dict[str, int] = {}
    while True:
        urls = list(rollout.urls)
        states = await asyncio.gather(*(asyncio.to_thread(server_state, u, hang_timeout_s) for u in urls))
        for url, state in zip(urls, states):
            misses[url] = misses.get(url, 0) + 1 if state == "refused" else 0
            if state == "hung" or misses[url] >= _UNREACHABLE_ROUNDS:
                why = (f"no answer to GET /model_info within rollout.hang_timeout={hang_timeout_s}s" if state == "hung"
                       else f"connection refused {_UNREACHABLE_ROUNDS} times")
                if url not in rollout.urls:
                    continue
                if len(rollout.urls) == 1 and not empty.may_empty():
                    raise RuntimeError(f"the last inference server {url} stopped answering ({why}); see logs in "
                                       f"{log_dir}")
                log.warning("server %s %s (%s); continuing with %d server(s)%s", url,
                            "hung" if state == "hung" else "died", why, len(rollout.urls) - 1,
                            "" if len(rollout.urls) > 1 else ": the pool is empty")
                rollout.remove_server(url)
        empty.check(rollout.urls)
        await asyncio.sleep(_WATCH_S)


def main(argv: list[str] | None = None) -> int:
    from areal_fast.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m areal_fast.launch.rank TRAINER_CONFIG", file=sys.stderr)
        return 2
    if "LOCAL_RANK" in os.environ:
        die_with_parent()  # a rank must not outlive its torchrun agent (which dies with the launcher)
    run_rank(load_config(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
