"""The server-count policy (``areal_fast.rollout.autoscale``), its config section, the run's autoscaler
(``areal_fast.elastic.autoscale``: the launcher's target, ``areal-fast scale``'s bound, the decision
records) and where the decisions show (the progress line, the Prometheus endpoint). In process, fake
readings; the real run is ``tests/launch/test_autoscale_e2e.py``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from areal_fast.elastic.autoscale import Autoscaler, read_scale, scale_command
from areal_fast.elastic.members import Member, read_target, servers_dir, write_members
from areal_fast.metrics.sinks import ProgressBar, server_count
from areal_fast.rollout.autoscale import AutoscalePolicy, Reading
from areal_fast.rollout.config import AutoscaleConfig, RolloutConfig

B, ETA = 8, 4


def cfg(**kw) -> AutoscaleConfig:
    return AutoscaleConfig(**{"enabled": True, "min_servers": 1, "max_servers": 16, **kw})


def reading(step: int, servers: int, *, idle: float, buffer: float = 1.0, stale: float = 0.5,
            changing: bool = False, tokens: int = 10_000, gen_len: float = 500.0) -> Reading:
    """A step of 10 s of training and 1 s of sync with ``idle`` of its time spent waiting for the batch."""
    busy = 11.0
    wait = idle * busy / (1 - idle)
    return Reading(step=step, servers=servers, changing=changing, wait_s=wait, train_s=10.0, sync_s=1.0,
                   tokens=tokens, buffer_groups=round(buffer * B), batch_groups=B, eta=ETA,
                   staleness_mean=stale * ETA, gen_len_mean=gen_len)


class Pool:
    """A pool that reaches its target ``start_steps`` steps after a change (a server's start-up)."""

    def __init__(self, n: int, start_steps: int):
        self.n, self.start_steps, self.pending = n, start_steps, 0

    def after(self, target: int) -> None:
        if target != self.n and self.pending == 0:
            self.pending = self.start_steps
        if self.pending:
            self.pending -= 1
            if self.pending == 0:
                self.n = target


def run(policy: AutoscalePolicy, pool: Pool, loads) -> list[int]:
    """Feed one reading per load (idle, buffer, stale); the target after each step."""
    targets = []
    for step, (idle, buf, stale) in enumerate(loads, 1):
        d = policy.step(reading(step, pool.n, idle=idle, buffer=buf, stale=stale,
                                changing=pool.n != policy.target))
        pool.after(d.target)
        targets.append(d.target)
    return targets


def reversals(targets: list[int]) -> int:
    moves = [b - a for a, b in zip(targets, targets[1:]) if b != a]
    return sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))


# ----------------------------------------------------------------------------- the policy


def test_servers_are_added_when_the_trainer_waits_sized_by_the_measured_rate():
    p = AutoscalePolicy(cfg(), 4)
    ds = [p.step(reading(s, 4, idle=0.5)) for s in (1, 2, 3)]
    assert [d.change for d in ds[:2]] == [0, 0]  # measuring: the first step, then settle_steps full ones
    d = ds[2]
    # half of each step waiting: generation makes the batch in 22 s, the trainer takes 11 s: twice the servers
    # (x headroom 1.1: 8.8 -> 9), capped at +50 % a change (6)
    assert d.change == 2 and d.target == 6 and "trainer idle 50%" in d.reason
    assert d.idle == pytest.approx(0.5) and d.window_steps == 2
    rec = d.record()
    assert rec["kind"] == "autoscale" and rec["autoscale/target"] == 6 and rec["autoscale/change"] == 2


def test_servers_are_removed_when_the_buffer_is_full_and_groups_go_stale_and_not_otherwise():
    p = AutoscalePolicy(cfg(), 10)
    ds = [p.step(reading(s, 10, idle=0.0, buffer=3.0, stale=1.0)) for s in (1, 2, 3)]
    assert ds[-1].change == -1 and "generation runs ahead" in ds[-1].reason
    q = AutoscalePolicy(cfg(), 10)  # a full buffer of fresh groups: not "stale"
    assert all(q.step(reading(s, 10, idle=0.0, buffer=3.0, stale=0.3)).change == 0 for s in range(1, 8))


