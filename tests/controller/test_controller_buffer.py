"""The controller's buffer of finished groups under a memory bound (``areal_fast.buffer``): groups
past the bound wait in a spill file and come back FIFO with exactly their contents; the file's space
is reused; strict mode drops spilled groups without reading them; checkpoints stream the buffer to
``buffer.bin`` and restore it; a
damaged buffer file makes the checkpoint corrupt; and a run with a tiny bound trains exactly what an
unbounded run trains."""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
from array import array

import pytest
from fakes import MatchReward, ParityTok, Prompts, RecordingTrainer, VersionSync

from areal_fast.buffer import GroupBuffer, column_bytes, read_records
from areal_fast.checkpoint import BUFFER_FILE, STATE_FILE, CorruptCheckpoint
from areal_fast.columns import LOGPROB_ARRAY, MASK_ARRAY, TOKEN_ARRAY
from areal_fast.config import RolloutConfig
from areal_fast.controller import Controller, ControllerSettings
from areal_fast.group import Group
from areal_fast.rollout.staleness import StalenessManager
from areal_fast.sample import COLUMN_NAMES, Sample

# float32 values whose bits must survive: -0.0, the smallest subnormal, the largest finite, -inf
_AWKWARD = struct.unpack("<4f", struct.pack("<4I", 0x80000000, 0x00000001, 0x7F7FFFFF, 0xFF800000))


def make_group(pos: int, rng: random.Random, *, n: int = 3, max_len: int = 40, version: int | None = None) -> Group:
    """A group with every kind of field: per-trajectory prompts (shared with prompt_ids or not), loss
    masks with context tokens, awkward float32 log-probs, rewards and infos; ``version``: every
    token's (default: random)."""
    prompt = array(TOKEN_ARRAY, [rng.randrange(-5, 2**31 - 1) for _ in range(rng.randrange(0, 6))])
    samples = []
    for i in range(n):
        k = rng.randrange(0, max_len)
        lp = array(LOGPROB_ARRAY, [-rng.random() * 20 for _ in range(k)])
        for j, x in enumerate(_AWKWARD[: k]):
            lp[j] = x
        samples.append(Sample(
            prompt_ids=prompt if i == 0 or rng.random() < 0.5 else array(TOKEN_ARRAY, [7, pos]),
            output_ids=array(TOKEN_ARRAY, [rng.randrange(0, 2**31 - 1) for _ in range(k)]), output_logprobs=lp,
            output_versions=array(TOKEN_ARRAY, [rng.randrange(0, 9) if version is None else version for _ in range(k)]),
            loss_mask=array(MASK_ARRAY, [rng.random() < 0.8 for _ in range(k)]), reward=rng.random(),
            finish_reason=rng.choice(["stop", "length", "abort"]),
            info={"turns": rng.randrange(3), "score": rng.random()}, group_id=pos))
    return Group(position=pos, row=pos % 7, admitted_version=rng.randrange(0, 5), samples=samples,
                 gen_seconds=rng.random(), episodes_failed=rng.randrange(2))


def assert_same_groups(got: list[Group], want: list[Group]) -> None:
    """Field by field; the per-token columns byte for byte (float32 bits, -0.0 and -inf included)."""
    assert [g.position for g in got] == [g.position for g in want]
    for a, b in zip(got, want):
        for name in ("row", "admitted_version", "rewards", "gen_seconds", "infos", "episodes_failed"):
            assert getattr(a, name) == getattr(b, name), (a.position, name)
        assert len(a.samples) == len(b.samples)
        for sa, sb in zip(a.samples, b.samples):
            for name in ("reward", "finish_reason", "info", "group_id"):
                assert getattr(sa, name) == getattr(sb, name), (a.position, name)
            assert sa.min_model_version() == sb.min_model_version(), a.position
            for name in COLUMN_NAMES:
                ca, cb = getattr(sa, name), getattr(sb, name)
                assert (ca.typecode, ca.tobytes()) == (cb.typecode, cb.tobytes()), (a.position, name)


def _drain(buf: GroupBuffer, k: int) -> list[Group]:
    slots = [buf.take() for _ in range(min(k, len(buf)))]
    groups = buf.load(slots)
    buf.release(slots)
    return groups


