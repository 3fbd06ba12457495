"""A LoRA actor on two FSDP2 ranks (gloo, torchrun) trains the same adapter as on one rank: the
adapter matrices are sharded with their blocks, gathered for the export, and the update does not
depend on the rank count. Both runs use the test worker ``_train_jsonl.py`` (a JSONL of batches; the
config read by the one config loader)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_trainer_actor import make_tiny_model
from tolerances import FP32_MULTI_RANK_ADAPTER_ATOL, FP32_MULTI_RANK_LOSS_ATOL

pytestmark = pytest.mark.slow  # two torchrun launches of the trainer

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]}


def _batches(path, n_batches=2):
    g = torch.Generator().manual_seed(3)
    with open(path, "w") as f:
        for b in range(n_batches):
            batch = []
            for i in range(12):
                p, o = int(torch.randint(2, 8, (1,), generator=g)), int(torch.randint(2, 16, (1,), generator=g))
                batch.append({"prompt_ids": torch.randint(2, 100, (p,), generator=g).tolist(),
                              "output_ids": torch.randint(2, 100, (o,), generator=g).tolist(),
                              "output_logprobs": (-torch.rand(o, generator=g) * 3 - 0.5).tolist(),
                              "output_versions": [b] * o, "reward": float(i % 3 == 0), "group_id": f"{b}-{i // 4}"})
            f.write(json.dumps(batch) + "\n")


def _train(tmp_path, model, nproc):
    cfg = tmp_path / f"cfg{nproc}.json"
    cfg.write_text(json.dumps({"model_path": model, "device": "cpu", "max_tokens_per_mb": 48, "lora": LORA,
                               "optim": {"lr": 1e-2, "eps": 1e-6}}))
    out = tmp_path / f"adapter{nproc}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(os.path.dirname(__file__), "_train_jsonl.py"), "--config", str(cfg),
           "--batches", str(tmp_path / "b.jsonl"),
           "--export-hf", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in r.stdout.splitlines() if x.startswith("{")]
    from safetensors.torch import load_file

    return losses, load_file(str(out / "adapter_model.safetensors"))


def test_two_fsdp2_ranks_train_the_same_adapter_as_one(tmp_path):
    make_tiny_model(tmp_path / "base")
    _batches(tmp_path / "b.jsonl")
    l1, a1 = _train(tmp_path, str(tmp_path / "base"), 1)
    l2, a2 = _train(tmp_path, str(tmp_path / "base"), 2)
    assert len(l1) == len(l2) == 2
    assert l1 == pytest.approx(l2, abs=FP32_MULTI_RANK_LOSS_ATOL)
    assert sorted(a1) == sorted(a2) and len(a1) == 2 * len(LORA["target_modules"]) * 2
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], atol=FP32_MULTI_RANK_ADAPTER_ATOL, rtol=0)
    assert any(float(v.abs().max()) > 0 for k, v in a1.items() if "lora_B" in k)  # the adapter moved
