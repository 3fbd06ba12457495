"""One sample record with compact per-token columns from the rollout client to the trainer: the
sample handed to the trainer is the object the client returned (its arrays with exactly the values
the client stitched, turned into the same tensors as lists were), checkpoints encode the arrays
compactly and still read the layouts and column names of older checkpoints, and strict mode gets
the oldest version only."""

from __future__ import annotations

import asyncio
import io
import random
from array import array

import pytest
import torch
from fakes import ConstantReward, ParityTok, Prompts, RecordingTrainer, VersionSync

from areal_fast.buffer import read_records, write_record
from areal_fast.columns import LOGPROB_ARRAY, MASK_ARRAY, TOKEN_ARRAY
from areal_fast.controller import Controller, ControllerSettings
from areal_fast.group import Group, group_of
from areal_fast.rollout.port import ClientRollout
from areal_fast.rollout.staleness import StalenessManager
from areal_fast.sample import Sample
from areal_fast.trainer.batch import as_sample

SAMPLE_COLUMNS = {"prompt_ids": TOKEN_ARRAY, "output_ids": TOKEN_ARRAY, "output_logprobs": LOGPROB_ARRAY,
                  "output_versions": TOKEN_ARRAY, "loss_mask": MASK_ARRAY}


class FakeClient:
    """What the controller's rollout adapter needs of ``RolloutClient``: ``generate`` answering a
    ``Sample`` (built from lists, or from arrays as the client does), with awkward log-probs (values
    a float32 cannot hold exactly) and each token's version read from ``version``. ``returned`` keeps
    every result so a test can compare what reached the trainer with what the client gave."""

    def __init__(self, as_arrays: bool, seed: int = 0):
        self.as_arrays, self.rng = as_arrays, random.Random(seed)
        self.version = 0
        self.running = asyncio.Event()
        self.running.set()
        self.returned: dict[str, Sample] = {}
        self.servers = []

    async def generate(self, input_ids, sampling, rid):
        ids, lps, vers = [], [], []
        for _ in range(self.rng.randrange(1, 12)):
            await self.running.wait()
            await asyncio.sleep(0)
            ids.append(self.rng.randrange(0, 152_000))
            lps.append(-self.rng.random() * 20 - 1e-9 * self.rng.random())
            vers.append(self.version)
        if self.as_arrays:
            ids, lps, vers = array(TOKEN_ARRAY, ids), array(LOGPROB_ARRAY, lps), array(TOKEN_ARRAY, vers)
        r = Sample(prompt_ids=input_ids, output_ids=ids, output_logprobs=lps, output_versions=vers,
                   finish_reason="stop", rid=rid)
        self.returned[rid] = r
        return r

    async def pause_all(self):
        self.running.clear()

    async def continue_all(self):
        self.running.set()


class RecordingGate(StalenessManager):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.consumed_args: list[list[int]] = []

    def check_consumed(self, token_versions):
        self.consumed_args.append(list(token_versions))
        return super().check_consumed(token_versions)


def _controller(tmp_path, client, trainer, *, steps=3, ckpt=0, strict=False):
    s = ControllerSettings(batch_size=2, group_size=2, total_steps=steps, sampling={"max_new_tokens": 16},
                           eval_sampling={}, eval_every=0, eval_at_start=False, checkpoint_every=ckpt,
                           output_dir=tmp_path)
    gate = RecordingGate(2, 1, max_concurrent=8, strict=strict)
    return Controller(s, Prompts(), ParityTok(), ClientRollout(client), ConstantReward(), trainer,
                      VersionSync(client), gate), gate


@pytest.mark.parametrize("as_arrays", [False, True], ids=["client-lists", "client-arrays"])
def test_the_trainer_gets_compact_arrays_equal_to_what_the_client_returned(tmp_path, as_arrays):
    client, trainer = FakeClient(as_arrays), RecordingTrainer(keep_seqs=True)
    ctl, gate = _controller(tmp_path, client, trainer, strict=True)
    asyncio.run(ctl.run())
    assert len(trainer.samples) == 3 * 2 * 2
    for s, q in zip(trainer.samples, trainer.seqs):
        for name, code in SAMPLE_COLUMNS.items():
            assert type(getattr(s, name)) is array and getattr(s, name).typecode == code, name
        pos = s.group_id
        r = client.returned[s.rid]
        assert s.rid.split("-")[1] == str(pos)
        assert s.prompt_ids.tolist() == ParityTok().encode(f"p{pos}")
        assert s.output_logprobs == array(LOGPROB_ARRAY, r.output_logprobs)  # bit for bit, as float32
        assert s.output_versions.tolist() == list(r.output_versions)
        assert s.loss_mask.tolist() == [1] * len(r.output_ids)
        # the trainer's tensors equal those the former list path built (torch.tensor of lists)
        prompt = s.prompt_ids.tolist()
        p = len(prompt)
        assert torch.equal(q.input_ids, torch.tensor(prompt + list(r.output_ids))[:-1])
        assert torch.equal(q.labels[p - 1:], torch.tensor(list(r.output_ids)))
        assert torch.equal(q.behav_logprobs[p - 1:], torch.tensor(list(r.output_logprobs), dtype=torch.float32))
        assert torch.equal(q.versions[p - 1:], torch.tensor(list(r.output_versions)))
        assert q.loss_mask[p - 1:].all() and not q.loss_mask[: p - 1].any()
    # strict mode sees one number per group (its oldest model token), not every token's version
    assert gate.consumed_args and all(len(a) == 1 for a in gate.consumed_args)


