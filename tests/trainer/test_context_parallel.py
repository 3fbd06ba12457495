"""Context parallelism's pieces in one process: the cut of a packed micro-batch into the ranks'
shares (boundaries, positions, labels at the cuts, padding), the Ulysses all-to-all's layouts and
its attention against the whole-row reference (the ranks simulated by threads that swap buffers,
forward and backward), and the config's refusals. The two-rank runs against one rank are in
test_context_parallel_dist.py."""

from __future__ import annotations

import threading

import pytest
import torch
from tolerances import FP32_SHORT_ATTN_ATOL, FP32_SHORT_ATTN_GRAD_TOL

from areal_fast.packing import context_split
from areal_fast.trainer.attention import varlen_attention_ref
from areal_fast.trainer.batch import Seq, pack
from areal_fast.trainer.parallel import context

# ----------------------------------------------------------------------------------- the cut


def test_split_cuts_by_tokens_with_straddling_and_spanning_sequences():
    # 5 + 3 + 9 = 17 tokens on 2 ranks: shares of 9, one padding token; the cut at 9 falls inside
    # the third sequence
    c = context_split([5, 3, 9], 2)
    assert (c.share, c.padded, c.pad) == (9, 18, 1)
    assert c.cu_seqlens.tolist() == [0, 5, 8, 17, 18]  # the padding is a sequence of its own
    assert c.bounds(1) == (9, 18)
    assert c.local_cu_seqlens(0).tolist() == [0, 5, 8, 9]
    assert c.local_cu_seqlens(1).tolist() == [0, 8, 9]
    # one sequence of 10 over 4 ranks: it spans every share; shares of 3, 2 padding tokens
    c = context_split([10], 4)
    assert [c.local_cu_seqlens(r).tolist() for r in range(4)] == [[0, 3], [0, 3], [0, 3], [0, 1, 3]]
    assert c.max_seqlen == 10
    # exact multiple: no padding sequence; cp 1 is the row as it is
    assert context_split([4, 4], 2).cu_seqlens.tolist() == [0, 4, 8]
    assert context_split([3, 2], 1).local_cu_seqlens(0).tolist() == [0, 3, 5]


def test_split_refuses_bad_input():
    with pytest.raises(ValueError, match="cp must be >= 1"):
        context_split([3], 0)
    with pytest.raises(ValueError, match="at least one token"):
        context_split([3, 0], 2)
    with pytest.raises(ValueError, match="rank 2 outside"):
        context_split([3], 2).bounds(2)


def _seq(ids: list[int], n_prompt: int) -> Seq:
    t = torch.tensor(ids)
    n = len(ids) - 1
    mask = torch.arange(n) >= n_prompt - 1
    return Seq(t[:-1], t[1:], mask, torch.where(mask, -0.5, 0.0), torch.where(mask, 3, -1), int(mask.sum()))


def test_shares_concatenate_to_the_row_with_labels_right_at_the_cuts():
    seqs = [_seq(list(range(10, 17)), 3), _seq(list(range(40, 44)), 2), _seq(list(range(70, 83)), 4)]
    for s in seqs:  # routing replay's recorded rows (2 layers x top-2) travel with their tokens
        s.routing = torch.arange(len(s) * 4, dtype=torch.int16).view(len(s), 4) % 7
    p = pack([0, 1, 2], seqs, torch.tensor([1.0, -1.0, 0.5]), torch.device("cpu"), prox={0: torch.zeros(6),
             1: torch.ones(3), 2: torch.full((12,), 2.0)})
    T = p.n_tokens  # 6 + 3 + 12 = 21
    straddles = 0
    for cp in (2, 3, 4):
        cut = context.split_packed(p, cp)
        shares = [context.shard_packed(p, cut, r) for r in range(cp)]
        assert sum(s.n_tokens for s in shares) == T and {s.input_ids.numel() for s in shares} == {cut.share}
        for name in ("input_ids", "position_ids", "labels", "loss_mask", "behav_logprobs", "versions", "advantages",
                     "prox_logprobs"):
            whole = torch.cat([getattr(s, name) for s in shares])
            assert torch.equal(whole[:T], getattr(p, name)), (cp, name)
        pad = torch.cat([s.loss_mask for s in shares])[T:]
        assert pad.numel() == cut.pad and not pad.any()  # padding is out of the loss
        rows = torch.cat([s.routing for s in shares])
        assert torch.equal(rows[:T], p.routing) and bool((rows[T:] == -1).all())  # padding: nothing recorded
        for r, s in enumerate(shares):
            assert torch.equal(s.attn_cu_seqlens, torch.tensor(cut.cu_seqlens, dtype=torch.int32))
            assert int(s.cu_seqlens[-1]) == cut.share and s.model_args()[2] is s.attn_cu_seqlens
            # a cut inside a sequence: the last label of this share is the next share's first input,
            # the positions go on counting
            if r + 1 < cp:
                nxt = shares[r + 1]
                if int(nxt.position_ids[0]) > 0 and r * cut.share + cut.share < T:
                    assert int(s.labels[-1]) == int(nxt.input_ids[0])
                    assert int(nxt.position_ids[0]) == int(s.position_ids[-1]) + 1
                    straddles += 1
    assert straddles >= 4    # the 12-token sequence is longer than a share of 4 ranks (6 tokens): it spans three shares
    cut = context.split_packed(p, 4)
    assert cut.share == 6 and [context.shard_packed(p, cut, r).cu_seqlens.tolist() for r in range(4)] == \
        [[0, 6], [0, 3, 6], [0, 6], [0, 3, 6]]