def test_a_removal_never_goes_below_what_the_measured_rate_needs():
    p = AutoscalePolicy(cfg(down_fraction=0.5), 4)
    for s in (1, 2, 3):
        d = p.step(reading(s, 4, idle=0.5))
    assert d.target == 6
    for s in range(4, 12):  # the pool at 6; now the trainer never waits and the buffer is full and stale
        d = p.step(reading(s, 6, idle=0.0, buffer=3.0, stale=1.0))
        assert d.change == 0, d  # 4 servers' rate x 1.05 needs 6: half of them removed would undo the increase
    assert "the measured rate needs 6" in d.reason


def test_nothing_is_decided_until_the_pool_holds_the_target():
    p = AutoscalePolicy(cfg(), 4)
    for s in (1, 2, 3):
        p.step(reading(s, 4, idle=0.5))
    assert p.target == 6
    for s in range(4, 20):  # the new servers do not come yet: the policy waits, it does not pile on more
        d = p.step(reading(s, 4, idle=0.5, changing=True))
        assert d.change == 0 and d.reason.startswith("waiting: 4 of 6")


def test_servers_that_never_start_are_given_up_and_no_increase_follows_for_a_while():
    p = AutoscalePolicy(cfg(start_timeout_s=100.0), 4)  # a step here: 11 s busy + the waiting
    for s in (1, 2, 3):
        p.step(reading(s, 4, idle=0.5))
    assert p.target == 6
    got = [p.step(reading(s, 4, idle=0.5, changing=True)) for s in range(4, 9)]  # 22 s a step
    assert all(d.change == 0 for d in got[:4])  # 88 s
    assert got[4].change == -2 and got[4].target == 4 and got[4].reason.startswith("gave up: 2 added server(s)")
    # the pool at its target again, the trainer still waiting: no increase for 100 s, then up again
    later = [p.step(reading(s, 4, idle=0.5)) for s in range(9, 14)]  # 78, 56, 34, 12, 0 s left
    assert [d.change for d in later[:4]] == [0] * 4
    assert "no increase for 12 s more" in later[3].reason
    assert later[4].change > 0
    # a pool that joins within the time is not given up, however many (short) steps that takes
    q = AutoscalePolicy(cfg(start_timeout_s=100.0), 4)
    for s in (1, 2, 3):
        q.step(reading(s, 4, idle=0.5))
    fast = Reading(**{**reading(4, 4, idle=0.5, changing=True).__dict__, "wait_s": 0.1, "train_s": 0.1,
                      "sync_s": 0.0})
    assert all(q.step(fast).change == 0 for _ in range(400))  # 80 s in 400 steps
    assert q.step(reading(9, 6, idle=0.5)).change == 0 and q.target == 6


def test_a_hand_bound_moves_the_target_inside_at_once_and_holds_it():
    p = AutoscalePolicy(cfg(), 4)
    p.set_hand_bound(2)
    d = p.step(reading(1, 4, idle=0.9))
    assert (d.change, d.target, d.lo, d.hi) == (-2, 2, 2, 2) and d.reason.startswith("bound 2..2")
    for s in range(2, 10):  # the trainer waits, but the person said 2
        assert p.step(reading(s, 2, idle=0.9)).target == 2
    p.set_hand_bound(None)
    assert [p.step(reading(s, 2, idle=0.9)).target for s in (10, 11, 12)][-1] > 2
    with pytest.raises(ValueError, match="min 5 > max 3"):
        p.set_hand_bound(5, 3)


