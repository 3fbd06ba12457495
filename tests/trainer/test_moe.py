"""A tiny Qwen3-MoE through the loop's parts on CPU: the checkpoint's per-expert layout vs the
model's fused experts (judged by transformers' own save), the trainer (recompute equal to HF, a
PPO step that moves experts and router), the embedded engine (greedy and log-probs equal to HF)
and the weight sync into it (SGLang's broadcast, disk, vLLM's transfer: the checkpoint layout on
the wire)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch
from tolerances import ENGINE_LOGPROB_ATOL, FP32_PACKED_LOGPROB_ATOL

VOCAB = 100
PROMPT = [5, 17, 42, 3, 99, 7]
N_NEW = 10


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_moe")), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    from areal_fast.data.tiny_models import load_hf

    return load_hf(moe_dir)


def _fused_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_checkpoint_layout_is_what_transformers_saves(moe_dir, hf_moe):
    """Our split of the fused experts (names, shapes, values, expert order, gate before up) equals
    the per-expert file transformers itself wrote; fusing it back gives the model's tensors."""
    from safetensors.torch import load_file

    from areal_fast.weights.experts import to_checkpoint_state, to_model_layout

    saved = load_file(f"{moe_dir}/model.safetensors")
    fused = _fused_state(hf_moe)
    ours = to_checkpoint_state(fused)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved
    assert sorted(ours) == sorted(saved)
    for k in saved:
        assert torch.equal(ours[k], saved[k]), k
    back = to_model_layout(saved, fused)
    assert sorted(back) == sorted(fused) and all(torch.equal(back[k], fused[k]) for k in fused)
    del saved["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj\.weight is missing"):
        to_model_layout(saved, fused)


