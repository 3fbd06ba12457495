"""LoRA adapters on the embedded engine, in SGLang's and vLLM's API shapes, and the adapter-only
weight update (``weights/lora_sync.py``) that replaces them: what each request generates is the
base plus its named adapter (checked against PEFT itself), an update moves only the adapter and
never the base, and tokens generated across an in-place replacement are labelled version by version."""

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from test_trainer_actor import make_tiny_model
from tolerances import ENGINE_LOGPROB_ATOL

from areal_fast.embedded import start_engine_in_thread
from areal_fast.lora_config import LoRAConfig
from areal_fast.weights import WeightSyncConfig

PROMPT = [5, 9, 13, 17, 21]
CFG = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], name="run-a")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_serving_base")
    make_tiny_model(path)
    return str(path)


def adapter_tensors(base, seed):
    """A PEFT adapter's tensors for ``base`` with nonzero B (so it changes the outputs)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_fast.weights.adapter import peft_config

    torch.manual_seed(seed)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft_config(CFG))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    return {k.replace(".default.", "."): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}


def peft_greedy(base, adapter_dir, n, prompt=PROMPT):
    """Greedy tokens and their log-probs of PEFT's model (base + ``adapter_dir``, or the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(base)
    if adapter_dir is not None:
        m = PeftModel.from_pretrained(m, adapter_dir)
    m.eval()
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = m(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            t = int(logp.argmax())
            ids.append(t)
            lps.append(float(logp[t]))
    return ids[len(prompt):], lps


def post(url, body=None):
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            try:
                return r.status, json.loads(raw or b"null")
            except ValueError:
                return r.status, raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def write(tmp_path, name, tensors, base):
    from areal_fast.weights.adapter import write_adapter

    path = str(tmp_path / name)
    write_adapter(path, tensors, CFG, base)
    return path


def sglang_generate(url, n, prompt=PROMPT, **extra):
    code, ans = post(f"{url}/generate", {"input_ids": prompt, "return_logprob": True, **extra,
                                         "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                             "ignore_eos": True}})
    assert code == 200, ans
    return ans["output_ids"], [x[0] for x in ans["meta_info"]["output_token_logprobs"]], ans


def test_sglang_api_serves_the_named_adapter_as_peft_computes_it(base, tmp_path):
    a_dir = write(tmp_path, "a", adapter_tensors(base, 1), base)
    h = start_engine_in_thread(base, enable_lora=True, max_lora_rank=8)
    try:
        assert post(f"{h.url}/load_lora_adapter", {"lora_name": "run-a", "lora_path": a_dir})[0] == 200
        ids, lps, _ = sglang_generate(h.url, 8, lora_path="run-a")
        ref_ids, ref_lps = peft_greedy(base, a_dir, 8)
        assert ids == ref_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=ENGINE_LOGPROB_ATOL, rtol=0)
        base_ids, base_lps, _ = sglang_generate(h.url, 8)  # no lora_path: the base, untouched
        ref_ids, ref_lps = peft_greedy(base, None, 8)
        assert base_ids == ref_ids and base_lps != lps
        torch.testing.assert_close(torch.tensor(base_lps), torch.tensor(ref_lps), atol=ENGINE_LOGPROB_ATOL, rtol=0)
        code, ans = post(f"{h.url}/load_lora_adapter", {"lora_name": "run-a", "lora_path": a_dir})
        assert code == 400 and "already loaded" in ans["error_message"]  # SGLang: unload first
        assert post(f"{h.url}/unload_lora_adapter", {"lora_name": "run-a"})[0] == 200
        code, ans = post(f"{h.url}/generate", {"input_ids": PROMPT, "lora_path": "run-a",
                                               "sampling_params": {"max_new_tokens": 2}})
        assert code == 400 and "not loaded" in json.dumps(ans)
        code, ans = post(f"{h.url}/load_lora_adapter", {"lora_name": "big", "lora_path": a_dir})
        assert code == 200
    finally:
        h.stop()


def test_adapter_only_update_replaces_the_adapter_and_labels_the_version(base, tmp_path):
    from areal_fast.backends.sglang.lora_sync import SGLangLoRASync

    h = start_engine_in_thread(base, enable_lora=True, max_lora_rank=8, weight_version="0")
    full_loads = []
    h.server.receiver.load = lambda named: full_loads.append(named)  # a full-weight load would land here
    sync = SGLangLoRASync([h.url], WeightSyncConfig(save_root=str(tmp_path / "ws")), lora=CFG,
                          base_model=base)
    try:
        dirs = []
        for version, seed in ((1, 1), (2, 2)):
            state = {k.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.")
                     .replace(".lora_B.", ".lora_B.default."): v for k, v in adapter_tensors(base, seed).items()}
            sync.update(state, version)
            dirs.append(sync.current)
            assert sync.last_bytes < 64 * 1024  # the adapter only: the base is ~230 kB of fp32 here
        _ids, lps, ans = sglang_generate(h.url, 6, lora_path="run-a")
        assert ans["meta_info"]["weight_version"] == "2"
        _ref_ids, ref_lps = peft_greedy(base, dirs[1], 6)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=ENGINE_LOGPROB_ATOL, rtol=0)
        assert not os.path.exists(dirs[0]) and os.path.isdir(dirs[1])  # the previous version's files removed
        assert full_loads == []
    finally:
        sync.close()
        h.stop()


def test_vllm_api_in_place_replacement_labels_each_token_with_its_adapter_version(base, tmp_path):
    from areal_fast.backends.vllm.lora_sync import VLLMLoRASync

    h = start_engine_in_thread(base, enable_lora=True, max_lora_rank=8, api="vllm", vllm_version="0.33.0",
                               weight_version="0")
    sync = VLLMLoRASync([h.url], WeightSyncConfig(save_root=str(tmp_path / "ws")), lora=CFG)
    state = {k.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.")
             .replace(".lora_B.", ".lora_B.default."): v for k, v in adapter_tensors(base, 1).items()}
    try:
        code, ans = post(f"{h.url}/v1/completions", {"model": "run-a", "prompt": PROMPT, "max_tokens": 2})
        assert code == 404 and "does not exist" in ans["error"]["message"]  # vLLM: an unknown model
        sync.update(state, 0)
        box = {}

        def long_request():
            box["ans"] = post(f"{h.url}/v1/completions", {
                "model": "run-a", "prompt": PROMPT, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True,
                "logprobs": 0, "return_token_ids": True, "return_weight_versions": True, "request_id": "r"})

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        while not h.server.scheduler.has_running() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert post(f"{h.url}/pause?mode=keep&clear_cache=false")[0] == 200  # vLLM's in-place pause
        assert h.server.scheduler.has_running(), "the request finished before the pause: make it longer"
        sync.update({k: v * 2 for k, v in state.items()}, 1)  # not paused by the sync: it found it paused
        assert post(f"{h.url}/resume")[0] == 200
        t.join(60)
        code, ans = box["ans"]
        assert code == 200, ans
        spans = ans["choices"][0]["weight_versions"]
        assert [s["version"] for s in spans] == ["0", "1"] and spans[0]["end"] > 0, spans
        assert spans[-1]["end"] == len(ans["choices"][0]["token_ids"]) == 200
    finally:
        sync.close()
        h.stop()


def test_one_batch_serves_each_row_with_its_own_adapter_or_the_base(base, tmp_path):
    a_dir = write(tmp_path, "a", adapter_tensors(base, 1), base)
    h = start_engine_in_thread(base, enable_lora=True, max_lora_rank=8)
    try:
        assert post(f"{h.url}/load_lora_adapter", {"lora_name": "run-a", "lora_path": a_dir})[0] == 200
        h.server.scheduler.pause("in_place")  # queue both, then run them in one batch
        out = {}
        prompts = {"lora": PROMPT, "base": [*PROMPT, 25]}  # two prefills, then decode steps of both rows

        def go(key, **extra):
            out[key] = sglang_generate(h.url, 12, prompts[key], **extra)[:2]

        threads = [threading.Thread(target=go, args=("lora",), kwargs={"lora_path": "run-a"}),
                   threading.Thread(target=go, args=("base",))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while h.server.scheduler.num_in_flight() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        h.server.scheduler.call(h.server.scheduler.resume).result()
        for t in threads:
            t.join(60)
        for key, adapter in (("lora", a_dir), ("base", None)):
            ref_ids, ref_lps = peft_greedy(base, adapter, 12, prompts[key])
            assert out[key][0] == ref_ids, key
            torch.testing.assert_close(torch.tensor(out[key][1]), torch.tensor(ref_lps), atol=ENGINE_LOGPROB_ATOL,
                                       rtol=0)
    finally:
        h.stop()