def test_the_sample_the_client_made_is_the_one_the_trainer_gets(tmp_path):
    """One record from client to trainer: every sample the trainer is handed is the very object the
    client's ``generate`` returned (through the rollout port, the default workflow, the group, the
    buffer), with the client's own column arrays, and the trainer's check takes it as it is. Before
    the one record, the port, the workflow and the group each built a new record (fails here)."""
    client, trainer = FakeClient(as_arrays=True), RecordingTrainer(keep_seqs=True)
    columns_of = {}
    real_generate = client.generate

    async def generate(input_ids, sampling, rid):
        r = await real_generate(input_ids, sampling, rid)
        columns_of[rid] = [getattr(r, name) for name in SAMPLE_COLUMNS]
        return r

    client.generate = generate
    ctl, _ = _controller(tmp_path, client, trainer, steps=2)
    asyncio.run(ctl.run())
    assert len(trainer.samples) == 2 * 2 * 2
    for s in trainer.samples:
        assert s is client.returned[s.rid]  # the same object: no record was built on the way
        assert all(a is b for a, b in zip((getattr(s, n) for n in SAMPLE_COLUMNS), columns_of[s.rid]))
        assert as_sample(s) is s and s.group_id == int(s.rid.split("-")[1])


def test_a_sample_converts_lists_and_keeps_arrays_without_a_copy():
    ids = array(TOKEN_ARRAY, [5, 6])
    g = Sample(prompt_ids=[1], output_ids=ids, output_logprobs=[-0.5, -0.25], output_versions=[0, 1])
    assert g.output_ids is ids
    assert (g.output_logprobs.typecode, g.output_versions.typecode) == (LOGPROB_ARRAY, TOKEN_ARRAY)
    assert g.output_logprobs.tolist() == [-0.5, -0.25] and g.output_versions.tolist() == [0, 1]
    assert g.loss_mask.tolist() == [1, 1]  # no mask given: every output token is the model's
    with pytest.raises(TypeError, match="Sample.output_ids"):
        Sample(prompt_ids=[1], output_ids=[1.5], output_logprobs=[0.0], output_versions=[0])
    with pytest.raises(OverflowError, match="Sample.output_versions"):
        Sample(prompt_ids=[1], output_ids=[1], output_logprobs=[0.0], output_versions=[2**40])
    assert not hasattr(g, "behav_logprobs") and not hasattr(g, "versions")  # one name per column


def _group(pos=3, multi_turn=True) -> Group:
    """A group of two samples (multi-turn: tool text masked out of the loss)."""
    masks = [[1, 1, 0, 1], [1, 1, 1, 1]] if multi_turn else [None, None]
    outputs = [[10, 11, 12, 13], [20, 21, 22, 152_063]]
    lps = [[-0.1, -1e-300, 0.0, -3.0000000000000004], [-2.5, -0.5, -7.25, -0.125]]
    versions = [[2, 3, -1, 3], [4, 4, 5, 5]]
    samples = [Sample(prompt_ids=[7, 8, 9], output_ids=o, output_logprobs=lp, output_versions=v, reward=r,
                      finish_reason=f, **({"loss_mask": m} if m else {}))
               for o, lp, v, r, f, m in zip(outputs, lps, versions, [1.0, 0.0], ["stop", "length"], masks)]
    return group_of(pos, pos, 1, samples)


def _round_trip(g: Group) -> Group:
    """``g`` written as a buffer record (what a checkpoint's buffer.bin holds) and read back."""
    f = io.BytesIO()
    write_record(f, g)
    f.seek(0)
    return Group(**next(read_records(f, 1, "buffer.bin")))


def test_group_columns_min_version_and_checkpoint_round_trip():
    g = _group()
    assert all(type(getattr(s, c)) is array for s in g.samples for c in SAMPLE_COLUMNS)
    assert [s.group_id for s in g.samples] == [3, 3]
    assert g.min_model_version() == 2 and g.min_version() == 2 and g.model_token_counts() == [3, 4]
    assert _group(multi_turn=False).model_token_counts() == [4, 4]  # no masks: every token the model's
    versionless = _group(multi_turn=False)
    for s in versionless.samples:
        s.output_versions = [-1] * 4
    assert versionless.min_model_version() is None and versionless.min_version() == 1
    back = _round_trip(g)
    assert back == g
    lp0 = back.samples[0].output_logprobs
    assert lp0.tolist() == array(LOGPROB_ARRAY, [-0.1, -1e-300, 0.0, -3.0000000000000004]).tolist()
