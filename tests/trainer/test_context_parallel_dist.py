"""Context parallelism 2 on two gloo ranks under torchrun against one rank in this process, for the
tiny dense Qwen2 and the tiny Qwen3-MoE (one key/value head: repeated for the two ranks; and with
expert parallelism 2 on the same ranks): the
recomputed log-probs, the loss and the statistics, every gradient, and the parameters after one PPO
step, with packed micro-batches of uneven lengths and a sequence longer than one rank's share.
Also what it costs, counted on the dense model for one micro-batch of the whole batch: the bytes
autograd saves for the backward on a rank, and the bytes each collective sends from a rank, for
data parallelism only (the micro-batch on one rank) and for context parallelism (half of it each).
The equality again on NCCL (marked ``gpu``, 2 GPUs), in fp32 (``GPU_FP32`` of test_expert_parallel.py),
the one-rank reference in a one-rank launch of its own; the cost is counted on gloo only.

This file is also the torchrun worker
(``python -m torch.distributed.run ... test_context_parallel_dist.py DENSE MOE OUT [DEVICE [cp|one]]``).
"""

import contextlib
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # as a torchrun worker: this folder and tests/ (tolerances)

from _shared import run_ranks  # noqa: E402
from test_expert_parallel import GPU_FP32, on_cpu  # noqa: E402
from test_trainer_actor import VOCAB, make_batch, make_tiny_model  # noqa: E402
from tolerances import (  # noqa: E402
    FP32_GRAD_TOL,
    FP32_MOE_LOGPROB_ATOL,
    FP32_MULTI_RANK_METRIC_TOL,
    FP32_MULTI_RANK_PARAM_ATOL,
    FP32_PACKED_LOGPROB_ATOL,
)

from areal_fast.sample import Sample  # noqa: E402
from areal_fast.trainer import OptimConfig, PPOActor, PPOConfig, TrainerConfig  # noqa: E402
from areal_fast.trainer.config import ParallelConfig  # noqa: E402
from areal_fast.trainer.parallel.cost import CollectiveCounter  # noqa: E402

# the gpu mark stays in this file: the GPU day finds its test files by it (tools/gpu_suite.gpu_test_files)
DEVICES = [pytest.param("cpu", id="gloo"), pytest.param("cuda", id="nccl", marks=pytest.mark.gpu)]

pytestmark = pytest.mark.slow  # two trainer ranks under torchrun (gloo)
SHARE = 24  # max_tokens_per_mb of a context-parallel rank: micro-batches of up to 48 tokens on 2 ranks
LONG = 40  # tokens of the long sample's shifted sequence: longer than one rank's share


def config(model_path, cp, max_tokens, ep=1, device="cpu"):
    return TrainerConfig(model_path=model_path, device=device, max_tokens_per_mb=max_tokens, world_size=max(cp, 1),
                         parallel=ParallelConfig(cp=cp, ep=ep), ppo=PPOConfig(adv_batch_norm=True),
                         optim=OptimConfig(lr=1e-3, eps=1e-6, grad_clip=0.5),
                         **(GPU_FP32 if device == "cuda" else {}))


def batch():
    """Uneven lengths (3..26 tokens) and one sample of LONG tokens."""
    out = make_batch(7, seed=3, group_size=4)
    g = torch.Generator().manual_seed(5)
    out.append(Sample(prompt_ids=torch.randint(2, VOCAB, (9,), generator=g).tolist(),
                      output_ids=torch.randint(2, VOCAB, (LONG - 8,), generator=g).tolist(),
                      output_logprobs=(-torch.rand(LONG - 8, generator=g) * 3).tolist(),
                      output_versions=[0] * (LONG - 8), reward=1.0, group_id=1))
    return out