@pytest.mark.parametrize("bound", [0, 1, 1500, 4000, None], ids=["0", "1B", "1.5kB", "4kB", "unbounded"])
def test_fifo_order_and_exact_contents_with_spilling(tmp_path, bound):
    rng = random.Random(bound or 7)
    groups = [make_group(p, rng) for p in range(40)]
    buf = GroupBuffer(bound, tmp_path, Group)
    out: list[Group] = []
    it = iter(groups)
    while len(out) < len(groups):  # interleave appends and takes, as the controller does
        buf.extend(g for _, g in zip(range(rng.randrange(1, 8)), it))
        out += _drain(buf, rng.randrange(0, 6))
        assert bound is None or buf.in_memory <= bound
    assert_same_groups(out, groups)
    if bound is None:
        assert buf.spilled_total == 0
    elif bound <= 1:  # every group with a token is spilled (an empty one takes no memory)
        assert buf.spilled_total == sum(column_bytes(g) > 0 for g in groups) > 30
    else:
        assert 0 < buf.spilled_total < 40
    assert buf.spilled == 0 and buf.in_memory == 0 and buf.spill.size == 0
    if buf.spill._f is not None:
        assert os.fstat(buf.spill._f.fileno()).st_size == 0  # emptied: cut back to nothing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("areal_fast_buffer_")]  # unlinked at once
    buf.close()


@pytest.mark.parametrize("bound", [0, 3000, None], ids=["0", "3kB", "unbounded"])
def test_parked_parts_come_back_exact_and_share_the_bound_with_the_buffer(tmp_path, bound):
    """Parts of running groups (park/unpark) are held under the same bound as the buffer: spilled
    past it, read back byte for byte, and their memory or extents freed; discard frees unread."""
    rng = random.Random(11)
    buf = GroupBuffer(bound, tmp_path, Group)
    parts = [make_group(p, rng) for p in range(30)]
    handles = [buf.park(g) for g in parts]
    assert bound is None or buf.in_memory + buf.parked <= bound
    if bound is None:
        assert buf.parked_spilled_total == 0 and buf.parked == sum(column_bytes(g) for g in parts)
    else:
        assert buf.parked_spilled == buf.parked_spilled_total > (20 if bound == 0 else 0)
    if bound == 3000:  # what is parked counts: a group appended now is spilled if it does not fit
        g = make_group(99, rng)
        buf.append(g)
        assert (buf.spilled == 1) == (buf.parked + column_bytes(g) > bound)
        buf.release([buf.take()])
    back = [buf.unpark(h) for h in handles[:20]]
    assert_same_groups(back, parts[:20])
    for h in handles[20:]:
        buf.discard(h)
    assert buf.parked == 0 and buf.parked_spilled == 0 and buf.spill.size == 0
    buf.close()


def test_the_spill_file_reuses_its_space_over_many_fill_drain_cycles(tmp_path):
    """Never fully drained (a few groups stay spilled across cycles): the file stays within the most
    bytes spilled at one time, instead of growing by every group ever spilled."""
    rng = random.Random(3)
    buf = GroupBuffer(0, tmp_path, Group)
    most, written, pos = 0, 0, 0
    for _cycle in range(60):
        for _ in range(rng.randrange(5, 15)):
            g = make_group(pos, rng, max_len=200)
            pos += 1
            buf.append(g)
            written += column_bytes(g)
        live = sum(s.length for s in buf._slots)
        most = max(most, live)
        assert buf.spill.size <= 2 * most  # first fit over the freed extents: bounded fragmentation
        _drain(buf, len(buf) - rng.randrange(0, 4))
    assert os.fstat(buf.spill._f.fileno()).st_size == buf.spill.size < written / 10
    _drain(buf, len(buf))
    assert buf.spill.size == 0 and os.fstat(buf.spill._f.fileno()).st_size == 0
    buf.close()


# ----------------------------------------------------------------------------- controller fakes


