"""The tiny Qwen3-MoE on two gloo ranks under torchrun (FSDP2): each rank holds half of every
block's experts (dim-0 shards of the fused expert tensors), one PPO step gives the parameters of
the same step on one rank, and the weight-sync gather of the sharded experts, renamed to the
checkpoint's per-expert tensors on rank 0, carries exactly the trained weights.

This file is also the torchrun worker (``python -m torch.distributed.run ... test_moe_dist.py MODEL OUT``).
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # as a torchrun worker: this folder and tests/ (tolerances)

from _shared import run_ranks  # noqa: E402
from test_trainer_actor import make_batch  # noqa: E402
from tolerances import FP32_MULTI_RANK_PARAM_ATOL  # noqa: E402

from areal_fast.trainer import OptimConfig, PPOActor, PPOConfig, TrainerConfig  # noqa: E402

VOCAB = 100
pytestmark = pytest.mark.slow  # two trainer ranks under torchrun (gloo)


def config(model_path, max_tokens):
    return TrainerConfig(model_path=model_path, device="cpu", max_tokens_per_mb=max_tokens, ppo=PPOConfig(),
                         optim=OptimConfig(lr=1e-3, eps=1e-6, grad_clip=0.5))


def worker(model_path, out_dir):
    import faulthandler

    from areal_fast.trainer.model import shutdown_process_group
    from areal_fast.weights.experts import to_checkpoint_layout
    from areal_fast.weights.gather import BucketGatherer, collect_sources, send_dtypes

    faulthandler.enable()  # a rank that aborts (SIGABRT) prints where it was
    actor = PPOActor(config(model_path, max_tokens=40))
    assert actor.world == 2
    shard = actor.sharded_state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    out = {"local_experts": tuple(shard.to_local().shape)}
    actor.train_batch(make_batch(8, seed=11, group_size=4))
    out["params"] = {n: t.clone() for n, t in actor.iter_full_params()}
    src = collect_sources(actor.sharded_state_dict())
    wire = {}

    class _Done:
        def wait(self):
            pass

    def consume(bucket):
        b = to_checkpoint_layout(bucket)
        wire.update({n: b.tensor(i).clone() for i, n in enumerate(b.names)})
        return _Done()

    BucketGatherer(8 << 10).run(src, send_dtypes(src, None), consume if actor.rank == 0 else None)
    out["wire"] = wire
    if actor.rank == 0:
        torch.save(out, os.path.join(out_dir, "two_ranks.pt"))
    shutdown_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("moe_dist")
    model_path = build_tiny_qwen3_moe(str(root / "model"), vocab_size=VOCAB, seed=7)
    return model_path, run_ranks(__file__, 2, model_path, root, result=root / "two_ranks.pt")


def test_two_ranks_shard_the_experts_and_step_as_one_rank(two_rank_run):
    model_path, two = two_rank_run
    assert two["local_experts"] == (2, 64, 64)  # 4 experts [2I=64, H=64]: two on each rank
    actor = PPOActor(config(model_path, max_tokens=4096))
    actor.train_batch(make_batch(8, seed=11, group_size=4))
    one = dict(actor.iter_full_params())
    assert sorted(one) == sorted(two["params"])
    for n in one:
        torch.testing.assert_close(one[n], two["params"][n], rtol=0, atol=FP32_MULTI_RANK_PARAM_ATOL, msg=n)


def test_gathered_expert_shards_reach_the_wire_as_per_expert_tensors(two_rank_run):
    from areal_fast.weights.experts import to_checkpoint_state

    _, two = two_rank_run
    want = to_checkpoint_state(two["params"])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in two["wire"]
    assert sorted(two["wire"]) == sorted(want)
    assert all(torch.equal(two["wire"][k], want[k]) for k in want)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