# ----------------------------------------------------------------------------------- Ulysses


class SimGroup:
    """``cp`` threads as the ranks of one group: ``exchange`` swaps their buffers as all_to_all_single."""

    def __init__(self, n: int):
        self.n, self.bar, self.slots, self.local = n, threading.Barrier(n, timeout=60), [None] * n, threading.local()

    def size(self) -> int:
        return self.n

    def exchange(self, buf: torch.Tensor, group) -> torch.Tensor:
        me = self.local.rank
        self.slots[me] = buf
        self.bar.wait()
        out = torch.stack([self.slots[i][me] for i in range(self.n)])
        self.bar.wait()  # every rank has read its chunks before any overwrites its slot
        return out

    def run(self, fn) -> list:
        """``fn(rank)`` on every simulated rank at once; their results."""
        res, errs = [None] * self.n, []

        def body(r):
            self.local.rank = r
            try:
                res[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errs.append(e)
                self.bar.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errs:
            raise errs[0]
        return res


@pytest.fixture
def sim(monkeypatch):
    def make(n):
        g = SimGroup(n)
        monkeypatch.setitem(context._exchange, "fn", g.exchange)
        return g
    return make


def test_all_to_all_layouts_against_slicing(sim):
    T, H, D, cp = 12, 4, 3, 2
    x = torch.randn(T, H, D)
    g = sim(cp)
    heads = g.run(lambda r: context._all_to_all(x[r * 6:(r + 1) * 6], g, True))
    for r in range(cp):  # rank r: every token of heads r*H/cp ..
        assert torch.equal(heads[r], x[:, r * 2:(r + 1) * 2])
    back = g.run(lambda r: context._all_to_all(heads[r], g, False))
    assert torch.equal(torch.cat(back), x)
    # the backward of one direction is the other: it is the adjoint (<A x, y> = <x, A^T y>)
    y = [torch.randn(T, 2, D) for _ in range(cp)]
    yt = g.run(lambda r: context._all_to_all(y[r], g, False))
    lhs = sum(float((heads[r] * y[r]).sum()) for r in range(cp))
    rhs = sum(float((x[r * 6:(r + 1) * 6] * yt[r]).sum()) for r in range(cp))
    assert lhs == pytest.approx(rhs, rel=0, abs=FP32_SHORT_ATTN_ATOL)


@pytest.mark.parametrize("cp,hq,hkv", [(2, 4, 2), (2, 2, 1), (4, 8, 2)])  # kv split, kv repeated 2x, 2x
def test_ulysses_attention_and_gradients_equal_the_whole_row(sim, cp, hq, hkv):
    g = torch.Generator().manual_seed(cp * 10 + hq)
    lengths = [5, 11, 3, 9]  # 28 tokens: cuts inside sequences; the 11-token one is longer than a share of 4 ranks
    cut = context_split(lengths, cp)
    T, Tp, D = cut.tokens, cut.padded, 4
    q, k, v = (torch.randn(Tp, h, D, generator=g) for h in (hq, hkv, hkv))
    go = torch.randn(Tp, hq, D, generator=g)
    cu = torch.tensor(cut.cu_seqlens, dtype=torch.int32)

    def kernel(a, b, c):
        return varlen_attention_ref(a, b, c, cu, D ** -0.5)

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = kernel(*ref_in)
    (ref * go).sum().backward()
    grp = sim(cp)

    def rank(r):
        lo, hi = cut.bounds(r)
        mine = [t[lo:hi].clone().requires_grad_() for t in (q, k, v)]
        out = context.ulysses_attention(*mine, kernel, grp)
        (out * go[lo:hi]).sum().backward()
        return out.detach(), [t.grad for t in mine]

    res = grp.run(rank)
    torch.testing.assert_close(torch.cat([o for o, _ in res])[:T], ref.detach()[:T], rtol=0, atol=FP32_SHORT_ATTN_ATOL)
    for i in range(3):
        torch.testing.assert_close(torch.cat([gr[i] for _, gr in res])[:T], ref_in[i].grad[:T],
                                   **FP32_SHORT_ATTN_GRAD_TOL)


def test_kv_repeat_and_its_refusals():
    assert context.kv_repeat(32, 4, 8) == 2  # Qwen3-30B-A3B at cp 8: 4 KV heads become 8
    assert context.kv_repeat(28, 4, 4) == 1 and context.kv_repeat(2, 1, 2) == 2
    with pytest.raises(ValueError, match="does not divide the 6 attention heads"):
        context.kv_repeat(6, 2, 4)


def test_world_of_one_is_the_plain_path():
    class One:
        def size(self):
            return 1

    with context.ulysses(One()):
        assert context.active_group() is None
    assert context.active_group() is None


def test_attention_refuses_a_share_without_the_whole_rows_boundaries(sim):
    from areal_fast.trainer.attention import varlen_attention_forward

    grp = sim(2)
    q = torch.randn(1, 2, 4, 8)
    with context.ulysses(grp), pytest.raises(RuntimeError, match="whole padded row"):
        varlen_attention_forward(None, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32))


