"""The compact columns of a Trajectory: what a workflow author gives is converted on entry (named
when it does not fit), the fields read like lists, the oldest model-token version is kept as
turns are added and recomputed after a direct assignment, and the column helpers are exact."""

from __future__ import annotations

import copy
import pickle
import random
from array import array

import pytest
import torch

from areal_fast.columns import (
    LOGPROB_ARRAY,
    MASK_ARRAY,
    TOKEN_ARRAY,
    column,
    encode_column,
    is_binary_mask,
    min_model_version,
)
from areal_fast.sample import Sample
from areal_fast.workflow import Trajectory


def _turn(ids, version, lp=-0.5):
    return Sample(prompt_ids=[1], output_ids=list(ids), output_logprobs=[lp] * len(ids),
                  output_versions=[version] * len(ids), finish_reason="stop")


def test_lists_tuples_and_tensors_are_converted_on_entry_and_on_assignment():
    t = Trajectory(prompt_ids=torch.tensor([5, 6]), output_ids=(1, 2), loss_mask=[1, 0],
                   output_logprobs=[-0.5, 0], output_versions=[3, -1])
    assert [type(getattr(t, f)) for f in ("prompt_ids", "output_ids", "loss_mask", "output_logprobs",
                                          "output_versions")] == [array] * 5
    assert (t.prompt_ids.typecode, t.loss_mask.typecode, t.output_logprobs.typecode) == (
        TOKEN_ARRAY, MASK_ARRAY, LOGPROB_ARRAY)
    assert t.prompt_ids.tolist() == [5, 6] and t.output_logprobs.tolist() == [-0.5, 0.0]
    t.output_ids = [7, 8]
    assert type(t.output_ids) is array and list(t.output_ids) == [7, 8]
    ids = array(TOKEN_ARRAY, [9])
    t.prompt_ids = ids
    assert t.prompt_ids is ids  # an array of the right type is kept, not copied
    t.reward = 1.0  # other fields are untouched
    with pytest.raises(TypeError, match="Sample.output_ids: expected int32 token ids"):
        t.output_ids = [1.5]
    with pytest.raises(OverflowError, match="Sample.loss_mask"):
        Trajectory(prompt_ids=[1], loss_mask=[-1])
    with pytest.raises(TypeError, match="Sample.prompt_ids: expected a sequence of numbers, got bytes"):
        Trajectory(prompt_ids=b"\x01\x00\x00\x00")
    with pytest.raises(TypeError):  # documented: arrays extend only with arrays (use add_context)
        t.output_ids += [3]
    t2 = Trajectory(prompt_ids=[1], output_ids=[3], loss_mask=[2], output_logprobs=[0.0], output_versions=[0])
    with pytest.raises(ValueError, match="w: loss_mask entries must be 0 or 1"):
        t2.check("w")


def test_turns_append_exactly_and_the_oldest_version_is_kept_as_they_come():
    t = Trajectory(prompt_ids=[1, 2])
    t.add_model(_turn([10, 11], 4, lp=-0.1))
    t.add_context([20, 21, 22])
    t.add_model(Sample(prompt_ids=[1], output_ids=array(TOKEN_ARRAY, [12]),
                       output_logprobs=array(LOGPROB_ARRAY, [-1e-300]), output_versions=array(TOKEN_ARRAY, [2]),
                       finish_reason="length"))
    assert t.output_ids.tolist() == [10, 11, 20, 21, 22, 12]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert t.output_logprobs == array(LOGPROB_ARRAY, [-0.1, -0.1, 0.0, 0.0, 0.0, -1e-300])  # float32
    assert t.output_versions.tolist() == [4, 4, -1, -1, -1, 2]
    assert t.context_ids.tolist() == [1, 2, 10, 11, 20, 21, 22, 12] and type(t.context_ids) is array
    assert (t.n_model_tokens, t.n_turns, t.min_model_version(), t.finish_reason) == (3, 2, 2, "length")
    assert t.model_versions() == [4, 4, 2]
    t.check("w")
    # assigning a column directly: the minimum is recomputed from the fields
    t.output_versions = [7, 7, -1, -1, -1, 9]
    assert t.min_model_version() == 7
    t.loss_mask = [0, 1, 0, 0, 0, 1]
    assert t.min_model_version() == 7 and t.n_turns == 2
    t.loss_mask = [1, 1, 0, 0, 0, 0]
    assert t.n_turns == 1 and t.min_model_version() == 7
    for c in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert c == t and c.min_model_version() == 7
        c.add_model(_turn([1], 0))
        assert c.min_model_version() == 0 and t.min_model_version() == 7
    assert Trajectory(prompt_ids=[1]).min_model_version() is None
    with pytest.raises(ValueError, match="model turn: 2 tokens but 1 log-probs and 2 versions"):
        t.add_model(Sample(prompt_ids=[1], output_ids=[1, 2], output_logprobs=[0.0], output_versions=[0, 0]))


def test_column_helpers():
    a = array(TOKEN_ARRAY, [1, 2])
    assert column(a, TOKEN_ARRAY, "x") is a
    assert column(a, LOGPROB_ARRAY, "x").tolist() == [1.0, 2.0]
    assert is_binary_mask(array(MASK_ARRAY, [0, 1, 1])) and not is_binary_mask(array(MASK_ARRAY, [0, 2]))
    assert is_binary_mask([0, 1]) and not is_binary_mask([1, 3])
    assert min_model_version(array(TOKEN_ARRAY)) is None
    assert min_model_version(array(TOKEN_ARRAY, [5, 3, 4])) == 3
    assert min_model_version(array(TOKEN_ARRAY, [5, -1, 4])) == 4  # -1: context or unordered version
    assert min_model_version(array(TOKEN_ARRAY, [5, 1, 4]), array(MASK_ARRAY, [1, 0, 1])) == 4
    assert min_model_version(array(TOKEN_ARRAY, [-1, -1]), array(MASK_ARRAY, [0, 0])) is None
    assert encode_column(array(TOKEN_ARRAY, [1])) == {"__array__": TOKEN_ARRAY, "b64": "AQAAAA=="}  # little-endian


@pytest.mark.parametrize("n", [1, 5, 127, 128, 129, 4000])
def test_min_model_version_equals_the_per_token_definition(n):
    """Short columns take ``min()``, long ones numpy: both equal the definition, token by token."""
    rng = random.Random(n)
    for case in range(40):
        vers = [rng.choice([-1, rng.randrange(0, 5000)]) if case % 3 else rng.randrange(0, 5000) for _ in range(n)]
        mask = [rng.randrange(2) for _ in range(n)] if case % 2 else None
        want = min((v for i, v in enumerate(vers) if (mask is None or mask[i]) and v >= 0), default=None)
        got = min_model_version(array(TOKEN_ARRAY, vers), None if mask is None else array(MASK_ARRAY, mask))
        assert got == want and (got is None or type(got) is int), (case, got, want)
