"""Hostile or damaged files in a run's output directory: an edited or
truncated checkpoint is moved aside and the previous one used; no readable checkpoint is an
error, never a silent restart at step 0; planted symlinks are not followed; a directory that is
not ours, or not a run, is refused; the API key never reaches a file; the trainer's own process
group listens on no TCP port."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fakes import GroupListTrainer, make_controller

from areal_fast.checkpoint import CorruptCheckpoint, latest_checkpoint, list_checkpoints

# ----------------------------------------------------------------------------- checkpoints


def _run_with_checkpoints(tmp_path, steps=4):
    ctl, _, _ = make_controller(tmp_path, eta=2, steps=steps, ckpt=1)
    asyncio.run(ctl.run())
    return list_checkpoints(tmp_path / "checkpoints")


def _edit_state(ck: Path, edit) -> None:
    st = json.loads((ck / "controller.json").read_text())
    edit(st)
    (ck / "controller.json").write_text(json.dumps(st))


EDITS = {
    "version as a string": lambda st: st.update(version=str(st["version"])),
    "version a boolean": lambda st: st.update(version=True),
    "negative position": lambda st: st.update(position=-1),
    "unknown entry": lambda st: st.update(note="hi"),
    "unknown counter": lambda st: st["counters"].update(bogus=1),
    "counter a float": lambda st: st["counters"].update(admitted=1.5),
    "pending twice": lambda st: st.update(pending=[1, 1]),
    "pending past position": lambda st: st.update(pending=[st["position"] + 5]),
    "buffer file elsewhere": lambda st: st["buffer_file"].update(name="../../etc/passwd"),
    "elapsed not a number": lambda st: st.update(elapsed="NaN"),
    "elapsed past a float": lambda st: st.update(elapsed=10**400),  # math.isfinite overflows on it
    "a timer past a float": lambda st: st.update(timers={"wait_s": -(10**400)}),
    "timers a list": lambda st: st.update(timers=[1]),
    # consistency with the trainer state and with what the position accounts for
    "version ahead of the trainer": lambda st: st.update(version=st["version"] + 1),
    "position behind the trained groups": lambda st: st.update(position=1),
}


class VersionedTrainer(GroupListTrainer):
    """A trainer whose check returns the version it holds, as the real one does (positions / B)."""

    def check(self, path: Path):
        return len(json.loads((path / "t.json").read_text())) // 2


def _make_versioned(tmp_path, **kw):
    ctl, _, server = make_controller(tmp_path, eta=2, ckpt=1, **kw)
    ctl.trainer = trainer = VersionedTrainer()
    return ctl, trainer


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_an_edited_controller_state_is_corrupt_and_the_previous_checkpoint_is_used(tmp_path, edit, caplog):
    cks = _run_with_checkpoints(tmp_path)
    newest = cks[-1]
    _edit_state(newest, EDITS[edit])
    ctl, trainer = _make_versioned(tmp_path, steps=6)
    with caplog.at_level("WARNING"):
        assert ctl.restore_newest() == cks[-2]
    assert ctl.version == 3 and len(trainer.trained) == 6
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").is_dir()
    assert "controller.json" in caplog.text or "version" in caplog.text


class ShardTruncatedTrainer(GroupListTrainer):
    """check passes (it reads only the small files), load finds the damage, as a truncated DCP
    shard shows itself only when the tensors are read."""

    def __init__(self, bad: set[str]):
        super().__init__()
        self.bad = bad

    def load(self, path: Path):
        if path.parent.name in self.bad:
            raise CorruptCheckpoint(f"{path}/__0_0.distcp: truncated")
        super().load(path)


def test_a_trainer_load_failure_moves_the_checkpoint_aside_like_a_failed_check(tmp_path, caplog):
    cks = _run_with_checkpoints(tmp_path)
    ctl, _, _ = make_controller(tmp_path, eta=2, steps=6, ckpt=1)
    ctl.trainer = trainer = ShardTruncatedTrainer({cks[-1].name})
    with caplog.at_level("WARNING"):
        assert ctl.restore_newest() == cks[-2]
    assert ctl.version == 3 and trainer.trained and cks[-1].with_name(cks[-1].name + ".corrupt").is_dir()
    assert "truncated" in caplog.text and "falling back" in caplog.text
    asyncio.run(ctl.run())  # the run goes on from the previous checkpoint, nothing trained twice
    assert ctl.version == 6 and len(trainer.trained) == len(set(trainer.trained)) == 12


def test_no_readable_checkpoint_is_an_error_not_a_silent_restart_at_step_zero(tmp_path):
    cks = _run_with_checkpoints(tmp_path, steps=2)
    for ck in cks:
        (ck / "controller.json").write_text("{")
    ctl, _, _ = make_controller(tmp_path, eta=2, steps=4, ckpt=1)
    with pytest.raises(CorruptCheckpoint) as e:
        ctl.restore_newest()
    msg = str(e.value)
    assert "no readable checkpoint" in msg and "experiment.resume=false" in msg and "step_00000002" in msg
    assert ctl.version == 0
    again, _, _ = make_controller(tmp_path, eta=2, steps=4, ckpt=1)  # the same command again: still refused
    with pytest.raises(CorruptCheckpoint, match="no readable checkpoint"):
        again.restore_newest()
    fresh, _, _ = make_controller(tmp_path / "elsewhere", eta=2, steps=4, ckpt=1)
    assert fresh.restore_newest() is None  # no checkpoint ever: a new run, as before
    assert latest_checkpoint(tmp_path / "checkpoints") is None


# ----------------------------------------------------------------------------- the output directory

import os  # noqa: E402
import stat  # noqa: E402

from areal_fast.launch.base import PrivateFileHandler, open_private_log  # noqa: E402
from areal_fast.launch.run_dir import (  # noqa: E402
    LOCK_FILE,
    NotARunDir,
    RunLock,
    UnsafeOutputDir,
    check_output_dir,
    is_checked_entry,
    move_previous_run_aside,
)


def _planted(tmp_path, link: Path) -> Path:
    """A symlink at ``link`` to a victim file outside the run; returns the victim."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return victim


