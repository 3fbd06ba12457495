"""The chaos benchmark's pure logic (tools/chaos_lib.py, bench/chaos_reward.py): schedule parsing, the
lost/duplicated accounting on synthetic run records, the recovery figures on a synthetic timeline, and
that the stalling proxy holds bytes until its delay is lowered. Nothing here starts a run; no timing
is asserted (the proxy test only uses receive deadlines)."""

import socket
import threading

import pytest
from tolerances import WINDOW_RATE_RTOL

from bench import chaos_reward as cr
from tools import chaos_lib as cl

# ----------------------------------------------------------------------------- schedule


def test_schedule_is_parsed_sorted_and_typed():
    s = cl.parse_schedule("80:server_stop:20, 30:server_kill 200:controller_kill 90:proxy_slow:30:1.5 "
                          "100:server_stop:never")
    assert [f.label() for f in s] == ["30:server_kill", "80:server_stop:20", "90:proxy_slow:30:1.5",
                                      "100:server_stop:never", "200:controller_kill"]
    assert s[1].duration_s == 20.0 and s[3].duration_s is None
    assert s[2].delay_s == 1.5 and s[2].phase == "proxy" and s[0].phase == "main"


@pytest.mark.parametrize("bad, says", [
    ("30:server_explode", "unknown fault"), ("0:server_kill", "integer >= 1"), ("x:server_kill", "integer >= 1"),
    ("30:server_stop", "takes 1 argument"), ("30:server_kill:5", "takes 0 argument"),
    ("30:reward_hang:never", "number > 0"), ("30:proxy_slow:10:-1", "number > 0"), ("server_kill", "STEP:KIND"),
])
def test_bad_schedule_items_are_refused_by_name(bad, says):
    with pytest.raises(ValueError, match=says) as e:
        cl.parse_schedule(f"5:reward_kill {bad}")
    assert repr(bad) in str(e.value)


# ----------------------------------------------------------------------------- accounting


def _events(batches):
    return [{"kind": "train", "step": i + 1, "positions": list(b)} for i, b in enumerate(batches)]


def test_a_clean_run_accounts_for_every_position():
    # 12 positions handed out: 8 trained out of order (async), 2 buffered, 2 still generating
    ev = _events([[0, 2], [1, 3], [5, 4], [6, 9]])
    acc = cl.account(ev, {"position": 12, "pending": [7, 11]}, buffered=[8, 10],
                     samples_per_group={p: 4 for p in range(12)}, group_size=4)
    assert acc.ok and acc.lost == [] and acc.duplicated == []
    assert (acc.issued, acc.trained, acc.buffered, acc.pending) == (12, 8, 2, 2)


def test_a_position_trained_twice_across_a_resume_is_duplicated():
    # the resumed lineage trained position 3 again (a resume that re-issued a trained prompt)
    ev = _events([[0, 1], [2, 3], [3, 4]])
    acc = cl.account(ev, {"position": 6, "pending": [5]}, buffered=[])
    assert acc.duplicated == [3] and not acc.ok


def test_a_position_both_trained_and_buffered_is_duplicated():
    acc = cl.account(_events([[0, 1]]), {"position": 3, "pending": []}, buffered=[1, 2])
    assert acc.duplicated == [1] and acc.lost == []


def test_a_position_in_nobody_s_hands_is_lost():
    ev = _events([[0, 1], [3, 4]])
    acc = cl.account(ev, {"position": 6, "pending": [5]}, buffered=[])
    assert acc.lost == [2] and not acc.ok


def test_steps_must_be_one_lineage_and_groups_complete():
    ev = _events([[0], [1]]) + [{"kind": "train", "step": 2, "positions": []}, {"kind": "train", "step": 4,
                                                                                 "positions": [2]}]
    acc = cl.account(ev, {"position": 3, "pending": []}, buffered=[], samples_per_group={0: 4, 1: 3, 2: 4},
                     group_size=4)
    assert acc.steps_repeated == [2] and acc.steps_missing == [3] and acc.short_groups == [1]
    assert acc.unknown == [] and not acc.ok
    assert cl.account(_events([[7]]), {"position": 3, "pending": [0, 1, 2]}, buffered=[]).unknown == [7]