def test_a_load_swinging_faster_than_a_server_starts_does_not_make_the_count_swing():
    # every other step the trainer waits 60 % (buffer empty) or not at all (buffer full, groups at eta);
    # a server takes 3 steps to start: each window holds both halves
    swing = [(0.6, 0.2, 0.5), (0.0, 4.0, 1.0)] * 30
    p = AutoscalePolicy(cfg(), 4)
    targets = run(p, Pool(4, start_steps=3), swing)
    assert reversals(targets) == 0, targets  # the mean load (30 % idle) asks for more servers: it only adds
    assert targets[-1] > 4
    # what the window's length buys: decided from one step at a time, the count follows the swing down and back
    assert reversals(run(AutoscalePolicy(cfg(settle_steps=1), 4), Pool(4, start_steps=3), swing)) > 0
    # a swing whose mean sits between idle_low and idle_high (5 %) changes nothing at all
    mild = [(0.10, 0.5, 0.5), (0.0, 4.0, 1.0)] * 30
    q = AutoscalePolicy(cfg(), 4)
    assert set(run(q, Pool(4, start_steps=3), mild)) == {4}


def test_the_controller_gives_each_step_the_readings_the_policy_needs(tmp_path):
    import asyncio

    from fakes import make_controller

    ctl, _, _ = make_controller(tmp_path, eta=2, steps=4)
    records = []
    ctl.callbacks.append(records.append)
    asyncio.run(ctl.run())
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4 and all(0 <= r["buffer_at_ask"] <= 3 * 2 for r in train)  # at most (eta + 1) x B
    assert all(r["gen_tokens_per_s"] >= 0 for r in train) and sum(r["gen_tokens_per_s"] for r in train) > 0
    assert ctl.generated_tokens >= ctl.counters.trained_tokens > 0  # every finished group's tokens, trained or not
    p = AutoscalePolicy(cfg(), 2)
    for r in train[:3]:  # a controller record is a reading (as the run's autoscaler reads it)
        d = p.step(Reading.from_record(r, servers=2, changing=False, batch_groups=2, eta=2))
    assert d.window_steps == 2 and d.idle is not None and d.gen_len_mean > 0  # the first decision, from real records


# ----------------------------------------------------------------------------- the config


@pytest.mark.parametrize(("kw", "msg"), [
    ({"idle_low": 0.2, "idle_high": 0.1}, "idle_low: must be below idle_high"),
    ({"keep": 1.2, "headroom": 1.1}, "keep: must be at most headroom"),
    ({"min_servers": 4, "max_servers": 2}, "max_servers: must be >= min_servers"),
    ({"max_servers": 2000}, "max_servers: must be >= 1 and <= 1024 or null, got 2000"),
])
def test_a_bad_policy_setting_is_refused_naming_it(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AutoscaleConfig(enabled=True, **kw)


def test_the_sections_cap_is_the_launchers():
    from areal_fast.elastic.members import MAX_SERVERS
    from areal_fast.rollout.config import AUTOSCALE_MAX_SERVERS

    assert AUTOSCALE_MAX_SERVERS == MAX_SERVERS


def test_the_rollout_section_checks_the_policy_against_its_servers():
    r = RolloutConfig(n_servers=2, autoscale=AutoscaleConfig(enabled=True))
    assert r.autoscale.max_servers == 2  # null: n_servers
    with pytest.raises(ValueError, match="n_servers: the run starts with 5 servers, outside"):
        RolloutConfig(n_servers=5, autoscale=AutoscaleConfig(enabled=True, max_servers=3))
    with pytest.raises(ValueError, match="gpus: one entry per server the policy may start"):
        RolloutConfig(n_servers=1, gpus=["0"], autoscale=AutoscaleConfig(enabled=True, max_servers=2))
    assert RolloutConfig(n_servers=1, gpus=["0", "1"], autoscale=AutoscaleConfig(enabled=True, max_servers=2))
    assert not RolloutConfig().autoscale.enabled  # off by default


# ----------------------------------------------------------------------------- the run's autoscaler


class _Membership:
    joining: list = []


class _Syncer:
    membership = _Membership()


class _Pool:
    def __init__(self, n):
        self.urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]


