"""Two gloo ranks under torchrun vs one rank in this process: the same batch gives the same
gradients and update whatever the rank count and micro-batch split; a checkpoint written on 2
ranks resumes on 1 rank with the same next step; batch-normalised advantages are all-reduced.

This file is also the torchrun worker (``python -m torch.distributed.run ... test_trainer_dist.py OUT``).
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # as a torchrun worker: this folder and tests/ (tolerances)

from _shared import run_ranks  # noqa: E402
from test_trainer_actor import make_batch, make_tiny_model  # noqa: E402
from tolerances import FP32_GRAD_TOL, FP32_MULTI_RANK_METRIC_TOL, FP32_MULTI_RANK_PARAM_ATOL, FP64_FEW_OPS_ATOL  # noqa: E402

from areal_fast.ops import PPOLossConfig  # noqa: E402
from areal_fast.trainer import OptimConfig, PPOActor, PPOConfig, TrainerConfig, load_checkpoint, save_checkpoint  # noqa: E402
from areal_fast.trainer.batch import to_seq  # noqa: E402

LR = 1e-3
# Adam's step is ~ lr * g / (|g| + eps): gradients that are exactly 0 in theory (the k_proj bias:
# softmax ignores a per-row constant) are ~1e-10 noise; eps = 1e-6 keeps their update below 1e-7
# instead of +-lr. Real gradients here are 1e-5..1e-2, so the step is still sign-like.
ADAM_EPS = 1e-6


def config(model_path, max_tokens):
    return TrainerConfig(model_path=model_path, device="cpu", max_tokens_per_mb=max_tokens,
                         ppo=PPOConfig(ppo_n_minibatches=2, adv_batch_norm=True, loss=PPOLossConfig(kl_coef=0.05)),
                         optim=OptimConfig(lr=LR, eps=ADAM_EPS, grad_clip=0.5, warmup_steps=1, total_steps=5,
                                           lr_schedule="linear"))


def observe_grads(store):
    def obs(actor):
        store.append({n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()})
    return obs


def params(actor):
    return {n: t.clone() for n, t in actor.iter_full_params()}


def run_steps(actor, out, ckpt=None):
    """Step 1 (grads + params), optional checkpoint, step 2 (params)."""
    grads = []
    actor._grad_observer = observe_grads(grads)
    out["m1"] = actor.train_batch(make_batch(14, seed=11, group_size=5))
    out["p1"] = params(actor)
    out["g1"] = list(grads)
    if ckpt is not None:
        save_checkpoint(actor, ckpt)
    out["m2"] = actor.train_batch(make_batch(14, seed=12, group_size=5))
    out["p2"] = params(actor)


def worker(model_path, out_dir):
    import faulthandler

    import torch.distributed as dist

    from areal_fast.trainer.model import shutdown_process_group

    faulthandler.enable()  # a rank that aborts (SIGABRT) prints where it was

    actor = PPOActor(config(model_path, max_tokens=40))
    assert actor.world == 2
    out = {}
    run_steps(actor, out, ckpt=os.path.join(out_dir, "ckpt"))
    # ranks hold different micro-batches each step (the plan splits the batch)
    from areal_fast.trainer.advantages import batch_normalize

    full = torch.arange(6, dtype=torch.float64) ** 2
    mine = full[actor.rank * 3:(actor.rank + 1) * 3]
    out["bn"] = batch_normalize(mine, torch.ones(3), eps=0.0)
    gathered = [None, None]
    dist.all_gather_object(gathered, out["bn"])
    out["bn"] = torch.cat(gathered)
    out["n_mbs"] = len(actor._plan([to_seq(s) for s in make_batch(14, seed=11)], list(range(14))))
    if actor.rank == 0:
        torch.save(out, os.path.join(out_dir, "two_ranks.pt"))
    shutdown_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_dist")
    model_path = str(root / "model")
    make_tiny_model(model_path, seed=7)
    return model_path, root, run_ranks(__file__, 2, model_path, root, result=root / "two_ranks.pt")


def test_two_ranks_many_microbatches_equal_one_rank_one_microbatch(two_rank_run):
    model_path, root, two = two_rank_run
    assert two["n_mbs"] >= 2  # the 2-rank run really split each rank's share
    one = {}
    run_steps(PPOActor(config(model_path, max_tokens=4096)), one)
    for k in ("grad_norm", "loss", "n_loss_tokens", "ratio_mean", "kl_mean"):
        assert one["m1"][k] == pytest.approx(two["m1"][k], **FP32_MULTI_RANK_METRIC_TOL), k
    assert len(one["g1"]) == len(two["g1"]) == 2  # two minibatches = two optimizer steps
    for g_one, g_two in zip(one["g1"], two["g1"]):
        for n in g_one:
            torch.testing.assert_close(g_one[n], g_two[n], **FP32_GRAD_TOL, msg=n)
    for n in one["p1"]:
        torch.testing.assert_close(one["p1"][n], two["p1"][n], rtol=0, atol=FP32_MULTI_RANK_PARAM_ATOL, msg=n)
        torch.testing.assert_close(one["p2"][n], two["p2"][n], rtol=0, atol=2 * FP32_MULTI_RANK_PARAM_ATOL, msg=n)


def test_checkpoint_from_two_ranks_resumes_on_one(two_rank_run):
    model_path, root, two = two_rank_run
    actor = PPOActor(config(model_path, max_tokens=4096))
    load_checkpoint(actor, str(root / "ckpt"))
    assert actor.version == 1
    for n, t in actor.iter_full_params():
        assert torch.equal(t, two["p1"][n]), n
    m2 = actor.train_batch(make_batch(14, seed=12, group_size=5))
    assert m2["lr"] == pytest.approx(two["m2"]["lr"])
    for n, t in actor.iter_full_params():
        torch.testing.assert_close(t, two["p2"][n], rtol=0, atol=2 * FP32_MULTI_RANK_PARAM_ATOL, msg=n)

    # negative control: the same weights with a fresh optimizer (no Adam moments) step elsewhere
    fresh = PPOActor(config(model_path, max_tokens=4096))
    with torch.no_grad():
        for (_, dst), (n, _src) in zip(fresh.model.named_parameters(), actor.model.named_parameters()):
            dst.to_local().copy_(two["p1"][n.replace("lm.", "", 1)])  # world size 1: the shard is whole
    fresh.version, fresh.scheduler.last_epoch = 1, 1
    fresh.train_batch(make_batch(14, seed=12, group_size=5))
    diff = max((t - two["p2"][n]).abs().max().item() for n, t in fresh.iter_full_params())
    assert diff > 100 * FP32_MULTI_RANK_PARAM_ATOL


def test_batch_norm_is_all_reduced(two_rank_run):
    from areal_fast.trainer.advantages import batch_normalize

    _, _, two = two_rank_run
    full = torch.arange(6, dtype=torch.float64) ** 2
    torch.testing.assert_close(two["bn"], batch_normalize(full, eps=0.0), atol=FP64_FEW_OPS_ATOL, rtol=0)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
