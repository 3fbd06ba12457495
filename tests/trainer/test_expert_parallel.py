"""Expert parallelism (``train.parallel.ep``, ``areal_fast/trainer/parallel/expert.py``) on the tiny
Qwen3-MoE: 4 gloo ranks under torchrun, expert-parallel 2 x data-parallel 2 (each rank holds 2 of the
4 experts of every block, two ranks hold the same experts and reduce their gradients; the dense
parameters are FSDP2 shards over all 4), against the same model on one rank: the recomputed log-probs
(own routing and a recorded routing replayed), the loss, every gradient and the parameters after one
PPO step (packed micro-batches of uneven lengths, gradient clipping active); the weight-sync gather
from the expert-parallel placement sends exactly the trained weights in the names, shapes and order of
the one-rank gather; a checkpoint saved on one rank resumes on the 4 and back, bitwise. The bytes each
collective sends are counted (the counter checked on collectives of known sizes) and the parameter
bytes a rank holds (``docs/parallelism.md``). The config's refusals and the mesh's rank layout:
``test_parallel_config.py``. The same on NCCL (marked ``gpu``: 4 GPUs, or expert-parallel 2 alone on 2),
in fp32 (``GPU_FP32``), the one-rank reference in one-rank launches of its own (a CUDA trainer needs an
NCCL default group of its own process).

This file is also the torchrun worker
(``python -m torch.distributed.run ... test_expert_parallel.py MODEL OUT [DEVICE [ep|one|resume]]``).
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # as a torchrun worker: this folder and tests/ (tolerances)

from _shared import run_ranks  # noqa: E402
from test_trainer_actor import make_batch  # noqa: E402
from tolerances import FP32_MOE_LOGPROB_ATOL, FP32_MULTI_RANK_PARAM_ATOL, FP32_SAME_MATH_NORM_RTOL  # noqa: E402

from areal_fast.trainer import OptimConfig, ParallelConfig, PPOActor, PPOConfig, TrainerConfig  # noqa: E402

VOCAB = 100
LAYERS, TOP_K, EXPERTS = 2, 2, 4
WORLD, EP = 4, 2  # expert-parallel 2 x data-parallel 2: the expert_dp reduction and the gather's exchange run
# On CUDA the trainer computes in fp32 as on CPU (the CPU tolerances hold): fp32 FSDP2 compute, the
# per-sequence SDPA attention and the reference loss (the bf16 kernels are the GPU tests' business elsewhere).
GPU_FP32 = dict(param_dtype="float32", attn_impl="sdpa_loop", loss_impl="reference")
# The devices of the multi-rank modules' runs: gloo ranks on the CPU, and NCCL ranks (marked ``gpu``).
DEVICES = [pytest.param("cpu", id="gloo"), pytest.param("cuda", id="nccl", marks=pytest.mark.gpu)]


def config(model_path, max_tokens, world=1, ep=1, device="cpu"):
    return TrainerConfig(model_path=model_path, device=device, max_tokens_per_mb=max_tokens, ppo=PPOConfig(),
                         world_size=world, parallel=ParallelConfig(ep=ep),
                         optim=OptimConfig(lr=1e-3, eps=1e-6, grad_clip=0.5),
                         **(GPU_FP32 if device == "cuda" else {}))


def on_cpu(x):
    """``x`` (tensors in dicts, lists and tuples) with every tensor on the CPU."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: on_cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(on_cpu(v) for v in x)
    return x


def batch():
    return make_batch(8, seed=11, group_size=4)


def routed_batch():
    """The batch with a recorded routing (random distinct experts a position, some positions unrecorded)."""
    from array import array

    g = torch.Generator().manual_seed(5)
    out = batch()
    for s in out:
        rows = len(s.prompt_ids) + len(s.output_ids) - 1
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows * LAYERS)])
        ids = ids.view(rows, LAYERS * TOP_K)
        ids[::3] = -1  # every third position unrecorded: the trainer routes it itself
        s.routed_experts = array("h", ids.reshape(-1).tolist())
    return out


