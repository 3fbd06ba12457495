"""Routing replay through the one sample record: ``Sample.routed_experts`` (the servers' routing of
every forwarded position), kept across model turns, spilled in buffer records, stitched by the
client from the servers' answers, packed by the trainer and replayed in the actor's forwards when
``train.ppo.routing_replay`` is on (``docs/moe.md``)."""

from __future__ import annotations

import base64
import io
from array import array

import numpy as np
import pytest
import torch
from tolerances import FP32_MOE_LOGPROB_ATOL

from areal_fast.sample import Sample

WIDTH = 4  # 2 sparse blocks x top 2: the tiny Qwen3-MoE's record


def _rows(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 4, size=n * WIDTH).tolist()


# ----------------------------------------------------------------------------- the column


def test_the_column_is_whole_rows_of_the_forwarded_positions():
    s = Sample(prompt_ids=[1, 2, 3], output_ids=[4, 5], routed_experts=_rows(4))
    assert s.routing_width() == WIDTH and s.routed_experts.typecode == "h"
    assert Sample(prompt_ids=[1, 2], output_ids=[3]).routing_width() == 0  # no routing: an empty column
    bad = Sample(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-1.0, -1.0], output_versions=[0, 0],
                 routed_experts=_rows(4)[:-1])
    with pytest.raises(ValueError, match="sample 7: routed_experts: 15 ids are not whole rows of the 4"):
        bad.check("sample 7")
    with pytest.raises(OverflowError, match="routed_experts"):
        Sample(prompt_ids=[1], output_ids=[2], routed_experts=[40000] * WIDTH)


def test_model_turns_keep_their_own_rows_and_context_is_unrecorded_until_forwarded():
    """A multi-turn sample: the first turn's rows are kept, the spliced context's positions take the
    next turn's rows (its prefill forwarded them first), positions recorded nowhere stay -1."""
    traj = Sample(prompt_ids=[1, 2, 3])
    first = Sample(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.1, -0.2], output_versions=[0, 0],
                   routed_experts=_rows(4, seed=1))
    traj.add_model(first)
    assert list(traj.routed_experts) == list(first.routed_experts)
    traj.add_context([6, 7])
    assert list(traj.routed_experts[4 * WIDTH:]) == [-1] * (2 * WIDTH)  # 2 more forwarded positions, unrecorded
    second = Sample(prompt_ids=[1, 2, 3, 4, 5, 6, 7], output_ids=[8], output_logprobs=[-0.3], output_versions=[1],
                    routed_experts=_rows(7, seed=2))
    traj.add_model(second)
    got = np.array(traj.routed_experts).reshape(-1, WIDTH)
    want = np.array(second.routed_experts).reshape(-1, WIDTH)
    assert got.shape == (7, WIDTH)
    assert (got[:4] == np.array(first.routed_experts).reshape(-1, WIDTH)).all()  # the first turn's own rows
    assert (got[4:] == want[4:]).all()  # the context and the new positions: the second turn's
    traj.add_model(Sample(prompt_ids=list(traj.context_ids), output_ids=[9], output_logprobs=[-0.1],
                          output_versions=[2]))  # a turn without routing: its positions unrecorded
    assert traj.routing_width() == WIDTH and list(traj.routed_experts[-WIDTH:]) == [-1] * WIDTH


def test_buffer_records_carry_the_column_and_older_records_read_as_empty():
    from areal_fast.buffer import decode_record, write_record
    from areal_fast.group import Group

    samples = [Sample(prompt_ids=[1, 2], output_ids=[3, 4, 5], routed_experts=_rows(4, seed=i), group_id=0)
               for i in range(2)] + [Sample(prompt_ids=[1, 2], output_ids=[6], group_id=0)]
    g = Group(position=0, row=3, admitted_version=0, samples=samples)
    f = io.BytesIO()
    write_record(f, g)
    raw = f.getvalue()
    import struct

    h = struct.calcsize("<4sIQI")  # the record header: magic, meta and data lengths, CRC
    _, n_meta, n_data, crc = struct.unpack_from("<4sIQI", raw)
    meta, data = raw[h:h + n_meta], raw[h + n_meta:h + n_meta + n_data]
    back = decode_record(meta, data, crc, "record")["samples"]
    assert [list(s["routed_experts"]) for s in back] == [list(s.routed_experts) for s in samples]
    assert all(s["routed_experts"].typecode == "h" for s in back)
    # a record written before the column: its meta has no count for it, its data no bytes
    import json
    import zlib

    m = json.loads(meta)
    del m["columns"]["routed_experts"]
    old_meta = json.dumps(m).encode()
    old_data = data[: n_data - sum(len(s.routed_experts) * 2 for s in samples)]
    old = decode_record(old_meta, old_data, zlib.crc32(old_data, zlib.crc32(old_meta)), "old record")["samples"]
    assert [len(s["routed_experts"]) for s in old] == [0, 0, 0]
    assert [list(s["output_ids"]) for s in old] == [list(s.output_ids) for s in samples]


# ----------------------------------------------------------------------------- the client's stitching


def _segment(routing, n_ids=3, finish="length"):
    from areal_fast.rollout.answer import Segment

    return Segment(ids=array("i", range(n_ids)), logprobs=array("f", [0.0] * n_ids), versions=None,
                   finish={"type": finish}, weight_version=None, rid="r", routing=routing)