def _untouched(victim: Path) -> None:
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


def test_a_symlink_planted_as_the_lock_file_is_not_followed(tmp_path):
    out = tmp_path / "run"
    victim = _planted(tmp_path, out / LOCK_FILE)
    with pytest.raises(UnsafeOutputDir, match="symlink"):
        with RunLock(out):
            pass
    _untouched(victim)


@pytest.mark.parametrize("opener", ["server log", "controller log"])
def test_a_symlink_planted_as_a_log_is_not_followed(tmp_path, opener):
    log = tmp_path / "run" / "logs" / "server0.log"
    victim = _planted(tmp_path, log)
    with pytest.raises(UnsafeOutputDir, match="symlink"):
        if opener == "server log":
            open_private_log(log).close()
        else:
            PrivateFileHandler(log).close()
    _untouched(victim)


def test_logs_and_the_lock_are_created_private(tmp_path):
    out = tmp_path / "run"
    with RunLock(out):
        pass
    with open_private_log(out / "a.log") as f:
        f.write(b"x")
    for p in (out / LOCK_FILE, out / "a.log"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_a_world_writable_output_directory_is_refused(tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, 0o1777)  # like /tmp: anyone can plant a 'logs' symlink before the run makes it
    with pytest.raises(UnsafeOutputDir, match="writable by every user"):
        check_output_dir(out)
    with pytest.raises(UnsafeOutputDir):
        with RunLock(out):
            pass
    assert not (out / LOCK_FILE).exists()
    os.chmod(out, 0o755)
    check_output_dir(out)


def test_an_output_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "theirs"
    out.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(out).st_uid + 1)  # as if it belonged to someone else
    with pytest.raises(UnsafeOutputDir, match="belongs to uid"):
        check_output_dir(out)


@pytest.fixture
def umask_002():
    """A permissive umask, as many shared machines set it (files 0664, directories 0775)."""
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


def test_a_group_writable_output_directory_is_refused(tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, 0o770)  # a member of the group could plant a 'checkpoints' or 'metrics.jsonl' symlink
    with pytest.raises(UnsafeOutputDir, match=f"{out} is writable by its group \\(mode 0770\\).*chmod g-w {out}"):
        check_output_dir(out)
    with pytest.raises(UnsafeOutputDir, match="writable by its group"):
        with RunLock(out):
            pass
    assert not (out / LOCK_FILE).exists()
    os.chmod(out, 0o750)
    check_output_dir(out)