def full_grads(actor):
    """HF name -> the whole gradient (DTensor shards and this rank's experts gathered); collective."""
    from areal_fast.trainer.model import hf_name
    from areal_fast.trainer.parallel.expert import as_global, expert_slices

    slices = expert_slices(actor.model)
    out = {}
    for k, p in actor.model.named_parameters():
        g = p.grad
        if k in slices:
            g = as_global(g, slices[k][2], actor.pmesh)
        out[hf_name(k)] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return out


def logprobs_and_step(actor):
    """What one actor computes: log-probs (own routing, replayed routing), then one step's loss,
    gradients and parameters."""
    out = {"logprobs": actor.compute_logprobs(batch())}
    actor.config.ppo.routing_replay = True
    out["replayed"] = actor.compute_logprobs(routed_batch())
    actor.config.ppo.routing_replay = False
    grads = {}
    actor._grad_observer = lambda a: grads.update(full_grads(a))
    from areal_fast.trainer.parallel.cost import CollectiveCounter, param_bytes_per_rank

    with CollectiveCounter() as counted:
        m = actor.train_batch(batch())
    out.update(sent=dict(counted.sent), param_bytes=param_bytes_per_rank(actor.model))
    out.update(loss=m["loss"], grad_norm=m["grad_norm"], grads=grads,
               params={n: t.clone() for n, t in actor.iter_full_params()})  # a clone: one rank's are the weights
    return out


def gathered_wire(actor):
    """rank 0: the buckets of the weight-sync gather, as (names, shapes, bytes) each."""
    from areal_fast.weights.gather import BucketGatherer, collect_sources, send_dtypes

    src = collect_sources(actor.sharded_state_dict())
    wire = []

    class _Done:
        def wait(self):
            pass

    def consume(bucket):
        wire.append((list(bucket.names), [tuple(s) for s in bucket.shapes], list(bucket.offsets),
                     bucket.data.clone()))
        return _Done()

    BucketGatherer(8 << 10).run(src, send_dtypes(src, None), consume if actor.rank == 0 else None)
    return wire


def expert_moments(actor):
    """HF name -> Adam's second moment of each expert tensor, all experts (gathered); collective."""
    from areal_fast.trainer.model import hf_name
    from areal_fast.trainer.parallel.expert import as_global, expert_slices

    slices = expert_slices(actor.model)
    out = {}
    for k, p in actor.model.named_parameters():
        if "experts" not in k:
            continue
        m = actor.optimizer.state[p]["exp_avg_sq"]
        if k in slices:
            m = as_global(m, slices[k][2], actor.pmesh)
        out[hf_name(k)] = (m.full_tensor() if hasattr(m, "full_tensor") else m).clone()
    return out


