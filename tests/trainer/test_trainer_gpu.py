"""On a CUDA device (skipped without one, saying so): the varlen attention kernels against the
per-sequence reference, forward and gradients, with grouped-query heads handed to the kernel
unrepeated where it takes them; and one whole trainer step (pack, forward, loss, backward, AdamW)
of a tiny Qwen2 on the GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerances import (
    BF16_ATTN_GRAD_TOL,
    BF16_ATTN_OUT_TOL,
    BF16_TRAINER_LOGPROB_ATOL,
    FP32_CUDA_TRAINER_LOGPROB_ATOL,
)

from areal_fast.trainer import attention
from areal_fast.trainer.attention import varlen_attention_ref

TESTS = Path(__file__).resolve().parents[1]


def _packed(lens, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize("hkv", [8, 2])
def test_varlen_attention_on_cuda_matches_the_reference(impl, hkv, monkeypatch):
    if impl == "flash_attn" and not attention._has_flash_attn():
        pytest.skip("flash-attn is not installed")
    if impl == "torch_varlen" and not attention._has_torch_varlen():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    lens, hq, d, scale = [37, 1, 130, 64, 5], 8, 64, 0.125
    q, k, v, cu = _packed(lens, hq, hkv, d)
    # reference: fp32 per-sequence SDPA on the bf16-rounded inputs
    ref_in = [t.to(torch.bfloat16).float().requires_grad_() for t in (q, k, v)]
    want = varlen_attention_ref(*ref_in, cu, scale)
    want_grads = torch.autograd.grad(want.square().sum(), ref_in)

    dev_in = [t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v)]
    cu_d = cu.cuda()
    monkeypatch.setitem(attention._selected, "impl", impl)
    native = True  # flash-attn takes Hkv < Hq; torch's varlen_attn unless it routes this device to cuDNN
    if impl == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        native = attention.varlen_gqa_native(varlen_attn, torch.device("cuda", torch.cuda.current_device()))
    if native:
        def refuse(*a, **kw):
            raise AssertionError("K/V repeated to the query heads")

        monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    qb, kb, vb = (t.transpose(0, 1)[None] for t in dev_in)  # transformers' [1, H, T, D]
    out, _ = attention.varlen_attention_forward(None, qb, kb, vb, None, scaling=scale, cu_seq_lens_q=cu_d,
                                                cu_seq_lens_k=cu_d, max_length_q=max(lens), max_length_k=max(lens))
    out = out[0]
    got_grads = torch.autograd.grad(out.float().square().sum(), dev_in)
    monkeypatch.undo()
    torch.testing.assert_close(out.float().cpu(), want.detach(), **BF16_ATTN_OUT_TOL)
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.float().cpu(), b, **BF16_ATTN_GRAD_TOL, msg=f"d{name}")


_STEP = r"""
import functools, json, math, sys
import torch
param_dtype, attn_impl = sys.argv[2:4]
sys.path[:0] = sys.argv[4:]
from test_trainer_actor import hf_logprobs, make_batch, make_tiny_model
from areal_fast.trainer import OptimConfig, PPOActor, PPOConfig, TrainerConfig, attention
from areal_fast.trainer.model import shutdown_process_group

kernels, compute = set(), set()

def counting(name, fn, record):
    @functools.wraps(fn)  # its signature stays readable (the torch varlen call inspects it)
    def run(*a, **kw):
        record(name, a)
        return fn(*a, **kw)
    return run

# the dtype each attention layer computed in, and the kernels that ran (wrapped where each lives)
attention.varlen_kernel = counting("", attention.varlen_kernel, lambda _, a: compute.add(str(a[0].dtype)))
attention.varlen_attention_bucketed = counting("sdpa_loop", attention.varlen_attention_bucketed,
                                               lambda n, a: kernels.add(n))
try:
    import torch.nn.attention.varlen as tv
    tv.varlen_attn = counting("torch_varlen", tv.varlen_attn, lambda n, a: kernels.add(n))
except ImportError:
    pass
try:
    import flash_attn
    flash_attn.flash_attn_varlen_func = counting("flash_attn", flash_attn.flash_attn_varlen_func,
                                                 lambda n, a: kernels.add(n))
except ImportError:
    pass
try:
    model = make_tiny_model(sys.argv[1]).eval()
    actor = PPOActor(TrainerConfig(model_path=sys.argv[1], device="cuda", ppo=PPOConfig(prox_mode="none"),
                                   optim=OptimConfig(lr=3e-3), param_dtype=param_dtype, attn_impl=attn_impl))
    batch = make_batch(8, seed=1)
    for s in batch:  # on-policy behaviour log-probs: the ratio starts at 1
        s.output_logprobs = hf_logprobs(model, s).tolist()
    recomputed = actor.compute_logprobs(batch)
    err = max(float((lp.float().cpu() - torch.tensor(s.output_logprobs)).abs().max())
              for lp, s in zip(recomputed, batch))
    before = {n: t.detach().float().cpu().clone() for n, t in actor.iter_full_params()}
    m = actor.train_batch(batch)
    after = {n: t.detach().float().cpu() for n, t in actor.iter_full_params()}
    moved = sum(not torch.equal(before[n], after[n]) for n in before)
    print("RESULT " + json.dumps({"loss": m["loss"], "grad_norm": m["grad_norm"], "moved": moved, "n": len(before),
                                  "logprob_err": err, "version": actor.version,
                                  "kernels": sorted(kernels), "compute": sorted(compute),
                                  "device": str(next(actor.model.parameters()).device),
                                  "peak_mib": torch.cuda.max_memory_allocated() / 2**20}), flush=True)
finally:  # the actor's NCCL group, torn down here: at interpreter exit it can abort a finished step
    shutdown_process_group()
"""


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype,attn_impl,logprob_atol", [
    ("bfloat16", "auto", BF16_TRAINER_LOGPROB_ATOL),  # against the fp32 HF model on the CPU
    ("float32", "sdpa_loop", FP32_CUDA_TRAINER_LOGPROB_ATOL),
])
def test_one_trainer_step_on_cuda(tmp_path, param_dtype, attn_impl, logprob_atol):
    """In its own process: a CUDA trainer needs an NCCL default group, and other tests of a session
    may have made a gloo one already. The process destroys its group before it exits (exit status 0).
    ``train.param_dtype`` and ``train.attn_impl`` reach the model: its attention computes in that dtype
    with that kernel ('auto': flash-attn's, else torch's varlen kernel, where the GPU's image has one)."""
    paths = [str(TESTS), str(TESTS / "trainer")]
    res = subprocess.run([sys.executable, "-c", _STEP, str(tmp_path / "tiny"), param_dtype, attn_impl, *paths],
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["device"].startswith("cuda")
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
    assert r["moved"] == r["n"] and r["version"] == 1, r  # every parameter took the AdamW step
    assert r["logprob_err"] < logprob_atol, r
    assert r["compute"] == [f"torch.{param_dtype}"], r
    assert r["kernels"] == [attention.resolve_impl(attn_impl, torch.device("cuda"))], r