def step(actor) -> dict:
    """Log-probs, then one PPO step: metrics, gradients (before the optimizer step), parameters."""
    out = {"lp": actor.compute_logprobs(batch())}
    grads = []
    # the gradients FSDP2 reduces (an expert-parallel rank's own experts are not DTensors: their
    # gradients are this rank's experts', compared through the parameters after the step)
    actor._grad_observer = lambda a: grads.append({n: p.grad.full_tensor().clone()
                                                   for n, p in a.model.named_parameters()
                                                   if hasattr(p.grad, "full_tensor")})
    out["m"] = actor.train_batch(batch())
    out["g"] = grads[0]
    out["p"] = {n: t.clone() for n, t in actor.iter_full_params()}
    return out


def micro_batch_cost(actor, share: bool) -> dict:
    """One micro-batch of the whole batch (loss forward and backward) on this rank: the bytes of the
    tensors autograd saves (parameters excluded; a storage once) and the bytes each collective sends.
    ``share``: this rank's share of it (context parallelism), else all of it on this rank, as a
    data-parallel rank holds its micro-batch (the same FSDP2 world of two ranks)."""
    from areal_fast.trainer.batch import as_sample, pack, to_seq

    seqs = [to_seq(as_sample(s, i)) for i, s in enumerate(batch())]
    full = pack(list(range(len(seqs))), seqs, torch.zeros(len(seqs)), actor.device)
    p = actor._share(full)[1] if share else full
    seen, saved = set(), [0]

    def keep(t):
        if not (isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                saved[0] += st.nbytes()
        return t

    actor.model.train()
    with CollectiveCounter() as c, actor._cp_block() if share else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = actor.model(actor._loss_fn(p, 1.0, 0), *p.model_args())
        out[0].backward()
    actor.optimizer.zero_grad(set_to_none=True)
    return {"tokens": full.n_tokens, "rank_tokens": p.input_ids.numel(), "saved_bytes": saved[0],
            "fsdp_all_gather": c.sent["all_gather_single"], "fsdp_reduce_scatter": c.sent["reduce_scatter_single"],
            "cp_all_to_all": c.sent["all_to_all_single"]}


def one_rank_steps(paths, device="cpu"):
    return {m: step(PPOActor(config(paths[m], 1, 4096, device=device))) for m in ("dense", "moe")}


def worker(dense, moe, out_dir, device="cpu", mode="cp"):
    """``cp``: the two context-parallel ranks; ``one``: the one-rank reference (CUDA)."""
    import faulthandler

    from areal_fast.trainer.batch import to_seq
    from areal_fast.trainer.model import shutdown_process_group

    faulthandler.enable()  # a rank that aborts (SIGABRT) prints where it was
    if mode == "one":
        torch.save(on_cpu(one_rank_steps({"dense": dense, "moe": moe}, device)), os.path.join(out_dir, "one.pt"))
        return shutdown_process_group()
    out = {}
    actor = PPOActor(config(dense, 2, SHARE, device=device))
    assert (actor.pmesh.cp, actor.pmesh.dp) == (2, 1)
    seqs = [to_seq(x) for x in batch()]
    out["n_mbs"] = len(actor._plan(seqs, list(range(len(seqs)))))
    out["dense"] = step(actor)
    if device == "cpu":  # counted on gloo
        out["cost_cp"] = micro_batch_cost(actor, share=True)
        out["cost_dp"] = micro_batch_cost(actor, share=False)
    del actor
    out["moe"] = step(PPOActor(config(moe, 2, SHARE, device=device)))
    # each rank: half the experts, half the tokens
    out["moe_ep2"] = step(PPOActor(config(moe, 2, SHARE, ep=2, device=device)))
    if int(os.environ["RANK"]) == 0:
        torch.save(on_cpu(out), os.path.join(out_dir, "cp2.pt"))
    shutdown_process_group()


@pytest.fixture(scope="module", params=DEVICES)
def cp_run(request, tmp_path_factory):
    """(model paths, with the one-rank reference under "one" on CUDA; rank 0's results)."""
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe

    device = request.param
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL context parallelism needs 2 GPUs; {torch.cuda.device_count()} here")
    root = tmp_path_factory.mktemp(f"cp_dist_{device}")
    dense = str(root / "dense")
    make_tiny_model(dense, seed=7)
    moe = build_tiny_qwen3_moe(str(root / "moe"), vocab_size=VOCAB, seed=7)
    two = run_ranks(__file__, 2, dense, moe, root, device, "cp", result=root / "cp2.pt")
    paths = {"dense": dense, "moe": moe, "one": None}
    if device == "cuda":  # a CUDA trainer needs an NCCL default group of its own process
        paths["one"] = run_ranks(__file__, 1, dense, moe, root, device, "one", result=root / "one.pt")
    return paths, two


@pytest.fixture(scope="module")
def one_rank(cp_run):
    paths, _ = cp_run
    return paths["one"] if paths["one"] is not None else one_rank_steps(paths)


@pytest.mark.parametrize("run,model,lp_tol", [("dense", "dense", FP32_PACKED_LOGPROB_ATOL),
                                              ("moe", "moe", FP32_MOE_LOGPROB_ATOL),
                                              ("moe_ep2", "moe", FP32_MOE_LOGPROB_ATOL)])
def test_cp2_equals_one_rank(cp_run, one_rank, run, model, lp_tol):
    _, two = cp_run
    assert two["n_mbs"] >= 2  # the batch needed several micro-batches, the long sequence one of its own
    one, two = one_rank[model], two[run]
    assert len(one["lp"]) == len(two["lp"]) == 8 and two["lp"][-1].numel() == LONG - 8
    for a, b in zip(one["lp"], two["lp"]):
        torch.testing.assert_close(a, b, rtol=0, atol=lp_tol)
    for k in ("loss", "n_loss_tokens", "n_tokens", "grad_norm", "ratio_mean", "entropy_mean", "approx_kl"):
        assert one["m"][k] == pytest.approx(two["m"][k], **FP32_MULTI_RANK_METRIC_TOL), k
    assert one["m"]["n_tokens"] == sum(len(s.prompt_ids) + len(s.output_ids) - 1 for s in batch())  # once each
    experts = {n for n in one["g"] if ".experts." in n} if run == "moe_ep2" else set()
    assert sorted(two["g"]) == sorted(set(one["g"]) - experts)
    for n in two["g"]:
        torch.testing.assert_close(one["g"][n], two["g"][n], **FP32_GRAD_TOL, msg=n)
    for n in one["p"]:
        torch.testing.assert_close(one["p"][n], two["p"][n], rtol=0, atol=FP32_MULTI_RANK_PARAM_ATOL, msg=n)


def test_cp2_cost_counted(cp_run):
    """Per rank, one micro-batch of T tokens: CP 2 saves fewer bytes for the backward than data
    parallelism (half the tokens; attention holds every token of half the heads) and adds four
    all-to-alls a layer (query/key/value and output, forward and backward) to the same FSDP2 traffic."""
    _, two = cp_run
    if "cost_dp" not in two:
        pytest.skip("the cost is counted on gloo (CPU) only")
    dp, cp = two["cost_dp"], two["cost_cp"]
    assert dp["tokens"] == cp["tokens"] == dp["rank_tokens"] and cp["rank_tokens"] == -(-cp["tokens"] // 2)
    assert cp["saved_bytes"] < 0.75 * dp["saved_bytes"]
    assert dp["cp_all_to_all"] == 0
    for k in ("fsdp_all_gather", "fsdp_reduce_scatter"):
        assert cp[k] == dp[k] > 0  # the parameters' traffic does not depend on the tokens
    # tiny Qwen2: 2 layers, 4 query and 2 key/value heads of 16; fp32; half of each buffer leaves the rank
    layers, hq, hkv, d, s = 2, 4, 2, 16, cp["rank_tokens"]
    per_layer = ((hq + 2 * hkv) * d * s * 4 + hq * d * s * 4) // 2
    assert cp["cp_all_to_all"] == 2 * layers * per_layer  # forward and backward
    print("cost per rank, one micro-batch:", {"dp": dp, "cp": cp})


if __name__ == "__main__":
    worker(*sys.argv[1:6])