def known_collectives(rank, device="cpu"):
    """A collective of each kind with known sizes, counted: (what the counter says, what it must say)."""
    import torch.distributed as dist

    from areal_fast.trainer.parallel.cost import CollectiveCounter

    n = dist.get_world_size()
    splits = [3 if i == rank else 2 for i in range(n)]  # 2 rows of 2 floats to each other rank, 3 kept
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    with CollectiveCounter() as c:
        dist.all_gather_single(torch.empty(10 * n, device=dev), torch.ones(10, device=dev))  # ring: n-1 x 10 floats
        dist.reduce_scatter_single(torch.empty(5, device=dev), torch.ones(5 * n, device=dev))  # ring: n-1 x 5
        dist.all_reduce(torch.ones(8, device=dev))  # ring: 2 (n-1) / n x 8 floats
        dist.all_to_all_single(torch.empty(sum(splits), 2, device=dev), torch.ones(sum(splits), 2, device=dev),
                               splits, splits)
    return dict(c.sent), {"all_gather_single": 40 * (n - 1), "reduce_scatter_single": 20 * (n - 1),
                          "all_reduce": 64 * (n - 1) // n, "all_to_all_single": 16 * (n - 1)}


def one_rank(model_path, out_dir, device="cpu"):
    """The one-rank reference: its step, gather and moments; its checkpoint saved for the ranks."""
    from areal_fast.trainer import save_checkpoint

    actor = PPOActor(config(model_path, max_tokens=4096, device=device))
    one = logprobs_and_step(actor)
    one["wire"] = gathered_wire(actor)
    one["moments"] = expert_moments(actor)
    save_checkpoint(actor, os.path.join(out_dir, "one_ckpt"))
    return actor, one


def resumed_on_one_rank(actor, one, out_dir):
    """The expert-parallel ranks' checkpoint loaded into the one-rank actor."""
    from areal_fast.trainer import load_checkpoint

    load_checkpoint(actor, os.path.join(out_dir, "ep2_ckpt"))
    one["resumed"] = {n: t.clone() for n, t in actor.iter_full_params()}
    one["resumed_moments"] = expert_moments(actor)
    return one


def worker(model_path, out_dir, device="cpu", mode="ep"):
    """``ep``: the expert-parallel ranks; ``one`` / ``resume``: the one-rank reference's two halves (CUDA)."""
    import faulthandler

    from areal_fast.trainer import load_checkpoint, save_checkpoint
    from areal_fast.trainer.model import shutdown_process_group

    faulthandler.enable()
    if mode == "one":
        torch.save(on_cpu(one_rank(model_path, out_dir, device)[1]), os.path.join(out_dir, "one.pt"))
        return shutdown_process_group()
    if mode == "resume":
        actor = PPOActor(config(model_path, max_tokens=4096, device=device))
        torch.save(on_cpu(resumed_on_one_rank(actor, {}, out_dir)), os.path.join(out_dir, "one_resumed.pt"))
        return shutdown_process_group()
    world = int(os.environ["WORLD_SIZE"])
    actor = PPOActor(config(model_path, max_tokens=40, world=world, ep=EP, device=device))
    out = {"local_experts": tuple(actor.model.lm.model.layers[0].mlp.experts.gate_up_proj.shape),
           "known": known_collectives(actor.rank, device), "world": world}
    out.update(logprobs_and_step(actor))
    out["wire"] = gathered_wire(actor)
    out["moments"] = expert_moments(actor)
    save_checkpoint(actor, os.path.join(out_dir, "ep2_ckpt"))  # loaded on one rank by the test
    load_checkpoint(actor, os.path.join(out_dir, "one_ckpt"))  # the one-rank actor's, resharded onto the experts
    out["resumed"] = {n: t.clone() for n, t in actor.iter_full_params()}
    out["resumed_moments"] = expert_moments(actor)
    if actor.rank == 0:
        torch.save(on_cpu(out), os.path.join(out_dir, "ep2.pt"))
    shutdown_process_group()


@pytest.fixture(scope="module", params=DEVICES)
def runs(request, tmp_path_factory):
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe

    device = request.param
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL expert parallelism needs 2 or more GPUs; {torch.cuda.device_count()} here")
    root = tmp_path_factory.mktemp(f"expert_parallel_{device}")
    model_path = build_tiny_qwen3_moe(str(root / "model"), vocab_size=VOCAB, seed=7, num_layers=LAYERS,
                                      num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    if device == "cpu":
        one_actor, one = one_rank(model_path, str(root))
        two = run_ranks(__file__, WORLD, model_path, root, device, "ep", result=root / "ep2.pt")
        one = resumed_on_one_rank(one_actor, one, str(root))  # the expert-parallel checkpoint on one rank
    else:  # each CUDA trainer in a process of its own: the reference, the ranks, the reference resumed
        one = run_ranks(__file__, 1, model_path, root, device, "one", result=root / "one.pt")
        two = run_ranks(__file__, 4 if torch.cuda.device_count() >= 4 else 2, model_path, root, device, "ep",
                        result=root / "ep2.pt")
        one |= run_ranks(__file__, 1, model_path, root, device, "resume", result=root / "one_resumed.pt")
    return one, two


@pytest.mark.slow
def test_expert_parallel_ranks_compute_as_one_rank(runs):
    one, two = runs
    assert two["local_experts"] == (2, 64, 64)  # 2 of the 4 experts [2I=64, H=64] on each rank
    for key in ("logprobs", "replayed"):
        assert len(one[key]) == len(two[key]) == 8
        for a, b in zip(one[key], two[key]):
            torch.testing.assert_close(b, a, rtol=0, atol=FP32_MOE_LOGPROB_ATOL, msg=key)
    # the recorded routing is really used (the replayed log-probs are not the model's own)
    moved = max(float((a - b).abs().max()) for a, b in zip(one["logprobs"], one["replayed"]))
    assert moved > 10 * FP32_MOE_LOGPROB_ATOL
    assert two["loss"] == pytest.approx(one["loss"], rel=FP32_SAME_MATH_NORM_RTOL, abs=FP32_MULTI_RANK_PARAM_ATOL)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=FP32_SAME_MATH_NORM_RTOL)
    assert sorted(one["grads"]) == sorted(two["grads"])
    assert "model.layers.1.mlp.experts.down_proj" in two["grads"]
    for n in one["grads"]:
        torch.testing.assert_close(two["grads"][n], one["grads"][n], rtol=FP32_SAME_MATH_NORM_RTOL,
                                   atol=FP32_MULTI_RANK_PARAM_ATOL, msg=n)
    assert sorted(one["params"]) == sorted(two["params"])
    for n in one["params"]:
        torch.testing.assert_close(two["params"][n], one["params"][n], rtol=0, atol=FP32_MULTI_RANK_PARAM_ATOL,
                                   msg=n)


@pytest.mark.slow
def test_the_gather_from_expert_ranks_sends_the_one_rank_layout_and_the_trained_bytes(runs):
    one, two = runs
    assert [w[:3] + (w[3].numel(),) for w in two["wire"]] == [w[:3] + (w[3].numel(),) for w in one["wire"]]
    sent = {}
    for names, shapes, offsets, data in two["wire"]:
        for n, s, off in zip(names, shapes, offsets):
            sent[n] = data[off: off + int(torch.Size(s).numel()) * 4].view(torch.float32).view(s)
    assert sorted(sent) == sorted(two["params"])
    assert all(torch.equal(sent[n], two["params"][n]) for n in sent)


@pytest.mark.slow
def test_the_cost_of_expert_parallelism_is_counted(runs):
    one, two = runs
    counted, want = two["known"]
    assert counted == want  # the counting wrapper gives the algorithms' bytes on known collectives
    assert sum(one["sent"].values()) == 0  # one rank sends nothing
    assert two["sent"]["all_to_all_single"] > 0 and two["sent"]["all_gather_single"] > 0
    # parameter memory per rank: 2 of the 4 experts whole (2 blocks: gate_up [64, 64] + down [64, 32], fp32)
    assert two["param_bytes"]["experts"] == LAYERS * 2 * (64 * 64 + 64 * 32) * 4
    assert two["param_bytes"]["dense"] * two["world"] >= one["param_bytes"]["dense"]  # FSDP2 shards (dim-0 chunks)


@pytest.mark.slow
def test_checkpoints_move_between_one_rank_and_expert_parallel_ranks_bitwise(runs):
    one, two = runs
    for name, (src, dst) in {"one rank -> ep 2 x dp 2": (one, two), "ep 2 x dp 2 -> one rank": (two, one)}.items():
        assert sorted(dst["resumed"]) == sorted(src["params"]), name
        assert [n for n in src["params"] if not torch.equal(dst["resumed"][n], src["params"][n])] == [], name
        assert sorted(dst["resumed_moments"]) == sorted(src["moments"]) and len(src["moments"]) == 2 * LAYERS
        assert [n for n in src["moments"] if not torch.equal(dst["resumed_moments"][n], src["moments"][n])] == [], name


if __name__ == "__main__":
    worker(*sys.argv[1:5])
