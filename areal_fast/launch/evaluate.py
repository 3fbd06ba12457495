"""``areal-fast eval CONFIG [--checkpoint DIR]``: greedy evaluation of a policy on the held-out set.

DIR is a Hugging Face model directory (default ``<output_dir>/final``, written at the end of
training) or a training checkpoint (``<output_dir>/checkpoints/step_N``), which is first exported
to HF safetensors through the trainer. One inference server is launched for the evaluation.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from areal_fast.checkpoint import STATE_FILE, trainer_dir
from areal_fast.config import AppConfig
from areal_fast.launch.base import SECRETS_DIR


def _export_training_checkpoint(cfg: AppConfig, ckpt: Path, dest: Path) -> Path:
    from areal_fast.launch.rank import trainer_config
    from areal_fast.launch.train import model_dir
    from areal_fast.trainer import PPOActor, export_hf, load_checkpoint

    base = model_dir(cfg, say=lambda m: None)
    actor = PPOActor(trainer_config(cfg, base))
    load_checkpoint(actor, str(trainer_dir(ckpt)))
    export_hf(actor, str(dest))
    for f in Path(base).iterdir():  # the tokenizer files travel with the weights
        if f.is_file() and not f.name.endswith(".safetensors") and not (dest / f.name).exists():
            shutil.copy(f, dest / f.name)
    return dest


def run_eval(cfg: AppConfig, checkpoint: str | None = None) -> dict:
    from areal_fast.data import load_tokenizer
    from areal_fast.launch.local import LocalLauncher
    from areal_fast.launch.rank import load_data

    out = cfg.experiment.out
    path = Path(checkpoint) if checkpoint else out / "final"
    if not path.is_dir():
        raise FileNotFoundError(f"no model at {str(path)!r}: train first or pass --checkpoint DIR")
    tmp = None
    if (path / STATE_FILE).is_file():
        tmp = Path(tempfile.mkdtemp(prefix="areal_eval_"))
        path = _export_training_checkpoint(cfg, path, tmp)
    try:
        tok_dir = cfg.model.tokenizer or (str(out / "warm_start") if cfg.model.warm_start.enabled else str(path))
        tok = load_tokenizer(tok_dir if (Path(tok_dir)).is_dir() else path)
        _, evals = load_data(cfg, tok)
        if not evals:
            raise ValueError("no held-out prompts: set data.eval (or use the synthetic task)")
        with LocalLauncher(out / "logs" / "eval", secrets_dir=out / SECRETS_DIR) as launcher:
            rollout_cfg = cfg.rollout
            rollout_cfg.n_servers = 1
            api_key = secrets.token_hex(32)  # hex: a key starting with "-" would read as a flag
            urls = [p.url for p in launcher.start_servers(rollout_cfg, str(path), seed=cfg.experiment.seed,
                                                          api_key=api_key)]
            return asyncio.run(_eval_async(cfg, tok, evals, urls, str(path), api_key))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


async def _eval_async(cfg: AppConfig, tok, evals, urls, path: str, api_key: str) -> dict:
    from areal_fast.backends.registry import make_client
    from areal_fast.reward import RewardService

    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    sampling = {"max_new_tokens": cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, "temperature": 0.0,
                "stop_token_ids": stop}
    t0 = time.perf_counter()
    rewards = RewardService(num_workers=cfg.reward.workers, timeout_s=cfg.reward.timeout,
                            default_reward=cfg.reward.name)
    async with make_client(cfg.rollout, urls, api_key=api_key) as client, rewards as service:
        from areal_fast.agent.client import AgentClient
        from areal_fast.launch.runtime import ServiceReward
        from areal_fast.rollout.port import ClientRollout
        from areal_fast.workflow import EpisodeEngine, EpisodeFailed, check_trajectories, load_workflow

        workflow = load_workflow(cfg.rollout.workflow)  # the run's episode, greedy, as the run evaluates
        rollout, reward = ClientRollout(client), ServiceReward(service)

        async def one(i, row):
            engine = EpisodeEngine(rollout, reward, tok, sampling, f"eval-{i}", training=False,
                                   eval_reward=cfg.eval.reward, tool_timeout_s=cfg.rollout.tool_timeout,
                                   chat_client=AgentClient.for_engine)
            try:
                trajs = check_trajectories(await workflow(row, engine, **cfg.rollout.workflow_args),
                                           f"workflow {cfg.rollout.workflow}")
            except EpisodeFailed:
                trajs = []
            if not trajs:
                return 0.0, 0
            return (sum(float(t.reward) for t in trajs) / len(trajs),
                    sum(t.n_model_tokens for t in trajs) / len(trajs))

        res = await asyncio.gather(*[one(i, r) for i, r in enumerate(evals)])
    return {"model": path, "eval_reward": sum(v for v, _ in res) / len(res),
            "eval_len_mean": sum(n for _, n in res) / len(res), "eval_n": len(res),
            "seconds": round(time.perf_counter() - t0, 2)}
