"""One sample record with compact per-token columns from the rollout client to the trainer: the
sample handed to the trainer is the object the client returned (its arrays with exactly the values
the client stitched, turned into the same tensors as lists were), checkpoints encode the arrays
compactly and still read the layouts and column names of older checkpoints, and strict mode gets
the oldest version only."""

from __future__ import annotations

import asyncio
import json
import random
from array import array

import pytest
import torch
from fakes import ConstantReward, ParityTok, Prompts, RecordingTrainer, VersionSync

from areal_fast.buffer import checkpoint_groups
from areal_fast.checkpoint import STATE_FILE, read_state
from areal_fast.columns import LOGPROB_ARRAY, MASK_ARRAY, TOKEN_ARRAY, decode_column, encode_column
from areal_fast.controller import Controller, ControllerSettings
from areal_fast.group import Group, legacy_fields
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
    # the names a model turn's columns had before: readable, deprecated
    with pytest.warns(DeprecationWarning, match="output_logprobs"):
        assert g.behav_logprobs is g.output_logprobs
    with pytest.warns(DeprecationWarning, match="output_versions"):
        assert g.versions is g.output_versions


def legacy_state(g: Group) -> dict:
    """``g`` as a group's dict in controller.json before the one sample record: parallel lists of
    columns per trajectory under the old names (``outputs``, ``behav_logprobs``, ``versions``,
    ``prompts``, ``loss_masks``), the per-trajectory fields as lists, arrays as they are."""
    ss = g.samples
    return {"position": g.position, "row": g.row, "admitted_version": g.admitted_version,
            "prompt_ids": g.prompt_ids, "outputs": [s.output_ids for s in ss],
            "behav_logprobs": [s.output_logprobs for s in ss], "versions": [s.output_versions for s in ss],
            "rewards": [s.reward for s in ss], "finish_reasons": [s.finish_reason for s in ss],
            "gen_seconds": g.gen_seconds, "prompts": [s.prompt_ids for s in ss],
            "loss_masks": [s.loss_mask for s in ss], "infos": [s.info for s in ss],
            "episodes_failed": g.episodes_failed, "min_versions": [s.min_model_version() for s in ss]}


def _group(pos=3, multi_turn=True) -> Group:
    """A group as the layout before the one sample record described it (``legacy_fields``)."""
    masks = [[1, 1, 0, 1], [1, 1, 1, 1]] if multi_turn else []
    return Group(**legacy_fields(dict(
        position=pos, row=pos, admitted_version=1, prompt_ids=decode_column([7, 8, 9], TOKEN_ARRAY, "p"),
        outputs=[[10, 11, 12, 13], [20, 21, 22, 152_063]],
        behav_logprobs=[[-0.1, -1e-300, 0.0, -3.0000000000000004], [-2.5, -0.5, -7.25, -0.125]],
        versions=[[2, 3, -1, 3], [4, 4, 5, 5]], rewards=[1.0, 0.0], finish_reasons=["stop", "length"],
        prompts=[[7, 8, 9], [7, 8, 9]] if multi_turn else [], loss_masks=masks)))


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
    text = json.dumps({"g": legacy_state(g)}, default=lambda a: encode_column(a))
    stored = json.loads(text)["g"]
    assert stored["outputs"][0]["__array__"] == TOKEN_ARRAY  # compact, not a list of numbers
    back = Group.from_state(stored)
    assert back == g
    lp0 = back.samples[0].output_logprobs
    assert lp0.tolist() == array(LOGPROB_ARRAY, [-0.1, -1e-300, 0.0, -3.0000000000000004]).tolist()
    # checkpoints written before the float32 columns stored float64 ('d') log-probs: read and rounded
    old = {**stored, "behav_logprobs": [encode_column(array("d", [-0.1, -2.5, 0, 0])),
                                        encode_column(array("d", [0, 0, 0, 0]))]}
    old_back = [s.output_logprobs for s in Group.from_state(old).samples]
    assert [c.typecode for c in old_back] == [LOGPROB_ARRAY] * 2
    assert old_back[0] == array(LOGPROB_ARRAY, [-0.1, -2.5, 0, 0])
    with pytest.raises(ValueError, match=r"group 3: outputs\[0\]: stored as array 'd', expected 'i'"):
        Group.from_state({**stored, "outputs": [encode_column(array("d", [1.0]))]})
    with pytest.raises(ValueError, match="prompt_ids: damaged column encoding"):
        Group.from_state({**stored, "prompt_ids": {"__array__": "i", "b64": "!!"}})
    assert decode_column({"__array__": "i", "b64": ""}, "i", "x") == array("i")


