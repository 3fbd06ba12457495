"""Routing replay's building blocks (``areal_fast/moe_routing.py``) on the tiny Qwen3-MoE: the
recorded routing replayed in the same model changes nothing; a bf16 copy (the server) routes some
tokens elsewhere than the fp32 model (the trainer), and replaying the server's routing in the
trainer's forward removes most of the log-prob mismatch while the router still gets gradients."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe_routing")), vocab_size=100)


def _logprobs(model, ids):
    logits = model(ids).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def _k3(trainer, behaviour):
    d = behaviour - trainer
    return (torch.exp(d) - 1 - d).mean().item()


def test_replaying_the_models_own_routing_changes_nothing_and_another_routing_is_used(moe_dir):
    from areal_fast.data.tiny_models import load_hf
    from areal_fast.moe_routing import record_routing, replay_indices, replay_routing, routers

    model = load_hf(moe_dir)
    assert len(routers(model)) == 2
    ids = torch.randint(2, 100, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routing(model) as rec:
        ref = model(ids).logits
    assert [len(r) for r in rec] == [1, 1] and rec[0][0].shape == (60, 2)
    with torch.no_grad(), replay_routing(model, [r[0] for r in rec]):
        assert torch.equal(model(ids).logits, ref)
    other = [(r[0] + 1) % 4 for r in rec]  # every token to other experts
    with torch.no_grad(), replay_routing(model, other), record_routing(model) as seen:
        changed = model(ids).logits
    assert all(torch.equal(s[0], o) for s, o in zip(seen, other)) and not torch.allclose(changed, ref)
    with torch.no_grad():  # the router's own forward is back after the block
        assert torch.equal(model(ids).logits, ref)
    with pytest.raises(ValueError, match="recorded layers"):
        with replay_routing(model, other[:1]):
            pass
    # packed rows (the trainer's) become the same indices; an expert the model does not have (rows
    # kept in an old checkpoint) is refused there, before any forward, where a gather would index past
    # the experts (a device assert on CUDA)
    rows = torch.cat(other, dim=1).to(torch.int16)
    assert all(torch.equal(a, b) for a, b in zip(replay_indices(model, rows), other))
    for bad in (3000, -2):
        wrong = rows.clone()
        wrong[5, 3] = bad
        with pytest.raises(ValueError, match=r"expert ids .* outside \[0, 4\) of this model"):
            replay_indices(model, wrong)


def test_replaying_the_bf16_servers_routing_removes_most_of_the_mismatch(moe_dir):
    from areal_fast.data.tiny_models import load_hf
    from areal_fast.moe_routing import record_routing, replay_routing, routers

    trainer = load_hf(moe_dir)
    server = load_hf(moe_dir).to(torch.bfloat16)
    ids = torch.randint(2, 100, (32, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with record_routing(server) as served:
            behaviour = _logprobs(server, ids)
        with record_routing(trainer) as own:
            free = _logprobs(trainer, ids)
    flips = sum(int((s[0].sort(-1).values != o[0].sort(-1).values).any(-1).sum()) for s, o in zip(served, own))
    assert flips > 0  # bf16 rounding of the router logits sends some tokens to other experts
    replayed_routing = [s[0] for s in served]
    with replay_routing(trainer, replayed_routing):
        replayed = _logprobs(trainer, ids)
        replayed.sum().backward()
    assert _k3(replayed.detach(), behaviour) < _k3(free, behaviour) / 5
    assert (replayed.detach() - behaviour).abs().max() < (free - behaviour).abs().max() / 5
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(trainer))
