"""Elastic inference servers: the launcher keeps a run's servers at their target number.

:class:`ServerSupervisor` runs in the launching process, in a thread, for the whole run (the local
launcher with its rank in-process, the local launcher with rank processes, the Ray launcher):

    sup = ServerSupervisor(launcher, cfg.rollout, model, out, seed=..., api_key=key, servers=started)
    sup.start()                           # members.json written: rank 0 may read it
    ...                                   # every 0.5 s: tick()
    sup.stop()

Each tick:

1. a member whose process is gone (kill -9, a crash, a lost Ray node) leaves ``members.json``;
2. the target (``rollout.n_servers``, then ``servers/target.json`` from ``areal-fast servers``) is
   compared with the members and the servers starting: a missing one is started in the lowest free
   slot (its GPU is ``rollout.gpus[slot]``), with the run's key in a private file removed once it
   is healthy; at most ``MAX_STARTS_PER_TICK`` a tick, so a large target is reached a few servers
   every 0.5 s instead of all of them spawned back to back. A target file above
   ``members.MAX_SERVERS`` (one written by hand: the command refuses it) is refused with an error
   and the target kept. A death therefore becomes a relaunch (``rollout.relaunch_servers=false``:
   the target drops instead). Five failed starts in a row stop the relaunching (logged as an error);
3. a started server is recorded in ``members.json`` under ``starting`` (pid, URL, slot) from the
   moment it is launched, so a resume after a kill -9 of the launcher can stop or adopt it
   (``launch.reuse``); once it answers /health 200 it becomes a member. Rank 0 (``launch.rank``) then offers
   it to the weight sync: it gets the next update in full, over a re-formed broadcast group, and
   only then enters the pool (``weights.membership``);
4. a server above the target leaves ``members.json`` first; it is stopped once rank 0's
   ``pool.json`` no longer lists it (its requests have finished or failed over), or after 30 s.
   With a launcher that can signal a stop without waiting (``begin_stop``: the local and Slurm ones) the tick
   sends SIGTERM and goes on, and a later tick SIGKILLs it past ``STOP_GRACE_S``: a server slow to
   exit never holds up the next start (a removal followed by an addition); its slot stays taken
   until it is gone;
5. a member that rank 0 dropped (``pool.json``, written after it became a member, lists it neither in
   the pool nor joining) while its process lives is asked GET /model_info in a thread, with
   ``rollout.hang_timeout`` as the deadline (``elastic.liveness.server_state``). No answer (hung:
   SIGSTOPped, deadlocked): its process group is killed with SIGKILL and step 1 relaunches it in its
   slot. An answer (merely slow): it is left alone, asked again after ``hang_timeout``, and rank 0
   offers it again once its /health answers (``elastic.pool_watch``).

The files are described in ``elastic.members``; the user's side in ``docs/elastic.md``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from areal_fast.elastic import liveness
from areal_fast.elastic.liveness import DEFAULT_HANG_TIMEOUT_S, server_ready  # the default: a config without it
from areal_fast.elastic.members import MAX_SERVERS, TARGET_FILE, Member, read_pool, read_target, write_members
from areal_fast.elastic.port_owner import PortTaken, check_listener, nobody_listens, on_this_machine

log = logging.getLogger(__name__)


class ServerProcess(Protocol):
    """What the supervisor reads of a server's process handle (a launcher's ``LaunchedProcess``)."""

    name: str
    url: str | None
    pid: int | None
    node: str
    log_path: Path
    popen: Any  # a local process's Popen, else None
    actor: Any  # the Ray host actor of a remote one, else None
    extra: dict

    def alive(self) -> bool: ...

    def death_message(self) -> str: ...


class ServerLauncher(Protocol):
    """What the supervisor asks of the run's launcher (``LocalLauncher``, ``SlurmLauncher``, ``RayLauncher``;
    a launcher that holds places for its servers, Ray's placement groups, also has ``release_dead(p)``)."""

    def start_server(self, rollout_cfg, model_path: str, slot: int, name: str, *, seed: int,
                     key_file: Path | None) -> ServerProcess: ...  # started now, not waiting for its health

    def stop_process(self, p: ServerProcess, grace: float) -> None: ...

    # optional: begin_stop(p) sends the stop signal and returns at once (the local and Slurm launchers)

    def private_dir(self) -> Path: ...  # the launcher's private directory (0700) for key files: part of its API
TICK_S = 0.5
DRAIN_S = 30.0  # a removed server leaves the pool within a step; past this it is stopped anyway
MAX_FAILED_STARTS = 5  # in a row: a server that cannot start (bad node, no memory) is not retried forever
MAX_STARTS_PER_TICK = 4  # servers launched in one tick (each a process or a Ray actor): the rest next ticks
STOP_GRACE_S = 10.0