# ----------------------------------------------------------------------------------- config


def test_config_refuses_whole_sequence_loss_options_under_cp_and_head_counts_cp_does_not_divide():
    from areal_fast.ops import PPOLossConfig
    from areal_fast.trainer.config import ParallelConfig, PPOConfig, TrainerConfig, check_parallel_model

    TrainerConfig(world_size=2, parallel=ParallelConfig(cp=2))  # token-level defaults: fine
    for opt, name in ((dict(loss_agg="seq-mean-token-mean"), "loss_agg"), (dict(importance_level="sequence"),
                      "importance_level"), (dict(seq_mis_upper=2.0), "seq_mis"), (dict(m2po_tau=0.1), "m2po_tau")):
        with pytest.raises(ValueError, match=f"train.parallel.cp: 2 with train.ppo.loss.{name}"):
            TrainerConfig(world_size=2, parallel=ParallelConfig(cp=2), ppo=PPOConfig(loss=PPOLossConfig(**opt)))
        TrainerConfig(world_size=2, ppo=PPOConfig(loss=PPOLossConfig(**opt)))  # without CP: allowed
    check_parallel_model(ParallelConfig(cp=2), num_experts=None, num_heads=2, where="m")
    with pytest.raises(ValueError, match="does not divide the 3 attention heads"):
        check_parallel_model(ParallelConfig(cp=2), num_experts=None, num_heads=3, where="m")


# ----------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 8)])
def test_ulysses_path_runs_on_cuda_with_one_rank(hq, hkv):
    """The all-to-all on NCCL (a group of one rank) around the CUDA kernel the trainer selects, forward
    and backward, against that kernel without it: the exchange is the identity there."""
    import torch.distributed as dist
    from tolerances import BF16_ATTN_GRAD_TOL, BF16_ATTN_OUT_TOL

    from areal_fast.trainer.attention import varlen_kernel
    from areal_fast.trainer.model import init_process_group_if_needed

    dev = torch.device("cuda", torch.cuda.current_device())
    init_process_group_if_needed(dev)
    group = dist.new_group([0], backend="nccl")
    cut = context_split([37, 130, 5], 1)
    cu = torch.tensor(cut.cu_seqlens, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(1)
    ins = [torch.randn(cut.padded, h, 64, generator=g).to(dev, torch.bfloat16) for h in (hq, hkv, hkv)]

    def kernel(a, b, c):
        return varlen_kernel(a, b, c, cu, cu, cut.max_seqlen, cut.max_seqlen, 0.125)

    outs, grads = [], []
    for through in (False, True):
        x = [t.clone().requires_grad_() for t in ins]
        out = context.ulysses_attention(*x, kernel, group) if through else kernel(*x)
        out.float().square().sum().backward()
        outs.append(out.detach().float())
        grads.append([t.grad.float() for t in x])
    torch.testing.assert_close(outs[1], outs[0], **BF16_ATTN_OUT_TOL)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, **BF16_ATTN_GRAD_TOL)
    dist.destroy_process_group(group)
