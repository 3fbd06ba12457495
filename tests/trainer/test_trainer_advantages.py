"""Advantage estimators, proximal approximation, batch format and config checks (no model)."""

import math
import re

import pytest
import torch
from tolerances import ADV_STD_EPS_RTOL, FP32_FEW_OPS_ATOL, FP64_FEW_OPS_ATOL

from areal_fast.configutil import from_dict
from areal_fast.trainer import OptimConfig, PPOConfig, Sample, TrainerConfig
from areal_fast.trainer.advantages import approx_prox_logprobs, batch_normalize, group_advantages
from areal_fast.trainer.batch import as_sample, split_minibatches, to_seq


def test_grpo_matches_formula_and_handles_lost_members():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 3.0, 7.0]
    groups = ["a", "a", "a", "a", "b", "b", "c", "d"]  # b lost 2 members, c and d are alone
    adv = group_advantages(rewards, groups, estimator="grpo", std_norm=True, eps=1e-5)
    a = torch.tensor(rewards[:4], dtype=torch.float64)
    exp_a = (a - a.mean()) / (a.std(unbiased=True) + 1e-5)
    b = torch.tensor(rewards[4:6], dtype=torch.float64)
    exp_b = (b - b.mean()) / (b.std(unbiased=True) + 1e-5)
    torch.testing.assert_close(adv[:4], exp_a, atol=FP64_FEW_OPS_ATOL, rtol=0)
    torch.testing.assert_close(adv[4:6], exp_b, atol=FP64_FEW_OPS_ATOL, rtol=0)
    assert adv[6] == 0 and adv[7] == 0  # a lone sample has nothing to compare with
    assert adv.dtype == torch.float64


def test_grpo_no_std_and_constant_group():
    adv = group_advantages([1.0, 3.0, 2.0, 2.0], [0, 0, 1, 1], std_norm=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=torch.float64),
                               atol=FP64_FEW_OPS_ATOL, rtol=0)
    adv = group_advantages([2.0, 2.0, 2.0], [0, 0, 0], std_norm=True)
    assert torch.all(adv == 0)  # std 0: (0) / (0 + eps) = 0, never NaN


def test_rloo_is_leave_one_out():
    rewards = [1.0, 4.0, 2.0, 5.0, 9.0]
    groups = [7, 7, 7, 8, 9]
    adv = group_advantages(rewards, groups, estimator="rloo")
    expect = [1 - 3.0, 4 - 1.5, 2 - 2.5, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expect, dtype=torch.float64), atol=FP64_FEW_OPS_ATOL, rtol=0)


def test_advantage_input_errors():
    with pytest.raises(ValueError, match="group_ids has 1"):
        group_advantages([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="sample 1"):
        group_advantages([1.0, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="estimator"):
        group_advantages([1.0], [0], estimator="ppo")


def test_batch_normalize_token_weighted():
    a = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    w = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    flat = torch.repeat_interleave(a, w.long())  # every token carries its sequence's advantage
    for unbiased in (True, False):
        out = batch_normalize(a, w, eps=0.0, unbiased=unbiased)
        torch.testing.assert_close(out, (a - flat.mean()) / flat.std(unbiased=unbiased), atol=FP64_FEW_OPS_ATOL,
                                   rtol=0)
    # the default is the unbiased std (n - 1), as AReaL's
    torch.testing.assert_close(batch_normalize(a, w, eps=0.0), (a - flat.mean()) / flat.std(unbiased=True),
                               atol=FP64_FEW_OPS_ATOL, rtol=0)


def test_proximal_approximation_numerics():
    b = torch.tensor([-1.0, -2.0, -3.0, -0.5, -4.0])
    cur = torch.tensor([-1.5, -1.0, -2.0, -0.7, -1.0], requires_grad=True)
    versions = torch.tensor([5, 4, 3, 1, 6])
    p = approx_prox_logprobs(b, cur, versions, theta_version=5)
    # alpha = clamp((4 - v) / (5 - v), 0, 1), 0 when v == 5: v=5 -> 0, v=4 -> 0, v=3 -> 1/2, v=1 -> 3/4,
    # v=6 (newer than theta, impossible but must not explode) -> clamp(-2 / -1 = 2) = 1
    alpha = torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0])
    torch.testing.assert_close(p, b + alpha * (cur.detach() - b), atol=FP32_FEW_OPS_ATOL, rtol=0)
    assert not p.requires_grad and p.dtype == torch.float32


def test_sample_to_seq_shift_and_masks():
    s = Sample(prompt_ids=[5, 6, 7], output_ids=[8, 9], output_logprobs=[-0.1, -0.2], output_versions=[3, 4],
               reward=1.0, group_id=0)
    q = to_seq(s)
    assert q.input_ids.tolist() == [5, 6, 7, 8] and q.labels.tolist() == [6, 7, 8, 9]
    assert q.loss_mask.tolist() == [False, False, True, True]
    assert q.behav_logprobs.tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert q.versions.tolist() == [-1, -1, 3, 4]
    with pytest.raises(ValueError, match="sample 3: 1 output_ids but .*output_logprobs"):
        as_sample(dict(prompt_ids=[1], output_ids=[2], output_logprobs=[], output_versions=[0], reward=0,
                           group_id=0), 3)
    with pytest.raises(ValueError, match="lacks key 'reward'"):
        as_sample(dict(prompt_ids=[1], output_ids=[2], output_logprobs=[0.0], output_versions=[0],
                           group_id=0))