@dataclass
class _Starting:
    slot: int
    proc: ServerProcess
    key_file: Path | None
    t0: float
    unheard: bool = False  # its /health answered while nobody listened on its port (``_own_port``)


class ServerSupervisor:
    """Keeps the launched servers of one run at their target number (module docstring)."""

    def __init__(self, launcher: ServerLauncher, rollout_cfg, model_path: str, out: str | Path, *, seed: int,
                 api_key: str | None,
                 servers: list[ServerProcess], secrets_dir: Path | None = None, target: int | None = None):
        self.launcher, self.cfg, self.model_path, self.out = launcher, rollout_cfg, model_path, Path(out)
        self.seed, self.api_key, self.secrets_dir = seed, api_key, secrets_dir
        self.relaunch = rollout_cfg.relaunch_servers
        self.members: dict[int, ServerProcess] = dict(enumerate(servers))  # slot -> process
        self.starting: list[_Starting] = []
        self.leaving: dict[str, tuple[ServerProcess, float]] = {}
        self.stopping: dict[str, tuple[ServerProcess, float]] = {}  # url -> (SIGTERMed, monotonic time)
        self.target = len(servers) if target is None else target  # fewer servers (reused ones): the rest start
        self._target_seen = None  # the last target file read, so a stale one is applied once
        self.starts = len(servers)  # servers started so far (names and seeds of the next ones)
        self.failed_starts = 0
        self.relaunched = 0
        self.killed_hung = 0
        now = time.time()
        for p in servers:  # pool.json written after this saw them (wall clock: pool.json's own time)
            p.extra.setdefault("member_since", now)
        self._checks: dict[str, tuple[ServerProcess, Future]] = {}  # url -> liveness check in flight
        self._answered: dict[str, float] = {}  # url -> monotonic time of its last answer (not hung)
        self._pool_exec: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publish()

    # ------------------------------------------------------------ the thread
    def start(self) -> ServerSupervisor:
        self._thread = threading.Thread(target=self._loop, name="server-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for s in self.starting:
            self._forget_key(s)
        if self._pool_exec is not None:
            self._pool_exec.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the next tick tries again; the run goes on meanwhile
                log.exception("server supervisor tick failed")

    # ------------------------------------------------------------ one tick
    def tick(self) -> None:
        refresh = getattr(self.launcher, "refresh", None)
        if refresh is not None:  # Ray: exit codes come from the actors
            refresh()
        before = self._published_state()
        self._reap_dead()
        self._promote_started()
        self._apply_target()
        self._drain()
        self._kill_hung()
        if self._published_state() != before:
            self._publish()

    def _member_urls(self) -> list[str]:
        return [p.url for _, p in sorted(self.members.items())]

    def _published_state(self) -> tuple:
        return self._member_urls(), [s.proc.url for s in self.starting], self.target

    def _reap_dead(self) -> None:
        dead = [(slot, p) for slot, p in self.members.items() if not p.alive()]
        for slot, p in dead:
            del self.members[slot]
            self._release(p)
            if not self.relaunch:
                self.target -= 1
            log.warning("server %s (%s) died%s: %s", p.name, p.url,
                        "; relaunching it" if self.relaunch else "", p.death_message()[:500])

    def _promote_started(self) -> None:
        for s in list(self.starting):
            if not s.proc.alive():
                self._failed(s, f"it died while starting: {s.proc.death_message()[:1500]}")
            elif server_ready(s.proc.url) and self._own_port(s):
                self.starting.remove(s)
                self._forget_key(s)
                self.members[s.slot] = s.proc
                s.proc.extra["member_since"] = time.time()
                self.failed_starts = 0
                log.warning("server %s (%s) is up after %.1f s; it joins at the next weight update (at once "
                            "into an empty pool)", s.proc.name, s.proc.url, time.monotonic() - s.t0)
            elif s in self.starting and time.monotonic() - s.t0 > self.cfg.health_timeout:
                self._stop_proc(s.proc)
                waited = time.monotonic() - s.t0
                self._failed(s, str(nobody_listens(s.proc.name, s.proc.url, s.proc.pid, waited)) if s.unheard
                             else f"not healthy after {self.cfg.health_timeout:.0f} s")

    def _own_port(self, s: _Starting) -> bool:
        """``s`` answered /health: whether its port is its own (``port_owner``) before any keyed request
        reaches it. Another process's listener fails the start at once; nobody listening is asked again
        at the next tick, until ``rollout.health_timeout``."""
        p = s.proc
        try:
            own = check_listener(p.name, p.url, p.pid, local=on_this_machine(p))
        except PortTaken as e:
            self._stop_proc(p)
            self._failed(s, str(e))
            return False
        s.unheard = not own
        return own

    def _failed(self, s: _Starting, why: str) -> None:
        self.starting.remove(s)
        self._forget_key(s)
        self._release(s.proc)
        self.failed_starts += 1
        log.error("server %s (%s) failed to start (%d in a row): %s", s.proc.name, s.proc.url, self.failed_starts, why)
        if self.failed_starts == MAX_FAILED_STARTS:
            log.error("%d server starts failed in a row: no more servers are started for this run", MAX_FAILED_STARTS)

    def _apply_target(self) -> None:
        t = read_target(self.out)
        if t is not None and (t.n_servers, t.remove) != self._target_seen:
            self._target_seen = (t.n_servers, t.remove)
            if t.n_servers > MAX_SERVERS:  # written by hand (the command refuses it): said once, ignored
                log.error("server target %d in %s refused: a run may have at most %d servers "
                          "(members.MAX_SERVERS); the target stays %d", t.n_servers, TARGET_FILE, MAX_SERVERS,
                          self.target)
            else:
                log.warning("server target %d (was %d)%s", t.n_servers, self.target,
                            f", removing {t.remove}" if t.remove else "")
                self.target = t.n_servers
                for url in t.remove:
                    self._remove(url)
        while len(self.members) + len(self.starting) > self.target:
            if self.starting:  # not a member yet: stop it at once
                s = self.starting.pop()
                self._forget_key(s)
                self._stop_proc(s.proc)
                continue
            self._remove(self.members[max(self.members)].url)
        started = 0  # a few a tick: the next tick (0.5 s) starts the next few
        while (len(self.members) + len(self.starting) < self.target and self.failed_starts < MAX_FAILED_STARTS
               and started < MAX_STARTS_PER_TICK):
            if not self._start_one():
                break
            started += 1

    def _remove(self, url: str) -> None:
        for slot, p in list(self.members.items()):
            if p.url == url:
                del self.members[slot]
                self.leaving[url] = (p, time.monotonic())
                log.warning("server %s (%s) leaves the run: stopped once out of the pool", p.name, url)

    def _drain(self) -> None:
        pool = read_pool(self.out) or {}
        busy = set(pool.get("urls", [])) | set(pool.get("joining", []))
        for url, (p, t0) in list(self.leaving.items()):
            if url not in busy or time.monotonic() - t0 > DRAIN_S or not p.alive():
                del self.leaving[url]
                begin = getattr(self.launcher, "begin_stop", None)
                if begin is None:
                    self._stop_proc(p)
                    continue
                try:
                    begin(p)
                    self.stopping[url] = (p, time.monotonic())
                except Exception as e:  # noqa: BLE001 - the launcher's shutdown stops it at the end anyway
                    log.warning("stopping server %s: %s", p.name, e)
        for url, (p, t0) in list(self.stopping.items()):
            if not p.alive():
                del self.stopping[url]
            elif time.monotonic() - t0 > STOP_GRACE_S:
                del self.stopping[url]
                log.warning("server %s (%s) did not exit within %.0f s of SIGTERM: killed", p.name, url, STOP_GRACE_S)
                kill_now(p)

    # ------------------------------------------------------------ hung members
    def _kill_hung(self) -> None:
        """Step 5 of the module docstring: a member rank 0 dropped whose process lives but does not
        answer within ``rollout.hang_timeout`` is killed (SIGKILL); the next tick relaunches it."""
        pool = read_pool(self.out)
        hang_s = float(getattr(self.cfg, "hang_timeout", DEFAULT_HANG_TIMEOUT_S))
        in_pool = set(pool.get("urls", [])) | set(pool.get("joining", [])) if pool else set()
        for url, (p, fut) in list(self._checks.items()):
            if not fut.done():
                continue
            del self._checks[url]
            state = _verdict(fut)
            if state == "alive" or p not in self.members.values() or not p.alive():
                self._answered[url] = time.monotonic()
                continue
            log.warning("server %s (%s, pid %s) was dropped by rank 0 and does not answer GET /model_info "
                        "within rollout.hang_timeout=%.0fs (%s): killed (SIGKILL), relaunched in its slot",
                        p.name, url, p.pid, hang_s, state)
            self._kill(p)
            self.killed_hung += 1
        if pool is None:
            return
        for p in self.members.values():
            dropped = p.url not in in_pool and float(pool.get("time") or 0) > p.extra.get("member_since", 0.0)
            recent = time.monotonic() - self._answered.get(p.url, -1e9) < hang_s
            if dropped and not recent and p.url not in self._checks and p.alive():
                if self._pool_exec is None:
                    self._pool_exec = ThreadPoolExecutor(4, thread_name_prefix="hung-check")
                self._checks[p.url] = (p, self._pool_exec.submit(server_state, p.url, hang_s))

    # ------------------------------------------------------------ starting and stopping
    def _free_slot(self) -> int | None:
        used = set(self.members) | {s.slot for s in self.starting} | {_slot(p) for p, _ in self.leaving.values()} | \
            {_slot(p) for p, _ in self.stopping.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        if self.cfg.gpus and slot >= len(self.cfg.gpus):
            log.error("no GPU for another server: rollout.gpus names %d slot(s) and all are taken", len(self.cfg.gpus))
            return None
        return slot

    def _start_one(self) -> bool:
        slot = self._free_slot()
        if slot is None:
            return False
        from areal_fast.backends.keyfile import write_api_key_file

        name = f"server{slot}" if self.starts == slot else f"server{slot}-{self.starts}"
        key_file = write_api_key_file(self.private_dir(), self.api_key) if self.api_key else None
        try:
            p = self.launcher.start_server(self.cfg, self.model_path, slot, name, seed=self.seed + self.starts,
                                           key_file=key_file)
        except Exception as e:  # noqa: BLE001 - counted as a failed start
            if key_file is not None:
                key_file.unlink(missing_ok=True)
            self.failed_starts += 1
            log.error("starting server %s failed (%d in a row): %s", name, self.failed_starts, e)
            return False
        p.extra["slot"] = slot
        self.starts += 1
        self.relaunched += 1
        self.starting.append(_Starting(slot, p, key_file, time.monotonic()))
        log.warning("starting server %s (%s) in slot %d", name, p.url, slot)
        return True

    def private_dir(self) -> Path:
        if self.secrets_dir is None:
            self.secrets_dir = self.launcher.private_dir()  # the launcher's private directory (0700)
        return Path(self.secrets_dir)

    @staticmethod
    def _forget_key(s: _Starting) -> None:
        if s.key_file is not None:
            s.key_file.unlink(missing_ok=True)

    def _stop_proc(self, p: ServerProcess) -> None:
        try:
            self.launcher.stop_process(p, STOP_GRACE_S)
        except Exception as e:  # noqa: BLE001 - the launcher's shutdown stops it at the end anyway
            log.warning("stopping server %s: %s", p.name, e)

    def _release(self, p: ServerProcess) -> None:
        """A dead server's hold on its place (a Ray actor's placement-group bundle) given back, so its
        replacement can take the same node and GPU (``RayLauncher.release_dead``)."""
        release = getattr(self.launcher, "release_dead", None)
        if release is not None:
            release(p)

    def _kill(self, p: ServerProcess) -> None:
        if p.actor is not None:  # a Ray host actor: killing it kills the server (and frees its bundle)
            self._release(p)
        else:
            kill_now(p)

    def _publish(self) -> None:
        members = [_member(p, slot) for slot, p in sorted(self.members.items())]
        starting = [_member(s.proc, s.slot, "starting") for s in self.starting]
        write_members(self.out, members, model=self.model_path, target=self.target, starting=starting)


def _member(p: ServerProcess, slot: int, state: str = "healthy") -> Member:
    return Member(name=p.name, url=p.url, slot=slot, pid=p.pid, node=p.node, log=str(p.log_path), state=state)


def _slot(p: ServerProcess) -> int:
    return int(p.extra.get("slot", -1))


def server_state(url: str, hang_timeout_s: float) -> str:
    """"alive", "hung" or "refused": the watchdog's liveness check (``elastic.liveness.server_state``)."""
    return liveness.server_state(url, hang_timeout_s)


def _verdict(fut: Future) -> str:
    try:
        return fut.result()
    except Exception as e:  # noqa: BLE001 - a check that failed says nothing: asked again later
        log.info("liveness check failed: %s", e)
        return "alive"


def kill_now(p: ServerProcess) -> None:
    """SIGKILL a hung server: its process group on this machine (a SIGSTOPped process dies of it too).
    A server on a Ray node is its launcher's to kill (``ServerSupervisor._kill``)."""
    if hasattr(p, "kill"):  # a Slurm step: scancel (killing its srun would leave the step running)
        p.kill()
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)  # started with start_new_session: its group is its pid
    except (ProcessLookupError, PermissionError) as e:
        log.warning("killing hung server %s (pid %s): %s", p.name, p.pid, e)
