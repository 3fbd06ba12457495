"""LoRA against real vLLM (its CPU build): the adapters we write are served by vLLM unchanged, an
in-place replacement takes effect (no stale prefix cache), and the tiny recipe as a LoRA run learns
with adapter-only updates and exact per-token versions.

vLLM must run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (its runtime
``/v1/load_lora_adapter``): the session's ``real_vllm`` server is started with the flags and the
environment a LoRA run of the recipe adds (``conftest.lora_server_options``), on the recipe's warm
start, the LoRA run's base. Each test restores the server (adapters unloaded, version 0) after it.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import real_vllm as rv
import torch
from tolerances import VLLM_CPU_LOGPROB_ATOL

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse_lora.yaml"
STEPS, ETA = 30, 4
PROMPT = [1, 3, 4, 5, 6]


def test_the_tiny_recipe_learns_as_a_lora_run_against_real_vllm(tmp_path, real_vllm, recipe_warm_start):
    from conftest import lora_server_options
    from e2e_runs import assert_versions_label_the_tokens, assert_warm_start_used

    lora_args, lora_env = lora_server_options(rv.vllm_python())
    assert "--enable-lora" in lora_args and lora_env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    assert set(lora_args) <= set(real_vllm.command)  # the server serves as a LoRA run's launched one would
    out = tmp_path / "run"
    r, log = rv.train_against(real_vllm, recipe_warm_start, EXAMPLE, out, [
        f"experiment.total_steps={STEPS}", "eval.every_steps=15", f"rollout.max_staleness={ETA}",
        "rollout.strict_staleness=true", "log.tensorboard=false", "log.plots=false", "checkpoint.every_steps=0"])
    assert r.returncode == 0, (r.stderr[-3000:], log[-3000:])
    assert_warm_start_used(recipe_warm_start, out)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m["eval_reward"] for m in metrics if m.get("kind") == "eval"]
    assert evals[0] <= 0.3 and evals[-1] >= evals[0] + 0.3, evals  # exact match up by >= 0.3 (0.21 -> ~0.7)
    assert_versions_label_the_tokens(metrics, STEPS, ETA)
    # every update (the initial adapter and one a step) moved only the adapter: no weight reload at all
    assert log.count('"POST /v1/load_lora_adapter') == STEPS + 1
    assert log.count('"POST /update_weight_version') == STEPS + 1
    assert '"POST /collective_rpc' not in log and '"POST /update_weights' not in log
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "final").iterdir()}


def _adapter_state(model: Path, seed: int) -> dict[str, torch.Tensor]:
    """A trainer-side (HF-style names) adapter state with nonzero B, rank 8 on every projection."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_fast.lora_config import LoRAConfig
    from areal_fast.weights.adapter import peft_config

    torch.manual_seed(seed)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(model), peft_config(LoRAConfig(rank=8)))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    return {k.removeprefix("base_model.model."): v.detach().clone() for k, v in pm.state_dict().items()
            if "lora_" in k}


def _peft_greedy(model: Path, adapter: str, n: int):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), adapter).eval()
    ids, lps = list(PROMPT), []
    with torch.no_grad():
        for _ in range(n):
            logp = m(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp[ids[-1]]))
    return ids[len(PROMPT):], lps


def _complete(server: rv.VLLMServer, model: str, n: int) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    req = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **server.headers()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]


def test_real_vllm_serves_our_adapter_files_and_replaces_them_in_place(real_vllm, tmp_path):
    from areal_fast.backends.vllm.lora_sync import VLLMLoRASync
    from areal_fast.lora_config import LoRAConfig
    from areal_fast.weights import WeightSyncConfig

    sync = VLLMLoRASync([real_vllm.url], WeightSyncConfig(save_root=str(tmp_path), api_key=real_vllm.api_key),
                        lora=LoRAConfig(rank=8), base_model=str(real_vllm.model))
    try:
        for version, seed in ((1, 1), (2, 2)):  # the second replaces the first in place (same name, same id)
            state = _adapter_state(real_vllm.model, seed)  # the trainer's names (adapter 'default')
            sync.update(state, version)
            got = _complete(real_vllm, "areal-lora", 12)
            ids, lps = _peft_greedy(real_vllm.model, sync.current, 12)
            assert got["token_ids"] == ids, (version, got["token_ids"], ids)
            torch.testing.assert_close(torch.tensor(got["logprobs"]["token_logprobs"]), torch.tensor(lps),
                                       atol=VLLM_CPU_LOGPROB_ATOL, rtol=0)
        req = urllib.request.Request(f"{real_vllm.url}/weight_info", headers=real_vllm.headers())
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == "2"
    finally:
        sync.close()
        real_vllm.restore()