def test_split_minibatches_is_balanced_and_complete():
    lengths = [50, 10, 40, 30, 20, 5, 45]
    mbs = split_minibatches(lengths, 3)
    assert sorted(i for m in mbs for i in m) == list(range(7))
    loads = [sum(lengths[i] for i in m) for m in mbs]
    assert max(loads) - min(loads) <= max(lengths)
    with pytest.raises(ValueError, match="ppo_n_minibatches=8"):
        split_minibatches(lengths, 8)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        TrainerConfig(model_path="/x", max_tokens_per_mb=1)
    with pytest.raises(ValueError, match="prox_mode"):
        PPOConfig(prox_mode="magic")
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimConfig(lr_schedule="step")
    cfg = from_dict(TrainerConfig, {"model_path": "/x", "ppo": {"loss": {"eps_clip": 0.1}}, "optim": {"lr": 1e-5}})
    assert cfg.ppo.loss.eps_clip == 0.1 and math.isclose(cfg.optim.lr, 1e-5)
    with pytest.raises(TypeError, match="ppo: expected a PPOConfig"):  # plain data goes through the one loader
        TrainerConfig(ppo={"loss": {"eps_clip": 0.1}})


def test_lr_schedule_warmup_then_decay():
    from types import SimpleNamespace

    from areal_fast.trainer import PPOActor

    def factors(**kw):
        holder = SimpleNamespace(config=SimpleNamespace(optim=OptimConfig(**kw)))
        return [PPOActor._lr_factor(holder, s) for s in range(8)]

    cos = factors(warmup_steps=2, total_steps=6, lr_schedule="cosine", min_lr_ratio=0.1)
    assert cos[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert cos[4] == pytest.approx(0.1 + 0.9 * 0.5) and cos[6] == cos[7] == pytest.approx(0.1)
    lin = factors(warmup_steps=0, total_steps=4, lr_schedule="linear")
    assert lin[:5] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert factors(warmup_steps=3)[3:] == [1.0] * 5


def test_grpo_population_std_option():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5]
    adv = group_advantages(rewards, [0, 0, 0, 0, 1], unbiased=False)
    a = torch.tensor(rewards[:4], dtype=torch.float64)
    torch.testing.assert_close(adv[:4], (a - a.mean()) / (a.std(unbiased=False) + 1e-5), atol=FP64_FEW_OPS_ATOL,
                               rtol=0)
    assert adv[4] == 0  # a group of one stays 0 with either std
    unbiased = group_advantages(rewards, [0, 0, 0, 0, 1])
    # sqrt(n / (n - 1)) between the two conventions for a group of n = 4 (eps aside)
    assert float(adv[0] / unbiased[0]) == pytest.approx(math.sqrt(4 / 3), rel=ADV_STD_EPS_RTOL)


def test_rloo_group_of_one_is_zero():
    """RLOO's leave-one-out mean is undefined for a lone sample: its advantage is 0 (documented)."""
    adv = group_advantages([5.0, 1.0, 3.0], ["a", "b", "b"], estimator="rloo")
    assert adv[0] == 0 and adv[1] == -2.0 and adv[2] == 2.0


def test_trainer_config_is_torch_free_and_names_bad_keys():
    import subprocess
    import sys

    code = ("import sys, areal_fast.trainer.config as c; assert 'torch' not in sys.modules, 'torch imported'; "
            "from areal_fast.configutil import from_dict; "
            "from_dict(c.TrainerConfig, {'ppo': {'loss': {'eps_clip': 0.3}}})")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cases = [
        (dict(ppo={"loss": {"eps_clip": -1.0}}), "ppo.loss.eps_clip"),
        (dict(ppo={"loss": {"behav_weight_mode": "drop"}}), "behav_weight_mode"),
        (dict(ppo={"eps_clip": 0.1}), "unknown key 'ppo.eps_clip'"),
        (dict(ppo={"adv_eps": float("nan")}), "ppo.adv_eps"),
        (dict(optim={"lr": float("inf")}), "optim.lr"),
        (dict(device="gpu"), "device"),
        (dict(attn_impl="flash"), "attn_impl"),
        (dict(param_dtype="bf16"), "param_dtype"),
        (dict(max_tokens_per_mb=0), "max_tokens_per_mb"),
        (dict(min_mbs=0), "min_mbs"),
        (dict(batch_size=0), "batch_size"),
        (dict(world_size=0), "world_size"),
        (dict(gpus=["0;1"]), "gpus[0]"),
        (dict(gpus=["0,1"]), "gpus[0]"),
        (dict(gpus="0,1"), "gpus"),
        (dict(loss_impl="cuda"), "loss_impl"),
        (dict(loss_chunk_size=0), "loss_chunk_size"),
        (dict(peak_flops=-1.0), "peak_flops"),
        (dict(sampling_temperature=0.0), "sampling_temperature"),
        (dict(ppo={"loss": {"temperature": 0.5}}), "ppo.loss.temperature"),
    ]
    for kwargs, culprit in cases:
        with pytest.raises(ValueError, match=re.escape(culprit)):
            from_dict(TrainerConfig, kwargs)
    assert TrainerConfig(device="cuda:1").device == "cuda:1"


def test_trainer_config_hands_the_sampling_temperature_to_the_loss():
    cfg = from_dict(TrainerConfig, {"sampling_temperature": 0.7, "ppo": {"loss": {"eps_clip": 0.3}}})
    assert cfg.loss.temperature == 0.7 and cfg.loss.eps_clip == 0.3
    assert cfg.ppo.loss.temperature == 1.0  # the section itself holds no temperature of its own
    # a round trip (the launcher writes the resolved config for the ranks) keeps it valid
    again = from_dict(TrainerConfig, {"sampling_temperature": 0.7, "ppo": {"loss": {"temperature": 0.7}}})
    assert again.loss.temperature == 0.7
