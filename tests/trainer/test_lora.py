"""The LoRA actor (``train.lora``): PEFT's adapters on the frozen base under FSDP2, the files it
writes (PEFT's format, loaded by PEFT itself), its checkpoints and its ``final/`` export."""

import json
import os

import pytest
import torch
from test_trainer_actor import hf_logprobs, make_batch, make_tiny_model
from tolerances import FP32_LORA_LOGPROB_ATOL, FP32_PACKED_LOGPROB_ATOL

from areal_fast.config import ConfigError, load_config
from areal_fast.configutil import from_dict
from areal_fast.trainer import PPOActor, TrainerConfig, export_hf, load_checkpoint, save_checkpoint

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lora_base")
    return str(path), make_tiny_model(path).eval()


def lora_actor(path, **kw):
    return PPOActor(from_dict(TrainerConfig, {"model_path": path, "device": "cpu",
                                              "lora": dict(LORA, **kw.pop("lora", {})), "optim": {"lr": 1e-2}, **kw}))


def test_run_config_names_an_unknown_or_refused_target_module_at_load():
    for mods, culprit in ((["q_proj", "qkv_proj"], "'qkv_proj'"), (["lm_head"], "'lm_head'")):
        with pytest.raises(ConfigError, match=culprit):
            load_config("examples/tiny_reverse_lora.yaml", [f"train.lora.target_modules=[{','.join(mods)}]"])
    with pytest.raises(ConfigError, match="pause_mode 'in_place'"):  # SGLang's unload waits for kept requests
        load_config("examples/tiny_reverse_lora.yaml", ["rollout.pause_mode=in_place"])
    cfg = load_config("examples/tiny_reverse_lora.yaml", ["rollout.api=vllm", "rollout.server=vllm",
                                                          "train.lora.rank=12"])
    assert cfg.rollout.server_args[-6:] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"][-6:]
    assert cfg.rollout.server_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_a_lora_run_fills_a_null_weights_method_with_disk_and_refuses_distributed():
    """weights.method left null is chosen for the run (adapters travel as files); a value the user gave is
    never replaced: 'distributed' in a LoRA run is refused, naming the key and the way out."""
    assert load_config("examples/tiny_reverse_lora.yaml").weights.method == "disk"
    assert load_config("examples/tiny_reverse.yaml", ["weights.method=null"]).weights.method == "distributed"
    with pytest.raises(ConfigError, match=r"weights.method 'distributed'.*weights.method: disk"):
        load_config("examples/tiny_reverse_lora.yaml", ["weights.method=distributed"])


def test_lora_actor_starts_at_the_base_and_trains_only_the_adapter(tiny):
    path, hf = tiny
    actor = lora_actor(path)
    batch = make_batch()
    for lp, s in zip(actor.compute_logprobs(batch), batch):  # B = 0: step 0 is the base model exactly
        torch.testing.assert_close(lp, hf_logprobs(hf, s), atol=FP32_PACKED_LOGPROB_ATOL, rtol=0)
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(LORA["target_modules"]) * actor.hf_config.num_hidden_layers
    base = {k: v.clone() for k, v in actor.model.state_dict().items() if "lora_" not in k}
    first = actor.train_batch(batch, 0)
    for v in range(1, 4):
        actor.train_batch(batch, v)
    assert all(torch.equal(v, actor.model.state_dict()[k]) for k, v in base.items())  # frozen, bitwise
    assert sum(len(s) for s in actor.optimizer.state.values()) > 0
    assert {id(p) for p in actor.optimizer.state} <= {id(p) for p in actor.model.parameters() if p.requires_grad}
    moved = [float((a - b).abs().max()) for a, b in zip(actor.compute_logprobs(batch),
                                                        (hf_logprobs(hf, s) for s in batch))]
    assert max(moved) > 1e-3 and first["grad_norm"] > 0


def test_the_synced_adapter_is_peft_format_and_peft_reproduces_the_trainer(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from areal_fast.weights.adapter import write_adapter

    path, _ = tiny
    actor = lora_actor(path)
    batch = make_batch()
    for v in range(3):
        actor.train_batch(batch, v)
    tensors = actor.adapter_state_dict()
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith(("lora_A.weight", "lora_B.weight"))
               for k in tensors)
    out = tmp_path / "adapter"
    write_adapter(str(out), tensors, actor.lora, path)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 8.0, "LORA")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(out)).eval()
    for lp, s in zip(actor.compute_logprobs(batch), batch):
        torch.testing.assert_close(lp, hf_logprobs(peft, s), atol=FP32_LORA_LOGPROB_ATOL, rtol=0)


def test_checkpoint_holds_the_adapter_and_its_optimizer_state_once_and_resumes_exactly(tiny, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path, _ = tiny
    batch = make_batch()
    a = lora_actor(path)
    for v in range(2):
        a.train_batch(batch, v)
    save_checkpoint(a, str(tmp_path / "ck"))
    keys = list(FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # no frozen base weight in the checkpoint
    n_adapter = 2 * len(LORA["target_modules"]) * a.hf_config.num_hidden_layers
    assert len(model_keys) == n_adapter
    assert len({k for k in keys if k.startswith("optim.state.") and k.endswith(".exp_avg")}) == n_adapter
    b = lora_actor(path)
    load_checkpoint(b, str(tmp_path / "ck"))
    ma, mb = a.train_batch(batch, 2), b.train_batch(batch, 2)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_final_export_is_the_adapter_and_on_request_the_merged_model(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    actor = lora_actor(path, lora={"save_merged": True})
    batch = make_batch()
    for v in range(2):
        actor.train_batch(batch, v)
    export_hf(actor, str(tmp_path / "final"))
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(os.listdir(tmp_path / "final"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final" / "merged")).eval()
    for lp, s in zip(actor.compute_logprobs(batch), batch):
        torch.testing.assert_close(lp, hf_logprobs(merged, s), atol=FP32_LORA_LOGPROB_ATOL, rtol=0)
