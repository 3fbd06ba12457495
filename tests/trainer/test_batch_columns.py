"""The trainer's batch code on compact columns: a sample of ``array.array`` columns (the
controller's) becomes exactly the tensors the same sample as lists (or tensors, or arrays of other
typecodes) becomes, without sharing memory with the arrays, and a bad mask is refused naming the
sample."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from areal_fast.trainer.batch import as_sample, copy_column, to_seq


def _sample(p: int, g: int, seed: int, multi_turn: bool) -> dict:
    rng = random.Random(seed)
    mask = [rng.randrange(2) if multi_turn else 1 for _ in range(g)]
    return dict(prompt_ids=[rng.randrange(152_064) for _ in range(p)],
                output_ids=[rng.randrange(152_064) for _ in range(g)],
                # values a float32 rounds: the conversion must round exactly as torch.tensor(list) did
                output_logprobs=[-rng.random() * 30 - 1e-9 for _ in range(g)],
                output_versions=[rng.randrange(0, 3000) if m else -1 for m in mask],
                reward=1.0, group_id=seed, loss_mask=mask if multi_turn else None)


def _arrays(s: dict, codes=("i", "d", "i", "B")) -> dict:
    ids, lp, ver, m = codes
    out = {**s, "prompt_ids": array(ids, s["prompt_ids"]), "output_ids": array(ids, s["output_ids"]),
           "output_logprobs": array(lp, s["output_logprobs"]), "output_versions": array(ver, s["output_versions"])}
    if s["loss_mask"] is not None:
        out["loss_mask"] = array(m, s["loss_mask"])
    return out


def _tensors(s: dict) -> dict:
    out = {**s, **{k: torch.tensor(s[k]) for k in ("prompt_ids", "output_ids", "output_logprobs",
                                                     "output_versions")}}
    if s["loss_mask"] is not None:
        out["loss_mask"] = torch.tensor(s["loss_mask"])
    return out


@pytest.mark.parametrize("p,g,multi_turn", [(1, 1, False), (5, 0, False), (3, 17, False), (7, 300, True),
                                            (1, 64, True)])
def test_array_columns_give_the_same_tensors_as_lists(p, g, multi_turn):
    s = _sample(p, g, seed=p * 1000 + g, multi_turn=multi_turn)
    want = to_seq(as_sample(s))
    for variant in (_arrays(s), _arrays(s, ("q", "f", "l", "b")), _tensors(s)):
        got = to_seq(as_sample(variant))
        for f in ("input_ids", "labels", "loss_mask", "behav_logprobs", "versions"):
            a, b = getattr(want, f), getattr(got, f)
            assert a.dtype == b.dtype and torch.equal(a, b), f
        assert got.n_gen == want.n_gen


def test_tensors_do_not_share_memory_with_the_arrays():
    s = _arrays(_sample(4, 10, seed=1, multi_turn=True))
    seq = to_seq(as_sample(s))
    s["output_ids"].extend(array("i", [1] * 1000))  # raises BufferError while a tensor views the array
    s["output_logprobs"][0] = 123.0
    assert seq.behav_logprobs.max() <= 0
    x = array("d", [1.5, -2.0])
    t = copy_column(torch.empty(2, dtype=torch.float64), x)
    x[0] = 9.0
    assert t.tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="column of 2 values into a tensor of 3"):
        copy_column(torch.empty(3), x)


def test_a_mask_that_is_not_binary_is_refused_naming_the_sample():
    s = _arrays(_sample(2, 3, seed=2, multi_turn=True))
    s["loss_mask"] = array("B", [1, 2, 0])
    with pytest.raises(ValueError, match="sample 4: loss_mask entries must be 0 or 1"):
        as_sample(s, 4)
    with pytest.raises(OverflowError, match="Sample.loss_mask: expected 0/1 entries"):  # refused on entry
        as_sample({**s, "loss_mask": torch.tensor([1, 0, -1])})
    with pytest.raises(ValueError, match=r"sample 0: 3 output_ids but \{'output_logprobs': 2\}"):
        as_sample({**s, "loss_mask": None, "output_logprobs": array("d", [0.0, 0.0])})


def test_a_dict_without_a_column_is_refused_naming_it():
    """A sample dict must name every column by the record's names; a missing key is named (the
    behaviour log-probs are ``output_logprobs``, never ``behav_logprobs`` on a sample)."""
    s = _sample(3, 4, seed=3, multi_turn=False)
    old = {("behav_logprobs" if k == "output_logprobs" else k): v for k, v in s.items()}
    with pytest.raises(ValueError, match="sample 0 lacks key 'output_logprobs'"):
        as_sample(old)
    with pytest.raises(ValueError, match="sample 2 lacks key 'group_id'"):
        as_sample({k: v for k, v in s.items() if k != "group_id"}, 2)