def _members(out, n):
    write_members(out, [Member(f"s{i}", f"http://127.0.0.1:{9000 + i}", i) for i in range(n)], target=n)


def _train(step, idle):
    busy = 11.0
    return {"kind": "train", "step": step, "wait_s": idle * busy / (1 - idle), "train_s": 10.0, "sync_s": 1.0,
            "tokens": 10_000, "buffer_at_ask": B, "staleness_mean": 1.0, "gen_len_mean": 500.0,
            "gen_tokens_per_s": 0.0}


def test_the_autoscaler_writes_the_launchers_target_and_emits_each_decision(tmp_path):
    _members(tmp_path, 2)
    records = []
    a = Autoscaler(cfg(), tmp_path, _Pool(2), _Syncer(), records.append, servers=2, eta=ETA, batch_groups=B)
    for s in (1, 2, 3):
        a.on_record(_train(s, 0.5))
    assert read_target(tmp_path).n_servers == 3  # +50 % at most: 2 -> 3
    assert [r["autoscale/change"] for r in records] == [0, 0, 1]
    assert records[-1]["kind"] == "autoscale" and "trainer idle 50%" in records[-1]["reason"]
    assert records[-1]["autoscale/idle"] == pytest.approx(0.5)
    state = json.loads((servers_dir(tmp_path) / "autoscale.json").read_text())
    assert state["target"] == 3 and state["last"]["change"] == 1
    a.on_record(_train(4, 0.5))  # the launcher has not started the third yet: a hold, nothing written
    assert records[-1]["autoscale/change"] == 0 and records[-1]["reason"].startswith("waiting")
    a.on_record({"kind": "eval", "step": 4, "eval_reward": 1.0})  # not a step of training: nothing
    assert len(records) == 4


def test_scale_pins_the_count_at_once_and_the_policy_keeps_it_until_auto(tmp_path):
    _members(tmp_path, 2)
    records = []
    a = Autoscaler(cfg(), tmp_path, _Pool(2), _Syncer(), records.append, servers=2, eta=ETA, batch_groups=B)
    out = scale_command(tmp_path, "5")
    assert out["bound"] == (5, 5) and out["target"] == 5 and out["autoscale"]["enabled"]
    a._apply_hand(step=0)  # what Autoscaler.watch does every 0.5 s
    assert a.policy.target == 5 and records[-1]["reason"] == "bound 5..5 by hand"
    _members(tmp_path, 5)
    a.rollout = _Pool(5)
    for s in range(1, 8):  # the trainer never waits and the buffer is full: still 5
        a.on_record({**_train(s, 0.01), "buffer_at_ask": 4 * B, "staleness_mean": ETA})
    assert a.policy.target == 5 and read_target(tmp_path).n_servers == 5
    scale_command(tmp_path, "auto")
    assert read_scale(tmp_path) is None
    for s in range(8, 12):
        a.on_record({**_train(s, 0.01), "buffer_at_ask": 4 * B, "staleness_mean": ETA})
    assert a.policy.target < 5 and read_target(tmp_path).n_servers == a.policy.target


def test_a_target_set_with_areal_fast_servers_becomes_the_policys_start(tmp_path):
    from areal_fast.elastic.members import servers_command

    _members(tmp_path, 2)
    records = []
    a = Autoscaler(cfg(), tmp_path, _Pool(2), _Syncer(), records.append, servers=2, eta=ETA, batch_groups=B)
    servers_command("set", tmp_path, "4")
    a.on_record(_train(1, 0.5))
    assert a.policy.target == 4 and records[-1]["reason"].startswith("waiting: 2 of 4")  # not stuck on its own 2


@pytest.mark.parametrize(("args", "msg"), [
    (("0",), "N must be in 1..1024"), (("lots",), "expected a number of servers or 'auto'"),
    ((None, 4, 2), "--min 4 is above --max 2"), (("3", 1), "give N, or --min/--max, not both"),
    ((None,), "give N, 'auto', or --min"),
])
def test_scale_refuses_a_bad_bound_and_writes_nothing(tmp_path, args, msg):
    _members(tmp_path, 2)
    with pytest.raises(ValueError, match=msg):
        scale_command(tmp_path, *args)
    assert read_scale(tmp_path) is None and read_target(tmp_path) is None


