"""The trainer's mesh options (``train.parallel``) in-process: the refusals at config load (each names its
key and reason), the rank layout of the mesh, and the expert-parallel experts module on one rank (no
exchange) against transformers' own experts module: outputs and gradients (on CUDA too, marked gpu)."""

import pytest
import torch
from tolerances import FP32_MOE_LOGPROB_ATOL, FP32_MULTI_RANK_PARAM_ATOL

from areal_fast.config import ConfigError, load_config
from areal_fast.trainer import ParallelConfig, TrainerConfig
from areal_fast.trainer.parallel import layout

MOE = ["model.warm_start.enabled=true", "model.warm_start.arch=qwen3_moe", "model.warm_start.num_experts=4",
       "model.warm_start.num_experts_per_tok=2"]


@pytest.mark.parametrize("overrides, message", [
    (["train.world_size=4", "train.parallel.ep=3"], "train.parallel.ep: 3 does not divide train.world_size (4)"),
    (["train.world_size=4", "train.parallel.cp=3"], "train.parallel.cp: 3 does not divide train.world_size (4)"),
    (["train.parallel.ep=0"], "train.parallel.ep: must be >= 1"),
    (["model.warm_start.enabled=true", "train.world_size=2", "train.parallel.ep=2"],
     "train.parallel.ep: 2 needs a mixture-of-experts model; the warm-started model (model.warm_start.arch 'qwen2') "
     "is dense"),
    (MOE[:2] + ["model.warm_start.num_experts=6", "train.world_size=4", "train.parallel.ep=4"],
     "train.parallel.ep: 4 does not divide the 6 experts"),
    (MOE + ["train.world_size=2", "train.parallel.ep=2", "train.lora.rank=4"],
     "train.parallel.ep: expert parallelism with train.lora is not supported"),
    (["model.warm_start.enabled=true", "model.warm_start.num_attention_heads=2",
      "model.warm_start.num_key_value_heads=2", "train.world_size=4", "train.parallel.cp=4"],
     "train.parallel.cp: 4 does not divide the 2 attention heads"),
])
def test_degrees_the_world_or_the_model_cannot_take_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_a_model_directorys_config_json_is_checked_at_load(tmp_path):
    from areal_fast.trainer.config import check_parallel_run

    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_attention_heads": 4, '
                                          '"num_key_value_heads": 2}')
    with pytest.raises(ValueError, match="train.parallel.ep: 2 needs a mixture-of-experts model; .*config.json"):
        check_parallel_run(ParallelConfig(ep=2), None, str(tmp_path))
    check_parallel_run(ParallelConfig(cp=2), None, str(tmp_path))  # 4 and 2 heads: both divide


def test_default_degrees_keep_todays_configs_and_ep_moe_loads():
    assert TrainerConfig().parallel.trivial and load_config(None, []).train.parallel == ParallelConfig()
    cfg = load_config(None, MOE + ["train.world_size=4", "train.parallel.ep=2"])
    assert (cfg.train.parallel.ep, cfg.train.parallel.cp) == (2, 1)


def test_rank_layout_cp_consecutive_ep_consecutive_blocks_every_rank_once():
    got = layout(8, dp=4, cp=2, ep=4)
    assert got["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # rank = dp index * cp + cp index
    assert got["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert got["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert got["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the ranks holding the same experts
    for groups in got.values():
        assert sorted(r for g in groups for r in g) == list(range(8))
    with pytest.raises(ValueError, match="ep 3 divide it"):
        layout(8, dp=4, cp=2, ep=3)


def test_one_rank_mesh_is_todays_one_dimensional_mesh():
    from areal_fast.trainer.model import init_process_group_if_needed
    from areal_fast.trainer.parallel import build_mesh

    init_process_group_if_needed(torch.device("cpu"))
    mesh = build_mesh(ParallelConfig(), 1, "cpu")
    assert (mesh.world, mesh.dp, mesh.cp, mesh.ep, mesh.rank) == (1, 1, 1, 1, 0)
    assert mesh.fsdp_mesh.mesh_dim_names == ("dp",) and mesh.fsdp_mesh.size() == 1
    assert mesh.expert_fsdp_mesh is None and mesh.ep_mesh is None
    assert all(mesh.group(n) is None and mesh.index(n) == 0 for n in ("dp", "cp", "ep"))
    with pytest.raises(KeyError, match="mesh group 'tp'"):
        mesh.group("tp")


def _experts_against_hf(device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from areal_fast.trainer.parallel.expert import ExpertParallelExperts

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    ref = Qwen3MoeSparseMoeBlock(cfg).to(device)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ep = Qwen3MoeSparseMoeBlock(cfg).to(device)
    ep.load_state_dict(ref.state_dict())
    mine = ExpertParallelExperts(ep.experts, ep=1, ep_index=0, group=None)
    with torch.no_grad():
        mine.gate_up_proj.copy_(ref.experts.gate_up_proj)
        mine.down_proj.copy_(ref.experts.down_proj)
    ep.experts = mine
    x = torch.randn(1, 37, 32, device=device)
    outs = []
    for block in (ref, ep):
        xi = x.clone().requires_grad_(True)
        y = block(xi)
        (y * torch.arange(y.numel(), device=device).view_as(y).sin()).sum().backward()
        outs.append((y.detach(), xi.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad,
                     block.gate.weight.grad))
    for a, b, name in zip(*outs, ("output", "input grad", "gate_up grad", "down grad", "router grad")):
        torch.testing.assert_close(b, a, rtol=0, atol=FP32_MULTI_RANK_PARAM_ATOL if name == "output"
                                   else FP32_MOE_LOGPROB_ATOL, msg=name)


def test_expert_parallel_experts_on_one_rank_equal_transformers_experts():
    _experts_against_hf("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the expert-parallel path on one GPU")
def test_expert_parallel_experts_on_one_gpu_equal_transformers_experts():
    _experts_against_hf("cuda")


def _policy_against_hf(device, tmp_path):
    from transformers import AutoModelForCausalLM

    from areal_fast.data.tiny_models import build_tiny_qwen3_moe
    from areal_fast.trainer.model import build_policy
    from areal_fast.trainer.parallel.expert import ExpertParallelExperts

    path = build_tiny_qwen3_moe(str(tmp_path / "moe"), vocab_size=100, seed=3)
    policy = build_policy(path, device=torch.device(device), mesh=None, expert_parallel=True)
    assert sum(isinstance(m, ExpertParallelExperts) for m in policy.modules()) == 2  # every sparse block
    ids = torch.randint(2, 100, (23,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(23)
    cu = torch.tensor([0, 23], dtype=torch.int32)

    def head(h, w, bias):
        return torch.log_softmax(h @ w.T, -1)[:-1].gather(-1, ids[1:, None].to(h.device))[:, 0]

    with torch.no_grad():
        got = policy(head, ids.to(device), pos.to(device), cu.to(device), 23).cpu()
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        want = torch.log_softmax(ref(ids[None].to(device)).logits[0], -1)[:-1].gather(
            -1, ids[1:, None].to(device))[:, 0].cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_MOE_LOGPROB_ATOL)


def test_the_expert_parallel_policy_on_one_rank_gives_hf_logprobs(tmp_path):
    _policy_against_hf("cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the expert-parallel policy on one GPU")
def test_the_expert_parallel_policy_on_one_gpu_gives_hf_logprobs(tmp_path):
    _policy_against_hf("cuda", tmp_path)
