"""LoRA against real vLLM (its CPU build): the adapters we write are served by vLLM unchanged, an
in-place replacement takes effect (no stale prefix cache), and the tiny recipe as a LoRA run learns
with adapter-only updates and exact per-token versions.

vLLM must run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (its runtime
``/v1/load_lora_adapter``), so these tests start their own servers: the session's ``real_vllm``
fixture serves no adapter. The recipe run launches its server itself (the launcher adds the flags).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import real_vllm as rv
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse_lora.yaml"
STEPS, ETA = 30, 4
PROMPT = [1, 3, 4, 5, 6]
LOGPROB_ATOL = 2e-3  # vLLM's CPU kernels against the HF forward, both fp32 (as tests/rollout/test_real_vllm.py)


def _python() -> Path:
    try:
        return rv.vllm_python()
    except rv.VLLMUnavailable as e:
        rv.skip_or_fail(str(e))


def test_the_tiny_recipe_learns_as_a_lora_run_against_real_vllm(tmp_path):
    python = _python()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(EXAMPLE), f"experiment.output_dir={out}",
           *rv.run_overrides(python), f"experiment.total_steps={STEPS}", "eval.every_steps=15",
           f"rollout.max_staleness={ETA}", "rollout.strict_staleness=true", "log.tensorboard=false",
           "log.plots=false", "checkpoint.every_steps=0"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    server_log = out / "logs" / "server0.log"
    assert r.returncode == 0, (r.stderr[-3000:], server_log.read_text(errors="replace")[-3000:]
                               if server_log.exists() else "")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m["eval_reward"] for m in metrics if m.get("kind") == "eval"]
    assert evals[0] <= 0.3 and evals[-1] >= evals[0] + 0.3, evals  # exact match up by >= 0.3 (0.21 -> ~0.7)
    steps = [m for m in metrics if "staleness_max" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(m["staleness_max"] <= ETA for m in steps)
    assert steps[-1]["staleness_mean"] < ETA + 1 <= STEPS - 1  # labels move with the versions
    log = server_log.read_text(errors="replace")
    assert "--enable-lora" in log
    # every update (the initial adapter and one a step) moved only the adapter: no weight reload at all
    assert log.count('"POST /v1/load_lora_adapter') == STEPS + 1
    assert log.count('"POST /update_weight_version') == STEPS + 1
    assert '"POST /collective_rpc' not in log and '"POST /update_weights' not in log
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "final").iterdir()}


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory):
    """A real vLLM server with runtime LoRA loading, on the tiny random Qwen2 of ``real_vllm``."""
    from areal_fast.netutil import find_free_port

    python = _python()
    root = tmp_path_factory.mktemp("lora_vllm")
    model = rv.build_model(root / "model")
    server = rv.VLLMServer(model, find_free_port(), root / "server.log", python=python,
                           extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"],
                           env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        server.wait_ready()
    except rv.VLLMUnavailable as e:
        server.stop()
        rv.skip_or_fail(str(e))
    yield server
    server.stop()


def _adapter_state(model: Path, seed: int) -> dict[str, torch.Tensor]:
    """A trainer-side (HF-style names) adapter state with nonzero B, rank 8 on every projection."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_fast.trainer.lora import peft_config
    from areal_fast.trainer.lora_config import LoRAConfig

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


def _complete(url: str, model: str, n: int) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]


def test_real_vllm_serves_our_adapter_files_and_replaces_them_in_place(lora_vllm, tmp_path):
    from areal_fast.trainer.lora_config import LoRAConfig
    from areal_fast.weights import WeightSyncConfig
    from areal_fast.weights.lora_sync import LoRAAdapterSync

    sync = LoRAAdapterSync([lora_vllm.url], WeightSyncConfig(save_root=str(tmp_path)), lora=LoRAConfig(rank=8),
                           api="vllm", base_model=str(lora_vllm.model))
    try:
        for version, seed in ((1, 1), (2, 2)):  # the second replaces the first in place (same name, same id)
            state = _adapter_state(lora_vllm.model, seed)  # the trainer's names (adapter 'default')
            sync.update(state, version)
            got = _complete(lora_vllm.url, "areal-lora", 12)
            ids, lps = _peft_greedy(lora_vllm.model, sync.current, 12)
            assert got["token_ids"] == ids, (version, got["token_ids"], ids)
            torch.testing.assert_close(torch.tensor(got["logprobs"]["token_logprobs"]), torch.tensor(lps),
                                       atol=LOGPROB_ATOL, rtol=0)
        with urllib.request.urlopen(f"{lora_vllm.url}/weight_info", timeout=30) as r:
            assert json.loads(r.read())["weight_version"] == "2"
    finally:
        sync.close()