def test_a_checkpoint_with_lists_from_an_older_version_still_loads_and_resumes(tmp_path):
    """An older controller.json held the buffered groups' tokens as lists (and log-probs under the
    name ``logprobs``): it loads into arrays with the same values, and the run goes on from it."""
    client, trainer = FakeClient(as_arrays=True), RecordingTrainer(keep_seqs=True)
    ctl, _ = _controller(tmp_path, client, trainer, steps=2, ckpt=2)
    trainer.hold_until = lambda: len(ctl.buffer) >= 1  # the checkpoint after step 2 holds a finished group
    asyncio.run(ctl.run())
    ck = tmp_path / "checkpoints" / "step_00000002"
    st = read_state(ck)
    new_buffer = list(checkpoint_groups(ck, st))
    assert new_buffer, "no buffered group in the checkpoint to convert"
    old = {k: v for k, v in st.items() if k != "buffer_file"}  # as an older version wrote it: lists,
    (ck / "buffer.bin").unlink()  # in controller.json, and no min_versions
    old["buffer"] = []
    for g in new_buffer:
        d = {k: v for k, v in legacy_state(g).items() if k not in ("min_versions", "behav_logprobs")}
        d["logprobs"] = [s.output_logprobs.tolist() for s in g.samples]
        for k in ("outputs", "versions", "prompts", "loss_masks"):
            d[k] = [c.tolist() for c in d[k]]
        d["prompt_ids"] = g.prompt_ids.tolist()
        old["buffer"].append(d)
    assert "__array__" not in json.dumps(old["buffer"])
    (ck / STATE_FILE).write_text(json.dumps(old))

    trainer2 = RecordingTrainer(keep_seqs=True)
    ctl2, _ = _controller(tmp_path, client, trainer2, steps=4, ckpt=2)
    assert ctl2.restore_newest() == ck
    assert list(ctl2.buffer) == new_buffer
    assert all(type(getattr(s, c)) is array for g in ctl2.buffer for s in g.samples for c in SAMPLE_COLUMNS)
    asyncio.run(ctl2.run())
    assert ctl2.version == 4
    trained = {s.group_id for s in trainer2.samples}
    assert {g.position for g in new_buffer} <= trained  # the restored groups were trained first
    assert len(trainer2.samples) == 2 * 2 * 2


def test_a_damaged_column_makes_the_checkpoint_corrupt_and_the_previous_one_is_used(tmp_path, caplog):
    client, trainer = FakeClient(as_arrays=True), RecordingTrainer(keep_seqs=True)
    ctl, _ = _controller(tmp_path, client, trainer, steps=4, ckpt=2)
    trainer.hold_until = lambda: len(ctl.buffer) >= 1  # the checkpoint after step 4 holds a finished group
    asyncio.run(ctl.run())
    newest = tmp_path / "checkpoints" / "step_00000004"
    st = read_state(newest)  # rewritten as before buffer.bin: encoded columns in controller.json
    st["buffer"] = json.loads(json.dumps([legacy_state(g) for g in checkpoint_groups(newest, st)],
                                         default=encode_column))
    del st["buffer_file"]
    assert st["buffer"], "no buffered group in the checkpoint to damage"
    st["buffer"][0]["outputs"][0]["b64"] = "not base64!"
    (newest / STATE_FILE).write_text(json.dumps(st))
    ctl2, _ = _controller(tmp_path, client, RecordingTrainer(keep_seqs=True), steps=4, ckpt=2)
    with caplog.at_level("WARNING"):
        assert ctl2.restore_newest() == tmp_path / "checkpoints" / "step_00000002"
    assert "outputs[0]: damaged column encoding" in caplog.text and ctl2.version == 2