# ----------------------------------------------------------------------------- recovery figures


def _timeline(gaps, samples=8):
    t, out = 0.0, []
    for i, g in enumerate(gaps):
        t += g
        out.append(cl.Arrival(t, i + 1, samples, 10 * samples))
    return out


def test_figures_of_a_stall_count_the_delayed_steps_and_the_dip():
    # 30 steps at 1 s, a fault at t=30.2 stalls the next step until t=40, then 1 s again
    arr = _timeline([1.0] * 30 + [10.0] + [1.0] * 20)
    fig = cl.fault_figures(arr, 30.2)
    assert fig["baseline_step_s"] == 1.0 and fig["baseline_samples_per_s"] == pytest.approx(8.0, rel=WINDOW_RATE_RTOL)
    assert fig["recovery_s"] == pytest.approx(9.8)  # the step at t=40 starts a run of normal steps
    assert fig["steps_delayed"] == 9  # 9.8 s at 1 step/s is 10 steps, 1 made
    assert 0.8 < fig["dip"] < 0.95  # 1 step (8 samples) in the 10 s window against 8 samples/s


def test_server_fault_recovery_waits_for_the_pool_and_a_resume_for_progress():
    arr = _timeline([1.0] * 60)
    pool = [(0.0, 3), (31.0, 2), (45.5, 3)]
    fig = cl.fault_figures(arr, 30.0, pool=pool, pool_size=3)
    assert fig["pool_back_s"] == pytest.approx(15.5) and fig["recovery_s"] == pytest.approx(16.0)
    assert cl.fault_figures(arr, 30.0, pool=[(0.0, 3), (31.0, 2)], pool_size=3)["recovery_s"] is None
    # a resume: steps 21..29 are trained again; recovered once past step 29 (at t=40 here)
    resumed = _timeline([1.0] * 29) + [cl.Arrival(31.0 + i, 21 + i, 8, 80, 1) for i in range(20)]
    fig = cl.fault_figures(resumed, 29.5, progress_step=29)
    assert fig["recovery_s"] == pytest.approx(40.0 - 29.5)
    assert fig["steps_delayed"] >= 9


def test_pool_back_at():
    assert cl.pool_back_at([(0, 3), (5, 2), (9, 3)], 4, 3) == 9
    assert cl.pool_back_at([(0, 3)], 4, 3) == 4  # never dropped
    assert cl.pool_back_at([(0, 3), (5, 2)], 4, 3) is None


# ----------------------------------------------------------------------------- the proxy and the reward


def _echo_server():
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            while data := c.recv(4096):
                c.sendall(data)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_the_stalling_proxy_holds_bytes_until_the_delay_is_lowered():
    srv = _echo_server()
    proxy = cl.StallingProxy(srv.getsockname()[:2])
    port = proxy.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"fast")
            assert c.recv(16) == b"fast"  # delay 0: a plain proxy
            proxy.delay_s = 3600.0
            c.sendall(b"held")
            c.settimeout(0.5)
            with pytest.raises(TimeoutError):
                c.recv(16)  # held by the proxy, not lost
            proxy.delay_s = 0.0
            c.settimeout(10)
            assert c.recv(16) == b"held"
        assert proxy.chunks >= 4
    finally:
        proxy.stop()
        srv.close()


def test_the_chaos_reward_hangs_only_inside_its_window_and_on_some_rows(tmp_path, monkeypatch):
    flag = tmp_path / "hang"
    monkeypatch.setenv(cr.HANG_FILE_ENV, str(flag))
    rows = [f"completion {i}" for i in range(60)]
    assert not any(cr.hanging(r) for r in rows)  # no file: never
    flag.write_text("2000")
    assert not any(cr.hanging(r, now=3000.0) for r in rows)  # window closed
    chosen = [r for r in rows if cr.hanging(r, now=1000.0)]
    assert 0 < len(chosen) < len(rows)
    assert cr.reward({"answer": "ab"}, "x") == cr.partial_reward({"answer": "ab"}, "x")