class Rollout:
    """Answers that are a pure function of the request (position, episode): lengths 1 to 300 tokens,
    awkward float32 log-probs; every token carries the servers' version."""

    def __init__(self):
        self.version = 0

    @staticmethod
    def answer(rid: str) -> tuple[list[int], list[float]]:
        rng = random.Random(rid.split("-", 1)[1])  # without the incarnation
        k = rng.randrange(1, 300)
        return [rng.randrange(1, 50_000) for _ in range(k)], [-rng.random() * 10 for _ in range(k)]

    async def generate(self, input_ids, sampling, rid):
        await asyncio.sleep(0)
        ids, lps = self.answer(rid)
        return Sample(prompt_ids=input_ids, output_ids=ids, output_logprobs=lps,
                      output_versions=[self.version] * len(ids), finish_reason="stop")

    async def pause(self):
        pass

    async def resume(self):
        pass


def controller(tmp_path, *, bound_mb, eta=0, steps=4, B=3, n=2, strict=False, ckpt=0, trainer=None):
    s = ControllerSettings(batch_size=B, group_size=n, total_steps=steps, sampling={"max_new_tokens": 300},
                           eval_sampling={}, eval_every=0, eval_at_start=False, checkpoint_every=ckpt,
                           output_dir=tmp_path, buffer_memory_mb=bound_mb)
    rollout = Rollout()
    gate = StalenessManager(B, eta, max_concurrent=16, strict=strict)
    return Controller(s, Prompts(), ParityTok(), rollout, MatchReward(), trainer or RecordingTrainer(),
                      VersionSync(rollout), gate)


def _sample_bytes(s: Sample) -> tuple:
    return (s.group_id, s.reward, *((k, getattr(s, k).typecode, getattr(s, k).tobytes()) for k in COLUMN_NAMES))


def test_a_run_with_a_tiny_bound_trains_exactly_what_an_unbounded_run_trains(tmp_path):
    """eta 0 makes each step's batch exactly the groups admitted at its version, so the two runs
    must hand the trainer the same samples, byte for byte, in the same order."""
    runs = {}
    for bound in (None, 0.0):  # 0: every group is spilled
        ctl = controller(tmp_path / str(bound), bound_mb=bound, eta=0, steps=4)
        asyncio.run(ctl.run())
        runs[bound] = [_sample_bytes(s) for s in ctl.trainer.samples]
        spilled = ctl.buffer.spilled_total
        assert spilled == 0 if bound is None else spilled >= 4 * 3, spilled  # (+ groups after the last step)
        # bound 0: every finished episode waited for its group in the spill file, and none is left
        assert (ctl.buffer.parked_spilled_total >= 4 * 3 * 2) == (bound == 0.0)
        assert ctl.buffer.parked == 0 and ctl.buffer.parked_spilled == 0
    assert len(runs[None]) == 4 * 3 * 2 and runs[None] == runs[0.0]
    # and what was trained is what the rollout made for that request
    ctl = controller(tmp_path / "eta2", bound_mb=0.002, eta=2, steps=6)
    asyncio.run(ctl.run())
    assert 0 < ctl.buffer.spilled_total and 0 < ctl.buffer.parked_spilled_total
    assert ctl.buffer.parked == 0 and ctl.buffer.parked_spilled == 0  # groups cancelled at the end dropped theirs
    trained = [s.group_id for s in ctl.trainer.samples]
    assert len(set(trained)) == 6 * 3 == len(trained) // 2  # each group once
    seen = sorted(set(trained) | {g.position for g in ctl.buffer} | set(ctl.requeue) | set(ctl.running))
    assert seen == list(range(ctl.position))
    by_answer = {}
    for s in ctl.trainer.samples:
        by_answer.setdefault(s.group_id, []).append((s.output_ids.tolist(), s.output_logprobs.tobytes()))
    for pos, answers in by_answer.items():
        want = [Rollout.answer(f"x-{pos}-{k}-0") for k in range(2)]  # rid: incarnation-position-episode-turn
        assert sorted(answers) == sorted((ids, array(LOGPROB_ARRAY, lp).tobytes()) for ids, lp in want)


