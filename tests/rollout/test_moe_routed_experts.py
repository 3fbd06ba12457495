"""The routed experts the servers return (``areal_fast/rollout/routed_experts.py``), encoded by the
servers' own code: vLLM 0.32's ``numpy2base64`` (run in its CPU build's venv) and SGLang 0.5.23's
detokenizer encoder (the released wheel, imported on CPU); both decode to the array they encoded,
and our encoders (the embedded engine's answers) write the same bytes as theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the wheel helpers

ROUTING = np.random.default_rng(0).integers(0, 128, size=(7, 3, 8))  # 7 tokens, 3 layers, top 8 of 128

_ENCODE = r'''
import json, sys
import numpy as np
from vllm.utils.serial_utils import numpy2base64
req = json.loads(sys.stdin.read())
print(json.dumps([numpy2base64(np.array(req["routing"], dtype=d)) for d in req["dtypes"]]))
'''


@pytest.mark.slow  # vLLM's interpreter in a subprocess
def test_vllm_encoding_decodes_to_the_routing():
    import real_vllm as rv

    from areal_fast.rollout.routed_experts import from_vllm, to_vllm

    try:
        python = rv.vllm_python()
    except rv.VLLMUnavailable as e:
        rv.skip_or_fail(str(e))
    dtypes = ["uint8", "uint16", "int32"]  # the dtypes vLLM's answer field documents
    r = subprocess.run([str(python), "-c", _ENCODE], input=json.dumps({"routing": ROUTING.tolist(), "dtypes": dtypes}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    fields = json.loads(r.stdout.strip().splitlines()[-1])
    for field in fields:
        got = from_vllm(field)
        assert got.dtype == np.int16 and np.array_equal(got, ROUTING)
    # ours: uint8 up to 256 experts, uint16 above (vLLM's capturer), byte for byte vLLM's encoding
    assert to_vllm(ROUTING, num_experts=128) == fields[0] and to_vllm(ROUTING, num_experts=257) == fields[1]
    assert from_vllm(None) is None


def test_sglang_encoding_decodes_to_the_routing():
    import torch
    from sglang_wheel import sglang_module

    from areal_fast.rollout.routed_experts import from_sglang, to_sglang

    detok = sglang_module("0.5.23", "sglang.srt.managers.detokenizer_manager")
    (field,) = detok.DetokenizerManager._b64_encode_per_request([torch.tensor(ROUTING, dtype=torch.int32)])
    assert to_sglang(ROUTING) == field  # the engine's answer: SGLang's bytes
    got = from_sglang(field, num_layers=3, top_k=8)
    assert got.dtype == np.int16 and np.array_equal(got, ROUTING)
    with pytest.raises(ValueError, match="not whole tokens"):
        from_sglang(field, num_layers=5, top_k=8)
    assert from_sglang(None, 3, 8) is None