def test_renamed_bucket_is_the_same_bytes_in_checkpoint_layout(hf_moe):
    """A gathered bucket renamed to the checkpoint layout: every per-expert tensor read from the
    bucket's bytes at its new offset equals transformers' split, and the bucket stays unpadded."""
    from areal_fast.backends.sglang.weight_sync import check_unpadded
    from areal_fast.weights.experts import to_checkpoint_layout, to_checkpoint_state
    from areal_fast.weights.gather import BucketGatherer, collect_sources, send_dtypes

    state = _fused_state(hf_moe)
    src = collect_sources(state)
    want = to_checkpoint_state({k: v.to(torch.bfloat16) for k, v in state.items()})
    got = {}

    class _Done:
        def wait(self):
            pass

    def consume(bucket):
        b = to_checkpoint_layout(bucket)
        sizes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(b.shapes, b.dtypes)]
        check_unpadded(b.index, b.names, b.offsets, sizes)
        assert all(b.offsets[i] + sizes[i] == b.offsets[i + 1] for i in range(len(sizes) - 1))
        got.update({n: b.tensor(i).clone() for i, n in enumerate(b.names)})
        return _Done()

    BucketGatherer(16 << 10).run(src, send_dtypes(src, torch.bfloat16), consume)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_trainer_recompute_equals_hf_and_a_step_moves_experts_and_router(moe_dir, hf_moe, tmp_path):
    """The actor loads the per-expert checkpoint into fused experts; packed recompute equals HF's
    forward; one PPO step (fused loss, proximal recompute) changes every expert tensor and router;
    the HF export is in the checkpoint layout and loads back as the trained weights."""
    from test_trainer_actor import actor_for, hf_logprobs, make_batch

    actor = actor_for(moe_dir, max_tokens_per_mb=48, ppo={"prox_mode": "recompute"})
    batch = make_batch(6, seed=3, version=0)
    for s, lp in zip(batch, actor.compute_logprobs(batch)):
        torch.testing.assert_close(lp, hf_logprobs(hf_moe, s), atol=FP32_PACKED_LOGPROB_ATOL, rtol=0)
    before = {k: v.clone() for k, v in actor.full_state_dict().items()}
    stats = actor.train_batch(batch, version=1)
    assert stats["n_loss_tokens"] > 0 and stats["grad_norm"] > 0
    after = actor.full_state_dict()
    moved = [k for k in before if ("experts" in k or "mlp.gate" in k) and not torch.equal(before[k], after[k])]
    assert sorted(moved) == sorted(k for k in before if "experts" in k or "mlp.gate" in k)
    # the export is a checkpoint in the per-expert layout that transformers loads as the trained model
    from safetensors import safe_open

    from areal_fast.data.tiny_models import load_hf
    from areal_fast.trainer import export_hf

    export_hf(actor, str(tmp_path / "export"))
    names = set(safe_open(str(tmp_path / "export" / "model.safetensors"), "pt").keys())
    assert "model.layers.0.mlp.experts.1.gate_proj.weight" in names and not any(n.endswith("_proj") for n in names)
    reloaded = load_hf(str(tmp_path / "export")).state_dict()
    assert all(torch.equal(reloaded[k], after[k]) for k in after)


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _greedy(url, prompt=PROMPT, n=N_NEW):
    out = _post(url, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    return out["output_ids"][:n], [x[0] for x in out["meta_info"]["output_token_logprobs"]], \
        out["meta_info"]["weight_version"]


@pytest.fixture(scope="module")
def engine(moe_dir):
    from areal_fast.embedded.launch import launch_engine_subprocess

    # a process of its own: the weight group's name is registered once per process on each side
    h = launch_engine_subprocess(moe_dir, dtype="float32")
    try:
        yield h
    finally:
        h.stop()


@pytest.mark.slow  # the embedded engine in a subprocess
def test_embedded_engine_serves_moe_as_hf(engine, hf_moe):
    """Greedy tokens equal HF's generate and the engine's log-probs a fresh HF forward, also for a
    batch of different prompts served together (routing is per token: batching must not change it)."""
    from areal_fast.data.tiny_models import hf_greedy, hf_logprobs

    async def many(bodies):
        return await asyncio.gather(*[asyncio.to_thread(_post, engine.url, "/generate", b) for b in bodies])

    prompts = [PROMPT, [9, 8, 7], [3] * 11, [50, 60, 70, 80]]
    bodies = [{"input_ids": p, "return_logprob": True,
               "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}} for p in prompts]
    for p, r in zip(prompts, asyncio.run(many(bodies))):
        assert r["output_ids"] == hf_greedy(hf_moe, p, N_NEW)
        got = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf_moe, p, r["output_ids"], 0.0)
        assert max(abs(a - b) for a, b in zip(got, ref)) < ENGINE_LOGPROB_ATOL


@pytest.mark.slow  # the embedded engine in a subprocess
def test_weight_sync_into_engine_sends_checkpoint_layout(engine, moe_dir):
    """The broadcast path (buckets split inside expert tensors' neighbours, bf16) and the disk path
    carry the experts, and so do delta updates of some expert elements: the engine's greedy output
    then equals HF holding the same weights; the disk path wrote the per-expert checkpoint names."""
    from safetensors import safe_open

    from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
    from areal_fast.data.tiny_models import hf_greedy, hf_logprobs, load_hf, perturbed_state_dict
    from areal_fast.weights.sync import WeightSyncConfig

    before = _greedy(engine.url)[0]

    def same_as_hf(state, version):
        """The engine's greedy tokens and log-probs are HF's holding ``state`` rounded to bf16."""
        model = load_hf(moe_dir, {k: v.to(torch.bfloat16).float() for k, v in state.items()})
        got, lps, ver = _greedy(engine.url)
        assert ver == version and got == hf_greedy(model, PROMPT, N_NEW)
        assert max(abs(a - b) for a, b in zip(lps, hf_logprobs(model, PROMPT, got, 0.0))) < ENGINE_LOGPROB_ATOL
        return got

    s1 = perturbed_state_dict(moe_dir, seed=1)  # the model's fused names, as the trainer holds them
    assert "model.layers.0.mlp.experts.gate_up_proj" in s1
    sync = DistributedWeightSync([engine.url], WeightSyncConfig(
        bucket_bytes=24 << 10, collective="gloo", timeout_s=60, dtype="bfloat16", group_name="moe_weight_group"))
    wire: list[str] = []
    submit = sync.http.submit

    def spy(url, path, body=None, *a, **kw):
        if path == "/update_weights_from_distributed":
            wire.extend(body["names"])
        return submit(url, path, body, *a, **kw)

    sync.http.submit = spy
    try:
        sync.update(s1, 3)
    finally:
        sync.close()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in wire and not any("_proj" in n and n.endswith("proj")
                                                                               for n in wire)
    assert same_as_hf(s1, "3") != before
    s2 = perturbed_state_dict(moe_dir, seed=2)
    disk = DiskWeightSync([engine.url], WeightSyncConfig(timeout_s=60, dtype="bfloat16"), config_dir=moe_dir,
                          keep=True)
    disk.update(s2, 4)
    names = set()
    for f in json.load(open(f"{disk.last_path}/model.safetensors.index.json"))["weight_map"].values():
        names |= set(safe_open(f"{disk.last_path}/{f}", "pt").keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names and not any(n.endswith("gate_up_proj")
                                                                                for n in names)
    same_as_hf(s2, "4")
    # delta updates: after a whole update, one that moves only some expert elements goes as a delta
    s3 = perturbed_state_dict(moe_dir, seed=3)
    delta = DistributedWeightSync([engine.url], WeightSyncConfig(
        bucket_bytes=24 << 10, collective="gloo", timeout_s=60, dtype="bfloat16", group_name="moe_delta_group",
        delta="on"))
    try:
        delta.update(s3, 5)
        g = torch.Generator().manual_seed(0)
        for n, t in s3.items():
            if "experts" in n:
                t[torch.rand(t.shape, generator=g) < 0.05] *= 1.5
        delta.update(s3, 6)
        assert delta.delta.stats.mode == "delta" and delta.delta.stats.tensors_delta > 0
    finally:
        delta.close()
    same_as_hf(s3, "6")


def test_moe_recipe_config_is_checked_at_load_and_builds_qwen3_moe():
    """examples/tiny_reverse_moe.yaml builds a Qwen3-MoE (4 experts, top 2, head size 32); a wrong
    arch or a top-k above the expert count is refused at config load naming the key; the dense
    recipe's warm-start cache key is what it was before the MoE options existed."""
    from pathlib import Path

    import transformers

    from areal_fast.config import load_config
    from areal_fast.configutil import ConfigError
    from areal_fast.data import tiny_task
    from areal_fast.data.tokenizer import CharTokenizer
    from areal_fast.data.warm_start import build_tiny_model, signature

    root = Path(__file__).resolve().parents[2] / "examples"
    cfg = load_config(root / "tiny_reverse_moe.yaml", ["model.warm_start.hidden_size=64",
                                                       "model.warm_start.num_attention_heads=2"])
    model = build_tiny_model(cfg.warm_start_recipe(), CharTokenizer(tiny_task.vocabulary(cfg.data.synthetic)))
    assert isinstance(model, transformers.Qwen3MoeForCausalLM)
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.head_dim, c.decoder_sparse_step) == (4, 2, 32, 1)
    assert signature(cfg.warm_start_recipe())["model"]["num_experts"] == 4
    with pytest.raises(ConfigError, match=r"model\.warm_start\.arch: must be one of"):
        load_config(root / "tiny_reverse_moe.yaml", ["model.warm_start.arch=mixtral"])
    with pytest.raises(ConfigError, match=r"model\.warm_start\.num_experts_per_tok: must be <= num_experts"):
        load_config(root / "tiny_reverse_moe.yaml", ["model.warm_start.num_experts_per_tok=5"])
    dense = signature(load_config(root / "tiny_reverse.yaml").warm_start_recipe())
    assert "arch" not in dense["warm_start"] and "num_experts" not in dense["model"]


@pytest.mark.slow  # a sender subprocess and a gloo group
def test_vllm_transfer_into_the_twin_carries_the_experts_bitwise(moe_dir, tmp_path):
    """vLLM's weight-transfer protocol (names announced first, then one broadcast per tensor) from a
    sender process to the embedded engine's vLLM twin: the per-expert wire lands bitwise in the
    fused expert parameters."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from areal_fast.data.tiny_models import perturbed_state_dict
    from areal_fast.embedded import start_engine_in_thread

    sender = Path(__file__).resolve().parents[1] / "weights" / "_vllm_sender.py"
    state = perturbed_state_dict(moe_dir, seed=9)
    torch.save(state, tmp_path / "s.pt")
    twin = start_engine_in_thread(moe_dir, seed=1, api="vllm", vllm_version="0.33.0", weight_version="0",
                                  dtype="float32")
    receiver, wire = twin.server.receiver, []
    load = receiver.load

    def spy(named):
        wire.extend(n for n, _ in named)
        return load(named)

    receiver.load = spy
    try:
        r = subprocess.run([sys.executable, str(sender), twin.url, str(tmp_path / "s.pt"), "1"], capture_output=True,
                           text=True, timeout=240, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(sender.parent), os.environ.get("PYTHONPATH", "")])})
        assert r.returncode == 0, r.stderr[-3000:]
        params = dict(twin.server.scheduler.model.named_parameters())
        assert twin.server.scheduler.weight_version == "1"
        for n, t in state.items():
            assert torch.equal(params[n].detach(), t), n
        assert "model.layers.1.mlp.experts.0.up_proj.weight" in wire and not any(n.endswith("gate_up_proj")
                                                                                 for n in wire)
    finally:
        twin.stop()