def test_an_output_directory_created_under_a_permissive_umask_is_accepted_and_kept_private(tmp_path, umask_002):
    """The run makes its output directory (and everything in it) writable by its user alone, whatever
    the umask, so the next start does not refuse what this one made."""
    out = tmp_path / "new" / "run"
    with RunLock(out):
        (out / "checkpoints" / "step_00000001").mkdir(parents=True)
        (out / "metrics.jsonl").write_text("{}\n")
    for p in (out, out / "checkpoints", out / "checkpoints" / "step_00000001", out / "metrics.jsonl"):
        assert not p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), (p, oct(p.stat().st_mode))
    with RunLock(out):  # the next start accepts it
        pass


@pytest.mark.parametrize("name", ["checkpoints", "logs", "final", "warm_start", "slurm", "tracking", "servers",
                                  ".secrets", "weights_sync", "slurm-77.out"])
def test_a_run_directory_planted_as_a_symlink_is_refused_at_start(tmp_path, name):
    """A planted ``checkpoints`` symlink would steer what the next resume loads (and where it writes); a
    planted ``slurm`` one would take the Slurm steps' specs (``trainer.json``: the command every rank
    runs) into the planter's directory, a ``tracking`` one the W&B and MLflow state."""
    out = tmp_path / "run"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "step_00000009").mkdir(parents=True)
    (out / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafeOutputDir, match=f"{out / name} is a symlink"):
        with RunLock(out):
            pass
    with pytest.raises(UnsafeOutputDir, match="symlink"):
        check_output_dir(out)


@pytest.mark.parametrize("where", ["checkpoints/step_00000001", "checkpoints/step_00000001/controller.json",
                                   "logs"])
def test_a_group_writable_entry_of_the_run_is_refused_at_start(tmp_path, where):
    """What a resume reads back (checkpoints) or the run writes into must not be changeable by the group
    (a directory made under umask 002 by an earlier version is one)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000001").mkdir(parents=True)
    (out / "checkpoints" / "step_00000001" / "controller.json").write_text("{}")
    (out / "logs").mkdir()
    os.chmod(out / where, 0o775 if (out / where).is_dir() else 0o664)
    with pytest.raises(UnsafeOutputDir, match=f"{out / where} is writable by its group.*chmod -R g-w {out}"):
        check_output_dir(out)
    os.chmod(out / where, 0o755 if (out / where).is_dir() else 0o644)
    check_output_dir(out)


def _write_what_a_run_writes(out: Path) -> None:
    """What the launchers and the metric services create in a run's output directory, each by its own
    code: the lock, configs, logs, metrics, summary, the Slurm steps' files, the tracking state, the
    members files, the kept servers' key."""
    from areal_fast.config import load_config, save_config
    from areal_fast.elastic.members import Member, write_members
    from areal_fast.launch import reuse, slurm
    from areal_fast.launch.rank import write_summary
    from areal_fast.launch_config import SlurmConfig
    from areal_fast.metrics.services import SinkState
    from areal_fast.metrics.sinks import JsonlSink

    with RunLock(out):
        save_config(load_config(None), out / "config.yaml")
        (out / "logs").mkdir()
        open_private_log(out / "logs" / "launcher.log").close()
        for name in ("metrics.jsonl", "samples.jsonl"):
            sink = JsonlSink(out / name)
            sink({"step": 1})
            sink.close()
        write_summary(out, {"steps": 1})
        launcher = slurm.SlurmLauncher(out / "logs", SlurmConfig(job="5"), run_dir=out)
        launcher._closed = True  # nothing started: nothing to stop
        (out / slurm.SBATCH_OUTPUT.replace("%j", "5")).write_text("the batch script's output\n")
        SinkState(out).save()
        write_members(out, [Member("server0", "http://127.0.0.1:1", 0, pid=1)], model="/m")
        reuse.save_key(out, "k" * 64)


