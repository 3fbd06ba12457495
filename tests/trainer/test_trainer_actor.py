"""PPO actor on one rank (in this process, gloo world of 1): recompute, learning, proximal
approximation, HF export, and the embedded engine's behaviour log-probs."""

import math

import pytest
import torch
from tolerances import (
    ENGINE_LOGPROB_ATOL,
    FP32_PACKED_LOGPROB_ATOL,
    FP32_SAME_MATH_ATOL,
    FP32_SAME_MATH_NORM_RTOL,
    FP32_STAT_ATOL,
)

from areal_fast.configutil import from_dict
from areal_fast.trainer import PPOActor, Sample, TrainerConfig, export_hf

VOCAB = 100


def make_tiny_model(path, seed=0, tie=False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                      tie_word_embeddings=tie, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # std 0.02 gives near-uniform outputs; 0.1 makes the policy visibly peaked
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    return model


def make_batch(n=12, seed=0, version=0, group_size=4, max_prompt=8, max_out=20):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(1, max_prompt, (1,), generator=g))
        o = int(torch.randint(1, max_out, (1,), generator=g))
        out.append(Sample(prompt_ids=torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                          output_ids=torch.randint(2, VOCAB, (o,), generator=g).tolist(),
                          output_logprobs=(-torch.rand(o, generator=g) * 4 - 1).tolist(),
                          output_versions=[version] * o,
                          reward=float(torch.rand((), generator=g) > 0.5), group_id=i // group_size))
    return out


def hf_logprobs(model, s):
    ids = torch.tensor(list(s.prompt_ids) + list(s.output_ids))[None]
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0][len(s.prompt_ids) - 1:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model = make_tiny_model(path).eval()
    return str(path), model


def actor_for(path, **kw):
    ppo = kw.pop("ppo", {})
    optim = kw.pop("optim", {"lr": 1e-3})
    return PPOActor(from_dict(TrainerConfig, {"model_path": path, "device": "cpu", "ppo": ppo, "optim": optim, **kw}))


def test_recomputed_logprobs_equal_unpacked_hf(tiny):
    path, model = tiny
    actor = actor_for(path, max_tokens_per_mb=48)  # several packed micro-batches
    batch = make_batch(9, seed=3)
    for s, lp in zip(batch, actor.compute_logprobs(batch)):
        torch.testing.assert_close(lp, hf_logprobs(model, s), atol=FP32_PACKED_LOGPROB_ATOL, rtol=0)


def test_the_configured_attention_kernel_runs_the_packed_forward(tiny, monkeypatch):
    """``train.attn_impl`` reaches the model: its attention layers run our packed kernel with the
    configured choice (the one a CPU offers besides 'auto', which picks it too: the choice recorded is
    what tells them apart here; the GPU test tells the kernels apart)."""
    from areal_fast.trainer import attention

    ran = []
    loop = attention.varlen_attention_bucketed  # the 'sdpa_loop' kernel

    def counted(*a, **kw):
        ran.append(attention._selected["impl"])
        return loop(*a, **kw)

    monkeypatch.setattr(attention, "varlen_attention_bucketed", counted)
    path, model = tiny
    actor = actor_for(path, attn_impl="sdpa_loop")
    actor.compute_logprobs(make_batch(3, seed=4))
    assert actor.model.lm.config._attn_implementation == attention.ATTN_NAME
    assert len(ran) >= model.config.num_hidden_layers and set(ran) == {"sdpa_loop"}, ran


def test_tied_embeddings_load_and_stay_tied(tmp_path):
    model = make_tiny_model(tmp_path, seed=2, tie=True).eval()
    actor = actor_for(str(tmp_path))
    assert actor.model.lm.lm_head.weight is actor.model.lm.get_input_embeddings().weight
    s = make_batch(1, seed=5)[0]
    torch.testing.assert_close(actor.compute_logprobs([s])[0], hf_logprobs(model, s),
                               atol=FP32_PACKED_LOGPROB_ATOL, rtol=0)
    names = [n for n, _ in actor.iter_full_params()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_steps_reduce_the_loss_on_a_fixed_batch(tiny):
    path, model = tiny
    actor = actor_for(path, ppo={"prox_mode": "none"}, optim={"lr": 3e-3})
    batch = make_batch(8, seed=1)
    for s in batch:  # on-policy behaviour log-probs: the PPO ratio starts at 1
        s.output_logprobs = hf_logprobs(model, s).tolist()
    losses = [actor.train_batch(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses
    assert actor.version == 4


def test_proximal_approximation_through_the_actor(tiny):
    """With tokens two versions old, alpha = 1/2: behav_kl = mean(p - b) = mean(l - b) / 2."""
    path, model = tiny
    actor = actor_for(path, ppo={"prox_mode": "approx"})
    actor.version = 5
    batch = make_batch(6, seed=4, version=3)
    cur = torch.cat(actor.compute_logprobs(batch))
    b = torch.cat([torch.tensor(s.output_logprobs) for s in batch])
    m = actor.train_batch(batch)
    assert m["behav_kl"] == pytest.approx(float((cur - b).mean()) / 2, abs=FP32_STAT_ATOL)
    assert m["staleness_mean"] == m["staleness_max"] == 2  # made by v3, trained from weights v5
    # current-version tokens: alpha = 0, p = b exactly, the same update as prox_mode="none"
    a1 = actor_for(path, ppo={"prox_mode": "approx"})
    a2 = actor_for(path, ppo={"prox_mode": "none"})
    fresh = make_batch(6, seed=4, version=0)
    m1, m2 = a1.train_batch(fresh), a2.train_batch(fresh)
    assert m1["behav_kl"] == 0.0 and m1["loss"] == pytest.approx(m2["loss"], abs=FP32_SAME_MATH_ATOL)
    for (n, x), (_, y) in zip(a1.iter_full_params(), a2.iter_full_params()):
        torch.testing.assert_close(x, y, atol=FP32_SAME_MATH_ATOL, rtol=0, msg=n)


def test_minibatches_warmup_and_metrics(tiny):
    path, _ = tiny
    actor = actor_for(path, max_tokens_per_mb=40,
                      ppo={"ppo_n_minibatches": 3, "adv_estimator": "rloo", "adv_batch_norm": True,
                           "loss": {"kl_coef": 0.1, "entropy_coef": 0.01}},
                      optim={"lr": 1e-3, "warmup_steps": 2, "total_steps": 4, "lr_schedule": "cosine"})
    m = actor.train_batch(make_batch(12, seed=6))
    assert m["lr"] == pytest.approx(1e-3)  # after 1 of 2 warmup steps the next factor is 2/2
    for k in ("loss", "grad_norm", "ratio_mean", "clip_fraction", "entropy_mean", "kl_mean", "tokens_per_s"):
        assert math.isfinite(m[k]), k
    assert m["kl_mean"] >= 0  # k3 >= 0 (first minibatch: 0; later ones move away from the reference)
    assert m["n_loss_tokens"] == sum(len(s.output_ids) for s in make_batch(12, seed=6))
    assert "mfu" not in m  # CPU


def test_export_hf_roundtrip(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    actor = actor_for(path)
    batch = make_batch(4, seed=8)
    actor.train_batch(batch)
    export_hf(actor, str(tmp_path / "out"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    for s, lp in zip(batch, actor.compute_logprobs(batch)):
        torch.testing.assert_close(lp, hf_logprobs(reloaded, s), atol=FP32_PACKED_LOGPROB_ATOL, rtol=0)
    again = actor_for(str(tmp_path / "out"))
    for (n, x), (_, y) in zip(actor.iter_full_params(), again.iter_full_params()):
        assert torch.equal(x, y), n


def test_engine_behaviour_logprobs_equal_trainer_recompute(tiny):
    import json
    import urllib.request

    from areal_fast.embedded import start_engine_in_thread

    path, _ = tiny
    handle = start_engine_in_thread(path, device="cpu", dtype="float32", seed=0)
    try:
        samples = []
        for i, (prompt, temp) in enumerate([([5, 6, 7], 1.0), ([9, 3], 0.7), ([11, 12, 13, 14], 1.3)]):
            body = {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 12, "temperature": temp, "ignore_eos": True}}
            req = urllib.request.Request(handle.url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.loads(r.read())
            lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
            samples.append((temp, Sample(prompt_ids=prompt, output_ids=out["output_ids"], output_logprobs=lps,
                                         output_versions=[0] * len(lps), reward=0.0, group_id=i)))
    finally:
        handle.stop()
    for temp, s in samples:
        actor = actor_for(path, sampling_temperature=temp)
        got = actor.compute_logprobs([s])[0]
        torch.testing.assert_close(got, torch.tensor(s.output_logprobs), atol=ENGINE_LOGPROB_ATOL, rtol=0)


def test_activation_checkpointing_gives_the_same_update(tiny):
    path, _ = tiny
    batch = make_batch(6, seed=9)
    plain, ckpt = actor_for(path), actor_for(path, gradient_checkpointing=True)
    m1, m2 = plain.train_batch(batch), ckpt.train_batch(batch)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=FP32_SAME_MATH_NORM_RTOL)
    for (n, x), (n2, y) in zip(plain.iter_full_params(), ckpt.iter_full_params()):
        assert n == n2
        torch.testing.assert_close(x, y, atol=FP32_SAME_MATH_ATOL, rtol=0, msg=n)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_first_minibatch_proximal_logprobs_from_its_forward_equal_the_recompute(tiny, minibatches, monkeypatch):
    """The first minibatch's proximal log-probs taken in its training forward (no separate no-grad
    forward) give the recompute's update bit for bit: the same weights after two steps of stale and
    current tokens, the same metrics (mismatch dashboard included); later minibatches still recompute."""
    path, _ = tiny
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(PPOActor, "prox_from_forward", fast)
        actor = actor_for(path, max_tokens_per_mb=64, ppo={"ppo_n_minibatches": minibatches})
        calls = []

        def counted(*a, real=actor._logprobs, calls=calls, **k):
            calls.append(1)
            return real(*a, **k)

        monkeypatch.setattr(actor, "_logprobs", counted)
        ms = [actor.train_batch(make_batch(10, seed=7, version=0), 0),
              actor.train_batch(make_batch(10, seed=8, version=0), 1)]  # one version stale
        runs.append((ms, {n: x.clone() for n, x in actor.iter_full_params()}, len(calls)))
    (m_fast, w_fast, n_fast), (m_ref, w_ref, n_ref) = runs
    assert n_fast < n_ref and (n_fast == 0) == (minibatches == 1)
    for a, b in zip(m_fast, m_ref):
        assert "mismatch_k3" in a
        assert {k: v for k, v in a.items() if not k.endswith("_s") and k != "tokens_per_s"} == \
            {k: v for k, v in b.items() if not k.endswith("_s") and k != "tokens_per_s"}
    for n in w_ref:
        assert torch.equal(w_fast[n], w_ref[n]), n
