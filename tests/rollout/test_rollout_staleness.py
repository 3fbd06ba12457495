"""StalenessManager: the admission bound of decoupled PPO, restore (also with generations still
running), strict mode."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fast.rollout.staleness import StalenessManager


def test_capacity_formula_and_accounting():
    m = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=3)
    assert m.bound() == 8 and m.capacity() == 3  # min(3 - 0, 8 - 0 - 0)
    assert [m.try_admit() for _ in range(4)] == [True, True, True, False]  # max_concurrent
    for _ in range(3):
        m.finish(True)
    assert (m.accepted, m.running) == (3, 0)
    assert m.capacity() == 3
    for _ in range(3):
        assert m.try_admit()
    m.finish(False)  # a rejected sample gives its slot back without counting as accepted
    assert (m.accepted, m.running) == (3, 2)
    assert m.capacity() == 1 + 0 and m.try_admit()  # accepted + running = 6 < 8 -> 7
    m.finish(True); m.finish(True); m.finish(True)  # noqa: E702
    assert m.accepted == 6 and m.running == 0
    assert [m.try_admit() for _ in range(3)] == [True, True, False]  # 6 + 2 = 8 = (1 + 0 + 1) * 4
    m.set_version(1)
    assert m.bound() == 12 and m.try_admit()
    assert m.stats()["admitted"] == 10 and m.stats()["refused"] == 2 and m.stats()["rejected"] == 1


def test_eta_zero_is_synchronous():
    m = StalenessManager(batch_size=2, max_staleness=0, max_concurrent=100)
    assert [m.try_admit() for _ in range(3)] == [True, True, False]
    m.finish(True); m.finish(True)  # noqa: E702
    assert not m.try_admit()  # a full batch waits for the trainer
    m.set_version(1)
    assert m.try_admit() and m.try_admit() and not m.try_admit()


def test_restore_sets_accepted_to_v_times_b():
    m = StalenessManager(batch_size=8, max_staleness=2, max_concurrent=64)
    for _ in range(5):
        m.try_admit()
    for _ in range(5):
        m.finish(True)
    m.restore(3)
    assert (m.version, m.accepted, m.running) == (3, 24, 0)
    assert m.capacity() == (2 + 3 + 1) * 8 - 24
    m.restore(3, accepted=30)  # buffered samples restored with the checkpoint still count
    assert (m.accepted, m.capacity()) == (30, 18)
    with pytest.raises(ValueError, match="version went back"):
        m.set_version(2)
    with pytest.raises(RuntimeError, match="no running generation"):
        m.finish(True)


def test_restore_with_generations_still_running_keeps_the_count():
    """Generations admitted before a restore still hold their slots; finishing them afterwards is
    counted normally (no error, no negative count) and the bound is honoured meanwhile."""
    m = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8)
    assert all(m.try_admit() for _ in range(3))
    m.restore(1)  # accepted = 2, three generations of the old incarnation still running
    assert (m.version, m.accepted, m.running) == (1, 2, 3)
    assert m.capacity() == (1 + 1 + 1) * 2 - 2 - 3  # the running ones count against the bound
    assert m.try_admit() and not m.try_admit()
    m.finish(True)  # a leftover finishes and is accepted
    m.finish(False)  # another fails
    assert (m.accepted, m.running) == (3, 2)
    m.finish(True)
    m.finish(True)
    assert (m.accepted, m.running) == (5, 0)
    with pytest.raises(RuntimeError, match="no running generation"):
        m.finish(True)


def test_strict_mode_drops_stale_samples_and_frees_their_slot():
    m = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8, strict=True, version=3)
    for _ in range(2):
        m.try_admit()
        m.finish(True)
    assert m.check_consumed([2, 3]) is True  # oldest token 2 >= 3 - 1
    before = m.accepted
    assert m.check_consumed([1, 3]) is False  # a token from version 1 < 3 - 1
    assert m.stats()["dropped_stale"] == 1 and m.accepted == before - 1
    lax = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8, version=3)
    assert lax.check_consumed([0]) is True and lax.stats()["dropped_stale"] == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(0, 1, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(1, -1, 1)
    with pytest.raises(ValueError, match="max_concurrent"):
        StalenessManager(1, 1, 0)


OPS = st.lists(st.one_of(
    st.just(("admit",)), st.just(("accept",)), st.just(("reject",)), st.just(("bump",)),
    st.tuples(st.just("restore"), st.integers(0, 20)), st.tuples(st.just("consume"), st.integers(0, 25)),
), max_size=300)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, b=st.integers(1, 6), eta=st.integers(0, 3), mc=st.integers(1, 12), strict=st.booleans())
def test_bound_holds_under_any_interleaving(ops, b, eta, mc, strict):
    m = StalenessManager(batch_size=b, max_staleness=eta, max_concurrent=mc, strict=strict)
    admitted = accepted = rejected = dropped = 0
    for op in ops:
        kind = op[0]
        if kind == "admit":
            ok = m.try_admit()
            assert ok == (m.running - (1 if ok else 0) < mc and m.accepted + m.running - (1 if ok else 0)
                          < (eta + m.version + 1) * b)
            admitted += ok
        elif kind in ("accept", "reject") and m.running > 0:
            m.finish(kind == "accept")
            accepted += kind == "accept"
            rejected += kind == "reject"
        elif kind == "bump":
            m.set_version(m.version + 1)
        elif kind == "restore":
            running = m.running
            m.restore(op[1])
            assert (m.accepted, m.running) == (op[1] * b, running)  # running generations keep their slot
        elif kind == "consume":
            kept = m.check_consumed([op[1]])
            dropped += not kept
            assert kept == (not strict or op[1] >= m.version - eta)
        assert 0 <= m.running <= mc
        if kind == "admit" and ok:  # a generation starts only inside the bound (a restore to an
            # earlier version may leave running ones above it until they finish)
            assert m.accepted + m.running <= (eta + m.version + 1) * b
    s = m.stats()
    assert (s["admitted"], m.counts.accepted, s["rejected"], s["dropped_stale"]) == (
        admitted, accepted, rejected, dropped)


def test_every_request_of_a_group_carries_its_admission_order(tmp_path):
    """The controller sets ``ADMISSION_ORDER`` in each group's task, and every request of the group's
    episodes inherits it: the numbers 1, 2, ... in the order the groups were admitted (the rollout
    client sends it as the request's scheduling priority, so a request sent again after a pause keeps
    its group's place). Outside a group there is none."""
    import asyncio

    from fakes import VersionTaggingRollout, make_controller

    from areal_fast.rollout.staleness import ADMISSION_ORDER

    seen: dict[str, int | None] = {}

    class Recording(VersionTaggingRollout):
        async def generate(self, input_ids, sampling, rid):
            seen[rid] = ADMISSION_ORDER.get()
            return await super().generate(input_ids, sampling, rid)

    ctl, _, server = make_controller(tmp_path, eta=1, steps=4)
    ctl.rollout = Recording(server)
    asyncio.run(ctl.run())
    by_position: dict[int, set] = {}
    for rid, order in seen.items():  # <incarnation>-<position>-<episode>-<turn>
        by_position.setdefault(int(rid.split("-")[1]), set()).add(order)
    assert all(len(orders) == 1 for orders in by_position.values()), by_position  # one number per group
    orders = [next(iter(by_position[p])) for p in sorted(by_position)]
    assert orders == list(range(1, len(orders) + 1)) and len(orders) <= ctl.counters.admitted  # no requeue here
    assert ADMISSION_ORDER.get() is None


def test_an_episode_s_turns_carry_its_group_s_admission_order_from_any_task():
    """The episode's engine handle keeps the order it was made with: a turn asked from another task (an
    agent endpoint's handler, which does not run in the group's task) carries it too."""
    import asyncio
    import contextvars

    from areal_fast.rollout.staleness import ADMISSION_ORDER
    from areal_fast.workflow.engine import EpisodeEngine

    seen = []

    class Rollout:
        async def generate(self, input_ids, sampling, rid):
            seen.append((rid, ADMISSION_ORDER.get()))

    async def run():
        ADMISSION_ORDER.set(7)  # the group's task
        engine = EpisodeEngine(Rollout(), None, None, {}, "ep")
        await asyncio.create_task(engine.generate([1, 2]), context=contextvars.Context())  # a foreign task
        await engine.generate([1, 2])
        return ADMISSION_ORDER.get()

    assert asyncio.run(run()) == 7 and seen == [("ep-0", 7), ("ep-1", 7)]