def test_strict_mode_drops_spilled_groups_without_reading_them(tmp_path):
    ctl = controller(tmp_path, bound_mb=0.001, eta=1, B=2, strict=True)  # 1,048 bytes in memory
    rng = random.Random(5)
    ctl.version = 5
    ctl.gate.restore(5, 5 * 2)
    ctl.gate.set_version(5)
    groups = [make_group(p, rng, max_len=60, version=3 if p in (0, 2, 3) else 5) for p in range(6)]
    ctl.buffer.extend(groups)
    assert ctl.buffer.spilled >= 3
    reads = []
    load = ctl.buffer.spill.load
    ctl.buffer.spill.load = lambda s: reads.append(s.position) or load(s)
    slots, dropped = ctl._take_batch()
    assert dropped == [0, 2, 3] and list(ctl.requeue) == [0, 2, 3] and ctl.counters.dropped_stale == 3
    assert reads == []  # the oldest version of a spilled group is in memory
    batch = ctl.buffer.load(slots)
    ctl.buffer.release(slots)
    assert_same_groups(batch, [groups[1], groups[4]])
    assert [g.position for g in ctl.buffer] == [5]
    _drain(ctl.buffer, 1)
    assert ctl.buffer.spilled == 0 and ctl.buffer.spill.size == 0  # the dropped groups' space was freed
    # too few left after the drops: the kept ones go back to the head, in their order, unread
    ctl = controller(tmp_path / "short", bound_mb=0, eta=1, B=3, strict=True)
    ctl.version = 5
    ctl.gate.restore(5, 5 * 3)
    ctl.gate.set_version(5)
    groups = [make_group(p, rng, max_len=60, version=3 if p == 1 else 5) for p in range(3)]
    ctl.buffer.extend(groups)
    assert ctl._take_batch() == ([], [1])
    assert_same_groups(list(ctl.buffer), [groups[0], groups[2]])


# ----------------------------------------------------------------------------- checkpoints


def _checkpoint_with(tmp_path, groups, bound_mb, version=3):
    ctl = controller(tmp_path, bound_mb=bound_mb)
    ctl.version, ctl.position = version, 100
    ctl.buffer.extend(groups)
    return ctl, ctl._write_checkpoint(ctl.state_dict())


@pytest.mark.parametrize("restore_bound", [None, 0.002], ids=["into-unbounded", "into-bounded"])
def test_checkpoint_round_trip_with_spilled_and_in_memory_groups(tmp_path, restore_bound):
    rng = random.Random(11)
    groups = [make_group(p, rng, max_len=80) for p in range(12)]
    ctl, ck = _checkpoint_with(tmp_path, groups, bound_mb=0.004)
    assert 0 < ctl.buffer.spilled < 12  # both kinds went into the checkpoint
    st = json.loads((ck / STATE_FILE).read_text())
    assert "buffer" not in st and st["buffer_file"] == {"name": BUFFER_FILE, "groups": 12,
                                                        "bytes": (ck / BUFFER_FILE).stat().st_size}
    assert b"__array__" not in (ck / STATE_FILE).read_bytes()
    ctl2 = controller(tmp_path, bound_mb=restore_bound)
    assert ctl2.restore_newest() == ck
    assert_same_groups(list(ctl2.buffer), groups)
    assert (ctl2.buffer.spilled > 0) == (restore_bound is not None)
    assert ctl2.gate.accepted == 3 * 3 + 12
    assert_same_groups(_drain(ctl2.buffer, 12), groups)


def _second_record_offset(raw: bytes) -> int:
    _, n_meta, n_data, _ = struct.unpack_from("<4sIQI", raw)
    return 20 + n_meta + n_data


@pytest.mark.parametrize("damage", ["flip-a-column-byte", "truncated", "longer", "record-count", "huge-data-length",
                                    "huge-meta-length"])
