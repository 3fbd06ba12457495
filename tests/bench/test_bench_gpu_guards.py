"""What keeps the GPU benchmarks from failing for reasons of their own: the eager reference's memory
estimate in bench/bench_ppo_loss.py is at least what its autograd graph holds live at once (counted
tensor by tensor on CPU) and large enough that the reference is not started at 32k x 151,936 on a
141 GB card, where it cannot fit; bench/bench_trainer.py destroys the process group its actor made,
so the group's teardown at interpreter exit cannot abort a finished run."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from areal_fast.ops import decoupled_ppo_loss_ref
from bench import bench_ppo_loss


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that operators return, each storage counted once,
    until it is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int, n: int) -> None:
        if self.live.pop(key, None) is not None:
            self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._freed, key, st.nbytes())
        return out


def test_the_eager_estimate_covers_what_its_graph_holds_live():
    T, V = 256, 2048
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(T, V, generator=g) * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (T,), generator=g)
    b, p, A, m = bench_ppo_loss.realistic_batch(z, y, g, logp=torch.zeros(T))  # the bench's batch, no log-probs
    step = bench_ppo_loss.loss_step(decoupled_ppo_loss_ref, z, y, b, p, A, m)  # what the bench times
    step()
    counted = _LiveBytes()
    with counted:
        grad = step()
    assert grad.shape == (T, V) and counted.peak >= 20 * T * V, counted.peak / (T * V)  # the graph was seen
    need = bench_ppo_loss.logits_extra_bytes(T, V)["eager"]
    # the CUDA allocator adds its blocks and fragmentation to the live bytes: room for a third more
    assert need >= 1.3 * counted.peak, (need / (T * V), counted.peak / (T * V))


def test_the_eager_reference_is_not_started_where_it_cannot_fit():
    gib = 2**30
    h200_free = 130 * gib  # a 141 GB card with the 32k logits and the other variants' inputs on it
    at_32k = bench_ppo_loss.logits_extra_bytes(32768, 151936)["eager"]
    ok, why = bench_ppo_loss.fits(at_32k, free=h200_free)
    assert not ok and why.startswith("skipped: needs ~148.4 GiB"), why
    assert bench_ppo_loss.fits(bench_ppo_loss.logits_extra_bytes(16384, 151936)["eager"], free=h200_free)[0]


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "raises"])
def test_the_trainer_bench_destroys_the_group_its_actor_made(monkeypatch, fails, request):
    if dist.is_initialized():  # another test of this worker left its group: the check runs in a fresh process
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", request.node.nodeid],
                           cwd=request.config.rootpath, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
        return
    from areal_fast.trainer.model import init_process_group_if_needed
    from bench import bench_trainer

    made = []

    def variant(cls, cfg, batches, steps):  # the actor's part: it makes the one-rank group
        init_process_group_if_needed(torch.device("cpu"))
        made.append(dist.is_initialized())
        if fails:
            raise RuntimeError("the variant failed")
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(bench_trainer, "run_variant", variant)
    try:
        if fails:
            with pytest.raises(RuntimeError, match="the variant failed"):
                bench_trainer.main(["--shape", "tiny", "--steps", "1", "--variants", "fused", "--no-results"])
        else:
            bench_trainer.main(["--shape", "tiny", "--steps", "1", "--variants", "fused", "--no-results"])
        assert made == [True] and not dist.is_initialized(), "the bench left its process group to interpreter exit"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