def test_every_entry_a_run_writes_is_checked_at_start(tmp_path):
    """Whatever the run's own code writes at the top of its output directory, a symlink planted in its
    place is refused at the next start (none is left out of the checked entries)."""
    import shutil

    out = tmp_path / "run"
    _write_what_a_run_writes(out)
    entries = sorted(p.name for p in out.iterdir())
    assert {"slurm", "tracking", "servers", ".secrets", "slurm-5.out"} <= set(entries), entries
    assert all(is_checked_entry(n) for n in entries), entries
    check_output_dir(out)  # as written: accepted
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in entries:
        aside = tmp_path / "aside"
        os.rename(out / name, aside)
        (out / name).symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(UnsafeOutputDir, match=f"{out / name} is a symlink"):
            check_output_dir(out)
        (out / name).unlink()
        os.rename(aside, out / name)
    shutil.rmtree(elsewhere)
    check_output_dir(out)


def test_a_symlink_inside_the_checkpoints_is_refused_at_start(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (out / "checkpoints" / "step_00000009").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UnsafeOutputDir, match="step_00000009 is a symlink"):
        check_output_dir(out)


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "metrics.jsonl.tmp", "summary.json"])
def test_a_symlink_planted_as_a_metrics_summary_or_temporary_file_is_not_followed(tmp_path, name):
    from areal_fast.metrics.sinks import JsonlSink, truncate_jsonl

    out = tmp_path / "run"
    out.mkdir()
    victim = _planted(tmp_path, out / name)
    with pytest.raises(UnsafeOutputDir, match=f"{out / name} is a symlink"):
        if name == "summary.json":
            from areal_fast.launch.rank import write_summary

            write_summary(out, {"steps": 1})
        elif name.endswith(".tmp"):  # the rewrite of metrics.jsonl at resume goes through a temporary file
            (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
            truncate_jsonl(out / "metrics.jsonl", 1)
        else:
            JsonlSink(out / name)({"step": 1})
    _untouched(victim)
    if name == "metrics.jsonl":  # nor read through at resume (its lines would be copied into the run)
        with pytest.raises(UnsafeOutputDir, match="symlink"):
            truncate_jsonl(out / name, 0)
        _untouched(victim)


def test_metrics_summary_and_their_rewrite_are_written_private(tmp_path):
    from areal_fast.launch.rank import write_summary
    from areal_fast.metrics.sinks import JsonlSink, read_jsonl, truncate_jsonl

    out = tmp_path / "run"
    out.mkdir()
    sink = JsonlSink(out / "metrics.jsonl")
    for step in (1, 2, 3):
        sink({"step": step})
    sink.close()
    (out / "metrics.jsonl.tmp").write_text("left by a crash")  # a leftover temporary of ours is replaced
    truncate_jsonl(out / "metrics.jsonl", 2)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert not (out / "metrics.jsonl.tmp").exists()
    write_summary(out, {"steps": 2})
    write_summary(out, {"steps": 3})
    assert json.loads((out / "summary.json").read_text()) == {"steps": 3}
    for name in ("metrics.jsonl", "summary.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name


@pytest.mark.parametrize("foreign", [".git", "src", ".ssh", "notes.txt"])
def test_a_fresh_start_refuses_a_directory_that_is_not_a_run(tmp_path, foreign):
    out = tmp_path / "project"
    (out / foreign).mkdir(parents=True)
    (out / "README.md").write_text("mine")
    with pytest.raises(NotARunDir, match="does not look like the output directory of a run"):
        move_previous_run_aside(out, print)
    assert (out / foreign).is_dir() and (out / "README.md").read_text() == "mine"  # nothing moved
    assert not list(tmp_path.glob("project.previous-*"))


def test_a_fresh_start_still_moves_a_run_and_a_run_that_died_early(tmp_path):
    from areal_fast.config import load_config, save_config

    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000001").mkdir(parents=True)
    save_config(load_config(None), out / "config.yaml")
    (out / "my_notes.txt").write_text("kept with the run")  # our config.yaml: the run is ours to move
    assert move_previous_run_aside(out, print) is not None
    early = tmp_path / "early"
    (early / "logs").mkdir(parents=True)  # died before config.yaml: only what a run writes
    (early / "logs" / "launcher.log").write_text("x")
    assert move_previous_run_aside(early, print) is not None


# ----------------------------------------------------------------------------- the API key

SECRET = "0123456789abcdef-very-secret-key"


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def test_the_api_key_is_never_written_and_the_saved_configs_are_private(tmp_path):
    from areal_fast.config import load_config, save_config
    from areal_fast.launch.base import TRAINER_CONFIG_FILE
    from areal_fast.launch.train import trainer_run_config

    cfg = load_config(None, [f"api_key={SECRET}", "rollout.servers=[http://127.0.0.1:1]"])
    out = tmp_path / "run"
    out.mkdir()
    save_config(cfg, out / "config.yaml")
    tcfg = trainer_run_config(cfg, "/m", ["http://127.0.0.1:1"], out)
    save_config(tcfg, out / TRAINER_CONFIG_FILE)
    assert _files_holding(out, SECRET.encode()) == []
    for name in ("config.yaml", TRAINER_CONFIG_FILE):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert load_config(out / "config.yaml").api_key is None


def test_client_and_weight_sync_use_one_key(tmp_path, monkeypatch):
    """Launched servers get a fresh key; the ranks read it from their environment for both the
    client and the weight sync, even when the config names another key. External servers: the
    configured key is the run's key (the client used to send none)."""
    from areal_fast.backends.server_command import server_kind
    from areal_fast.config import load_config
    from areal_fast.launch.base import API_KEY_ENV
    from areal_fast.launch.train import run_api_key, trainer_run_config

    cfg = load_config(None, [f"api_key={SECRET}"])
    fresh = run_api_key(cfg, server_kind(cfg.rollout))
    assert fresh and fresh != SECRET
    tcfg = trainer_run_config(cfg, "/m", ["http://127.0.0.1:1"], tmp_path)
    monkeypatch.setenv(API_KEY_ENV, fresh)  # what the launcher gives every rank
    assert tcfg.weights.resolved_api_key == fresh  # the sync's key (the client takes the same property)
    external = load_config(None, [f"api_key={SECRET}", "rollout.servers=[http://127.0.0.1:1]"])
    monkeypatch.delenv(API_KEY_ENV)
    assert run_api_key(external, server_kind(external.rollout)) == SECRET


# ----------------------------------------------------------------------------- the trainer's process group

LISTENERS = r"""
import os, torch, torch.distributed as dist
from areal_fast.trainer.model import init_process_group_if_needed
os.environ.pop("RANK", None)
init_process_group_if_needed(torch.device("cpu"))
x = torch.ones(2); dist.all_reduce(x)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):
    store = store.underlying_store
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        mine.add(target[8:-1])
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in mine:  # LISTEN, one of ours
            print("listen", f[1].split(":")[0])
print("store", type(store).__name__)
"""


@pytest.mark.slow  # a subprocess with its own default process group
def test_a_world_of_one_trainer_group_hosts_no_tcp_store_and_listens_on_loopback_only():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME")}
    out = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert "store HashStore" in lines, out.stdout
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net writes them
    listening = [ln.split()[1] for ln in lines if ln.startswith("listen ")]
    assert all(a in loopback for a in listening), f"listening beyond loopback: {listening}"


# ----------------------------------------------------------------------------- IPv6


def test_find_free_port_takes_an_ipv6_host():
    import socket

    from areal_fast.netutil import find_free_port, url_host

    for host in ("::1", "[::1]"):
        port = find_free_port(host)
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", port))  # free, and on ::1
    assert url_host("::1") == url_host("[::1]") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize("addr", ["::1", "[::1]"])
def test_the_weight_group_rendezvous_works_over_ipv6(addr):
    """weights.master_addr=::1: the store listens on ::1 and the server joins at tcp://[::1]:port."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from fakes import FakeServer
    from test_weights_session import _assert_received, _cfg, _state

    from areal_fast.backends.sglang.weight_sync import DistributedWeightSync

    s = FakeServer()
    ws = DistributedWeightSync([s.url], _cfg(master_addr=addr))
    try:
        ws.connect()
        assert ws.pg is not None and s.pg is not None
        ws.update(_state(), 3)
        _assert_received(s, _state())
    finally:
        ws.close()
        s.close()