def test_a_damaged_buffer_file_makes_the_checkpoint_corrupt(tmp_path, damage, caplog):
    rng = random.Random(13)
    _, older = _checkpoint_with(tmp_path, [make_group(p, rng) for p in range(4)], bound_mb=0.001, version=2)
    groups = [make_group(p, rng, max_len=60) for p in range(4, 10)]
    _, newest = _checkpoint_with(tmp_path, groups, bound_mb=0.001, version=3)
    f = newest / BUFFER_FILE
    raw = bytearray(f.read_bytes())
    if damage == "flip-a-column-byte":
        raw[-3] ^= 0x10  # in the last group's last loss mask: only the CRC can tell
        f.write_bytes(raw)
    elif damage == "truncated":
        f.write_bytes(raw[:-5])
    elif damage == "longer":
        f.write_bytes(raw + b"\0")
    elif damage.startswith("huge"):  # a length field past the file: refused before anything is allocated
        at = _second_record_offset(raw)
        if damage == "huge-data-length":
            struct.pack_into("<Q", raw, at + 8, 2**62)
        else:
            struct.pack_into("<I", raw, at + 4, 2**32 - 1)
        f.write_bytes(raw)
    else:
        st = json.loads((newest / STATE_FILE).read_text())
        st["buffer_file"]["groups"] = 5
        (newest / STATE_FILE).write_text(json.dumps(st))
    with pytest.raises(CorruptCheckpoint, match=f"{newest}.*{BUFFER_FILE}") as err:
        controller(tmp_path, bound_mb=None).restore(newest)
    if damage.startswith("huge"):
        assert f"record 1 at offset {_second_record_offset(raw)}" in str(err.value), err.value
        assert "past the end of the file" in str(err.value), err.value
    ctl = controller(tmp_path, bound_mb=None)
    with caplog.at_level("WARNING"):
        assert ctl.restore_newest() == older
    assert ctl.version == 2 and "falling back" in caplog.text
    assert newest.with_name(newest.name + ".corrupt").is_dir()


def test_a_checkpoint_during_spilled_drains_keeps_the_extents_until_copied(tmp_path):
    """A group trained while a checkpoint is being written keeps its spill extent until the writer
    has copied it (pin/unpin); then its space is reused."""
    rng = random.Random(14)
    groups = [make_group(p, rng, max_len=60) for p in range(4)]
    ctl = controller(tmp_path, bound_mb=0)
    ctl.buffer.extend(groups)
    slots = ctl.buffer.snapshot()
    ctl.buffer.pin()
    taken = [ctl.buffer.take() for _ in range(2)]
    ctl.buffer.release(taken)
    ctl.buffer.append(make_group(99, rng, max_len=60))  # must not land on the taken groups' extents
    with open(tmp_path / "b.bin", "wb") as f:
        ctl.buffer.write(slots, f)
    ctl.buffer.unpin()
    assert ctl.buffer.spilled == 3
    with open(tmp_path / "b.bin", "rb") as f:
        assert_same_groups([Group(**kw) for kw in read_records(f, 4, "b.bin")], groups)


@pytest.mark.parametrize("bad", [-1, "big", float("inf"), True])
def test_a_bad_buffer_bound_is_refused_at_config_load_naming_the_key(bad):
    with pytest.raises(ValueError, match="buffer_memory_mb"):
        RolloutConfig(buffer_memory_mb=bad)
    assert RolloutConfig(buffer_memory_mb=None).buffer_memory_mb is None
    assert RolloutConfig().buffer_memory_mb == ControllerSettings(1, 1, 1, {}, {}).buffer_memory_mb == 128.0


def test_the_batch_is_released_when_the_trainer_returns_before_pause_and_sync(tmp_path):
    """At full lengths a batch is ~0.65 GB of columns: the pause, weight sync and resume after a step
    must not hold it. The trainer keeps only weak references; by the pause they must all be dead."""
    import weakref

    class WeakTrainer(RecordingTrainer):
        def __init__(self):
            super().__init__()
            self.refs: list = []

        def train(self, samples, version):
            self.refs = [weakref.ref(getattr(s, k)) for s in samples for k in ("output_ids", "output_logprobs")]
            return {}

    alive_at_pause = []
    ctl = controller(tmp_path, bound_mb=None, eta=0, steps=3, trainer=WeakTrainer())
    pause = ctl.rollout.pause

    async def checking_pause():
        alive_at_pause.append(sum(r() is not None for r in ctl.trainer.refs))
        await pause()

    ctl.rollout.pause = checking_pause
    asyncio.run(ctl.run())
    assert len(alive_at_pause) == 3 and len(ctl.trainer.refs) == 2 * 3 * 2  # a pause a step; B x n samples
    assert alive_at_pause == [0, 0, 0]
