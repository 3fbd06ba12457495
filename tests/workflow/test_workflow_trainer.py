"""The trainer on multi-turn trajectories: a trajectory built turn by turn (and carried through the
controller's group) trains exactly like the same tokens given as one single-turn sample with the
same mask; masked (tool, environment) tokens are context only, whatever log-probs or versions
they carry; the recomputed log-probs are those of the model tokens."""

from __future__ import annotations

from dataclasses import replace

import torch
from test_trainer_actor import VOCAB, actor_for, make_tiny_model
from tolerances import FP32_PACKED_LOGPROB_ATOL

from areal_fast.group import group_of
from areal_fast.sample import Sample
from areal_fast.workflow import Trajectory


def _turn(g: torch.Generator, n: int, version: int) -> Sample:
    return Sample(prompt_ids=[1], output_ids=torch.randint(3, VOCAB, (n,), generator=g).tolist(),
                  output_logprobs=(-torch.rand(n, generator=g) * 3 - 0.5).tolist(), output_versions=[version] * n,
                  finish_reason="stop")


def _trajectories(seed=0) -> list[Trajectory]:
    """Four 3-turn trajectories (two groups' worth of episodes) with tool output in between."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        t = Trajectory(prompt_ids=torch.randint(3, VOCAB, (3 + i,), generator=g).tolist())
        for turn in range(3):
            if turn:
                t.add_context(torch.randint(3, VOCAB, (2 + turn,), generator=g).tolist())
            t.add_model(_turn(g, 4 + i + turn, version=turn))
        t.reward = float(i % 2)
        out.append(t)
    return out


def _via_controller(trajs) -> list[Sample]:
    """The samples the controller hands the trainer (the trajectories themselves, in their groups)."""
    samples = []
    for gid in (0, 1):
        samples += group_of(gid, gid, 0, trajs[2 * gid: 2 * gid + 2]).samples
    return samples


def _single_turn_with_mask(trajs, garbage: bool) -> list[Sample]:
    """The same tokens as plain samples built by hand; masked positions get garbage log-probs and
    versions when asked (they must not matter)."""
    out = []
    for i, t in enumerate(trajs):
        lp = [(-99.0 if garbage else 0.0) if not m else x for x, m in zip(t.output_logprobs, t.loss_mask)]
        ver = [(7 if garbage else -1) if not m else v for v, m in zip(t.output_versions, t.loss_mask)]
        out.append(Sample(prompt_ids=list(t.prompt_ids), output_ids=list(t.output_ids), output_logprobs=lp,
                          output_versions=ver, reward=t.reward, group_id=i // 2, loss_mask=list(t.loss_mask)))
    return out


def _train(path, samples):
    actor = actor_for(path, max_tokens_per_mb=64, ppo={"prox_mode": "recompute"})
    actor.version = 3  # every token is behind the weights (staleness counted on model tokens only)
    metrics = actor.train_batch(samples)
    return metrics, {k: v.detach().clone() for k, v in actor.model.state_dict().items()}


def test_multi_turn_trains_exactly_like_the_single_turn_sample_with_the_same_mask(tmp_path):
    make_tiny_model(tmp_path, seed=4)
    trajs = _trajectories()
    m_ctl, w_ctl = _train(str(tmp_path), _via_controller(trajs))
    m_hand, w_hand = _train(str(tmp_path), _single_turn_with_mask(trajs, garbage=True))
    assert w_ctl.keys() == w_hand.keys()
    for k in w_ctl:  # same tokens, same mask, same order of operations: bitwise equal
        assert torch.equal(w_ctl[k], w_hand[k]), k
    for k in ("loss", "n_tokens"):
        if k in m_ctl:
            assert m_ctl[k] == m_hand[k], k
    # and the update is real: the weights moved
    base = actor_for(str(tmp_path)).model.state_dict()
    assert base.keys() == w_ctl.keys() and any(not torch.equal(base[k], w_ctl[k]) for k in base)


def test_mask_changes_the_update(tmp_path):
    """Guard against a mask that is silently ignored: training the context tokens too differs."""
    make_tiny_model(tmp_path, seed=4)
    trajs = _trajectories()
    _, w_masked = _train(str(tmp_path), _single_turn_with_mask(trajs, garbage=False))
    # an empty mask: every output token is a model token (the client's samples have no context tokens)
    unmasked = [replace(s, loss_mask=[]) for s in _single_turn_with_mask(trajs, garbage=False)]
    assert all(s.loss_mask.tolist() == [1] * len(s.output_ids) for s in unmasked)
    _, w_all = _train(str(tmp_path), unmasked)
    assert any(not torch.equal(w_masked[k], w_all[k]) for k in w_masked)


def test_recomputed_logprobs_are_those_of_the_model_tokens(tmp_path):
    model = make_tiny_model(tmp_path, seed=5).eval()
    actor = actor_for(str(tmp_path))
    trajs = _trajectories(seed=1)
    for t, lp in zip(trajs, actor.compute_logprobs(_via_controller(trajs))):
        ids = torch.tensor(t.context_ids)[None]
        with torch.no_grad():
            full = model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        want = full[len(t.prompt_ids) - 1:][torch.tensor(t.loss_mask, dtype=torch.bool)]
        assert lp.numel() == t.n_model_tokens
        torch.testing.assert_close(lp, want, atol=FP32_PACKED_LOGPROB_ATOL, rtol=0)