def test_the_scale_command_line(tmp_path, capsys):
    from areal_fast.cli import main

    _members(tmp_path, 2)
    assert main(["scale", str(tmp_path), "3"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == 3 and read_target(tmp_path).n_servers == 3
    assert main(["scale", str(tmp_path), "--min", "2", "--max", "4"]) == 0 and read_scale(tmp_path) == (2, 4)
    with pytest.raises(SystemExit) as e:
        main(["scale", str(tmp_path), "0"])
    assert e.value.code == 2 and "N must be in 1..1024" in capsys.readouterr().err


def test_scale_refuses_a_directory_that_is_not_a_launched_run(tmp_path):
    with pytest.raises(ValueError, match="no servers/members.json"):
        scale_command(tmp_path, "2")


# ----------------------------------------------------------------------------- where decisions show


def test_the_progress_line_shows_the_pool_and_the_policys_change():
    p = AutoscalePolicy(cfg(), 4)
    for s in (1, 2, 3):
        d = p.step(reading(s, 4, idle=0.5))
    assert server_count(d.record()) == "4->6 (+2)"
    bar = ProgressBar(10, enabled=False)
    bar({"kind": "autoscale", **{k: v for k, v in d.record().items() if k != "kind"}})  # disabled: no error


def test_wandb_and_mlflow_get_each_decisions_scalars_under_their_names(tmp_path):
    from areal_fast.metrics.services import SinkState, _ServiceSink

    class Recorder(_ServiceSink):
        service = "recorder"
        sent: list = []

        def send(self, values, step):
            self.sent.append((step, values))

    p = AutoscalePolicy(cfg(), 4)
    for s in (1, 2, 3):
        d = p.step(reading(s, 4, idle=0.5))
    sink = Recorder(SinkState(tmp_path))
    sink(d.record())
    step, values = sink.sent[-1]
    assert step == 3 and values["autoscale/target"] == 6 and values["autoscale/change"] == 2
    assert values["autoscale/idle"] == pytest.approx(0.5) and "reason" not in values  # text stays in metrics.jsonl


@pytest.mark.skipif(importlib.util.find_spec("prometheus_client") is None, reason="needs prometheus-client")
def test_the_prometheus_endpoint_exposes_the_policys_target_readings_and_changes():
    from areal_fast.metrics.prometheus import ControllerExporter

    p = AutoscalePolicy(cfg(), 4)
    for s in (1, 2, 3):
        d = p.step(reading(s, 4, idle=0.5))
    ex = ControllerExporter(port=0)
    try:
        ex.observe(d.record())
        text = ex.exposition().decode()
    finally:
        ex.close()
    assert "areal_fast_autoscale_target_servers 6.0" in text
    assert "areal_fast_autoscale_trainer_idle_fraction 0.5" in text
    assert "areal_fast_autoscale_changes_total 1.0" in text


class _SlowExitLauncher:
    """A launcher whose removed servers take long to exit: ``begin_stop`` only signals; a blocking
    ``stop_process`` on a removal would hold the supervisor's tick (and the next start) for its grace."""

    def __init__(self):
        from types import SimpleNamespace

        self.ns, self.started, self.signalled, self.exited = SimpleNamespace, [], [], set()

    def proc(self, name, url, slot):
        from areal_fast.launch.base import LaunchedProcess

        p = LaunchedProcess(name=name, log_path=Path("/dev/null"), url=url, critical=False)
        p.extra["slot"] = slot
        p.alive = lambda: url not in self.exited  # type: ignore[method-assign]
        return p

    def start_server(self, rollout_cfg, model_path, slot, name, *, seed, key_file):
        self.started.append(slot)
        return self.proc(name, f"http://127.0.0.1:{41000 + len(self.started)}", slot)

    def begin_stop(self, p):
        self.signalled.append(p.url)

    def stop_process(self, p, grace):
        raise AssertionError("a removal waited for its server to exit")

    def private_dir(self):
        return Path("/nonexistent")


def test_a_removed_server_slow_to_exit_does_not_hold_up_the_next_start(tmp_path, monkeypatch):
    """A removal then an addition (the policy's down-then-up): the removed server is signalled and
    left to exit while the tick goes on, so the addition starts at once, in another slot while the
    old one still holds its own; past the grace period it is killed."""
    from types import SimpleNamespace

    from areal_fast.elastic import supervisor
    from areal_fast.elastic.members import Target, write_pool, write_target

    killed: list[str] = []
    monkeypatch.setattr(supervisor, "kill_now", lambda p: killed.append(p.url))
    launcher = _SlowExitLauncher()
    servers = [launcher.proc(f"server{i}", f"http://127.0.0.1:{40000 + i}", i) for i in range(2)]
    rollout = SimpleNamespace(relaunch_servers=True, health_timeout=300.0, gpus=[])
    sup = supervisor.ServerSupervisor(launcher, rollout, "/m", tmp_path, seed=0, api_key=None, servers=servers)
    write_target(tmp_path, Target(1))
    write_pool(tmp_path, [servers[0].url], [])  # rank 0 let it go
    sup.tick()
    assert launcher.signalled == [servers[1].url] and servers[1].url in sup.stopping
    write_target(tmp_path, Target(2))
    sup.tick()  # no wait for the exit: the start happens in this tick
    assert launcher.started == [2], launcher.started  # slot 1 is still the exiting server's
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 0.0)
    sup.tick()
    assert killed == [servers[1].url] and not sup.stopping


def test_the_most_servers_the_policy_may_start_are_checked_against_the_ray_cluster():
    """On Ray, ``max_servers`` server bundles against the cluster's resources before any server starts
    (``RayLauncher._check_policy_room``: refused on a Ray the run started, a warning on one it joined);
    each short resource named with what the cluster has."""
    from areal_fast.launch.ray_launcher import policy_shortfall

    cluster = {"CPU": 16.0, "GPU": 8.0, "inference": 4.0}
    assert policy_shortfall(cluster, {"CPU": 2.0, "GPU": 1}, 8) == []
    assert policy_shortfall(cluster, {"CPU": 2.0, "GPU": 2}, 6) == ["GPU 12 (the cluster has 8)"]
    assert policy_shortfall(cluster, {"CPU": 1.0, "inference": 1}, 5) == ["inference 5 (the cluster has 4)"]
    assert policy_shortfall({"CPU": 4.0}, {"CPU": 1.0, "GPU": 1}, 2) == ["GPU 2 (the cluster has 0)"]


def test_on_a_ray_the_run_started_too_many_servers_are_refused_naming_the_key(monkeypatch, caplog):
    from types import SimpleNamespace

    from areal_fast.launch import ray_launcher
    from areal_fast.launch_config import RayConfig

    monkeypatch.setattr(ray_launcher, "_ray", lambda: SimpleNamespace(cluster_resources=lambda: {"CPU": 4.0}))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    launcher = object.__new__(ray_launcher.RayLauncher)
    launcher.cfg = RayConfig()
    launcher._check_policy_room({"CPU": 1.0}, 4)  # fits: nothing said
    with pytest.raises(ValueError, match=r"rollout\.autoscale\.max_servers: 5 servers .* CPU 5 \(the cluster has 4\)"):
        launcher._check_policy_room({"CPU": 1.0}, 5)
    launcher.cfg = RayConfig(address="ray://head:10001")  # a cluster that may add nodes: a warning
    launcher._check_policy_room({"CPU": 1.0}, 5)
    assert "rollout.autoscale.max_servers" in caplog.text and "adds nodes" in caplog.text