def test_segment_routing_reads_both_servers_fields_for_the_positions_asked():
    from areal_fast.rollout.client import MalformedAnswer, segment_routing

    rows = np.arange(5 * WIDTH, dtype=np.int32).reshape(5, 2, 2) % 4
    sglang = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    # 4 tokens sent, 3 generated: positions [1, 6) asked (1 recorded before)
    got = segment_routing(_segment(sglang), WIDTH, sent=4, start=1, url="u")
    assert got.typecode == "h" and list(got) == rows.reshape(-1).tolist()
    got = segment_routing(_segment(rows.astype(np.int16)), WIDTH, sent=4, start=1, url="u")  # vLLM's, decoded
    assert list(got) == rows.reshape(-1).tolist()
    assert len(segment_routing(_segment(None), WIDTH, sent=4, start=2, url="u")) == 0  # no routing answered
    # an aborted answer that does not cover the positions gives none (asked again by the next segment)
    assert len(segment_routing(_segment(sglang, finish="abort"), WIDTH, sent=4, start=0, url="u")) == 0
    with pytest.raises(MalformedAnswer, match="20 expert ids for 6 positions of 4"):
        segment_routing(_segment(sglang), WIDTH, sent=4, start=0, url="u")
    with pytest.raises(MalformedAnswer, match="routed_experts"):
        segment_routing(_segment("not base64!"), WIDTH, sent=4, start=2, url="u")


def test_answer_refuses_a_routing_field_that_is_not_a_string():
    from areal_fast.rollout.answer import AnswerError, dumps, parse_generate

    body = {"output_ids": [5], "meta_info": {"id": "r", "finish_reason": {"type": "length"},
                                             "output_token_logprobs": [[-0.5, 5, None]], "routed_experts": [1, 2]}}
    with pytest.raises(AnswerError, match="routed_experts is a list"):
        parse_generate(dumps(body), "server")
    body["meta_info"]["routed_experts"] = "AAAAAA=="
    assert parse_generate(dumps(body), "server").routing == "AAAAAA=="


# ----------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from test_trainer_actor import VOCAB

    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf

    path = build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe_replay")), vocab_size=VOCAB)
    return path, load_hf(path).eval()


def _own_routing(model, s: Sample) -> torch.Tensor:
    """HF's routing of the sample's forwarded positions, as the record lays it out [n, layers x top_k]."""
    from areal_fast.moe_routing import record_routing

    ids = torch.tensor(list(s.prompt_ids) + list(s.output_ids))[None, :-1]
    with torch.no_grad(), record_routing(model) as rec:
        model(ids)
    return torch.stack([r[0] for r in rec], dim=1).reshape(ids.shape[1], -1)


def test_the_actor_replays_the_recorded_routing_only_when_asked(moe):
    from test_trainer_actor import actor_for, hf_logprobs, make_batch

    path, hf = moe
    batch = make_batch(4, seed=7)
    for s in batch:
        s.routed_experts = ((_own_routing(hf, s) + 1) % 4).flatten().tolist()  # every position elsewhere
    want = [hf_logprobs(hf, s) for s in batch]
    plain = actor_for(path, max_tokens_per_mb=64)
    for lp, w in zip(plain.compute_logprobs(batch), want):  # off by default: the record is not used
        torch.testing.assert_close(lp, w, atol=FP32_MOE_LOGPROB_ATOL, rtol=0)
    stats = plain.train_batch(batch, version=0)  # but compared: every recorded pair differs from its own
    assert stats["routing_differ_fraction"] == 1.0 and "routing_replayed_fraction" not in stats
    replay = actor_for(path, max_tokens_per_mb=64, ppo={"routing_replay": True})
    moved = replay.compute_logprobs(batch)
    assert all((lp - w).abs().max() > 0.05 for lp, w in zip(moved, want))  # the other experts were used
    for s in batch:  # HF's own routing replayed: HF's log-probs
        s.routed_experts = _own_routing(hf, s).flatten().tolist()
    for lp, w in zip(replay.compute_logprobs(batch), want):
        torch.testing.assert_close(lp, w, atol=FP32_MOE_LOGPROB_ATOL, rtol=0)
    batch[0].routed_experts = [-1] * len(batch[0].routed_experts)  # unrecorded rows: routed by the trainer
    batch[1].routed_experts = []  # no record at all
    for lp, w in zip(replay.compute_logprobs(batch), want):
        torch.testing.assert_close(lp, w, atol=FP32_MOE_LOGPROB_ATOL, rtol=0)
    stats = replay.train_batch(batch, version=0)
    n = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in batch]
    assert stats["routing_replayed_fraction"] == pytest.approx(sum(n[2:]) / sum(n))
    assert stats["routing_differ_fraction"] == 0.0  # HF's own routing: the trainer's (before the update)
    batch[2].routed_experts = [0] * (3 * n[2])  # a record of another model
    with pytest.raises(ValueError, match="3 expert ids a position, this model routes 2 decoder layers x top 2"):
        replay.compute_logprobs(batch[2:3])


def test_routing_replay_options_are_checked_at_load():
    from areal_fast.backends.checks import check_rollout_servers
    from areal_fast.config import load_config
    from areal_fast.rollout.config import RolloutConfig

    with pytest.raises(ValueError, match="routing_replay: .* rollout.return_routed_experts"):
        load_config(None, ["train.ppo.routing_replay=true", "model.path=/m", "data.train=synthetic:reverse"])
    with pytest.raises(ValueError, match="'qwen2'\\) is dense"):
        load_config(None, ["rollout.return_routed_experts=true", "model.warm_start.enabled=true",
                           "data.train=synthetic:reverse"])
    with pytest.raises(ValueError, match="vLLM returns routing from 0.32.0 on"):
        check_rollout_servers(RolloutConfig(api="vllm", server="vllm", vllm_version="0.27.0",
                                            return_routed_experts=True), "disk")


def test_routing_width_comes_from_the_models_config(moe, tmp_path):
    from areal_fast.moe_routing import routing_width

    assert routing_width(moe[0]) == WIDTH
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="describes no mixture-of-experts model"):
        routing_width(tmp_path)
