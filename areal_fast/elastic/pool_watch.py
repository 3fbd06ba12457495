"""Rank 0's side of elastic servers: follow the launcher's ``servers/members.json``, report the pool.

:func:`watch_members` runs beside the controller (``launch.rank``) for the whole run:

- a member that is neither in the pool nor waiting is offered to the weight sync (``syncer.offer``):
  it gets the next weight update in full, then enters the pool (``weights.membership``);
- a server in the pool, or waiting, that left the members (dead, or removed with
  ``areal-fast servers remove``) leaves the pool now (its requests in flight fail over), unless it
  is the last one and the pool may not be empty (``elastic.empty_pool``);
- a member that rank 0 dropped itself (dead or hung: the watchdog, a failed call) while the launcher
  still lists the same process is not offered at once: ``elastic.rejoin`` probes it with backoff and
  offers it once it answers again (a hung one that is not going to answer is killed and
  relaunched by the launcher: ``elastic.supervisor``);
- ``servers/pool.json`` is rewritten whenever the pool or the waiting list changes: the launcher
  stops a removed server once it is out of the pool.

A run without a members file (servers it did not launch, ``rollout.servers``) writes ``pool.json``,
and a server of ``rollout.servers`` that was dropped is offered again once it answers
(``elastic.rejoin``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

from areal_fast.elastic.members import read_members, write_pool
from areal_fast.elastic.rejoin import Rejoin

log = logging.getLogger(__name__)
WATCH_S = 0.5


def follow_members(rollout, syncer, out: Path, known: dict | None = None, rejoin: Rejoin | None = None,
                   external=()) -> None:
    """One look at the members file (see the module docstring). ``known``: the process (pid) seen
    behind each URL, kept between looks: a server that rank 0 dropped (dead or hung) while the
    launcher still lists it is not offered again at once (``rejoin`` offers it once it answers); a
    new process on the same address is. ``external``: the servers of a run without a members file;
    one out of the pool is handed to ``rejoin``."""
    members = read_members(out)
    membership = getattr(syncer, "membership", None)
    if membership is None:
        return
    if members is None:
        _follow_external(rollout, membership, rejoin, [u.rstrip("/") for u in external])
        return
    known = {} if known is None else known
    wanted = [m.url.rstrip("/") for m in members]
    for m, url in zip(members, wanted):
        if url in rollout.urls or url in membership.joining:
            known[url] = m.pid
            if rejoin is not None:
                rejoin.forget(url)
        elif url not in known or known[url] != m.pid:
            known[url] = m.pid
            syncer.offer(url)
        elif rejoin is not None:
            rejoin.track(url)
    if rejoin is not None:
        for url in [u for u in rejoin.waiting if u not in wanted]:
            rejoin.forget(url)
    for url in list(membership.joining):
        if url not in wanted:
            membership.withdraw(url)
            log.warning("server %s left before it joined", url)
    for url in rollout.urls:
        if url not in wanted:
            if len(rollout.urls) == 1 and not getattr(rollout, "allow_empty", False):
                log.warning("server %s left the members but is the last in the pool: kept until another joins", url)
                continue
            log.warning("server %s died or was removed (it left the members); out of the pool", url)
            rollout.remove_server(url)


def _follow_external(rollout, membership, rejoin: Rejoin | None, external: list[str]) -> None:
    """Servers the run did not launch: one out of the pool and not joining waits in ``rejoin``."""
    if rejoin is None:
        return
    for url in external:
        if url in rollout.urls or url in membership.joining:
            rejoin.forget(url)
        else:
            rejoin.track(url)


def answers_again(url: str, timeout_s: float) -> bool:
    """A dropped server answers again: the watchdog's liveness check (GET /model_info within
    ``timeout_s``: ``elastic.liveness.server_state``) says "alive". Not /health 200: a server that was
    dropped while hung is usually paused (the pause before an update reached it once it woke), and a
    paused server answers /health 503 (SGLang's probe, and the embedded engine's, needs the scheduler
    to produce output); it is continued with the pool after its update, once it joined."""
    from areal_fast.elastic.liveness import server_state

    return server_state(url, timeout_s) == "alive"


async def watch_members(rollout, syncer, out: Path, every_s: float = WATCH_S, *, hang_timeout_s: float = 30.0,
                        external=(), rejoin: Rejoin | None = None) -> None:
    """Follow the members file, offer dropped servers back once they answer (``elastic.rejoin``, each
    probe's deadline ``hang_timeout_s``), and publish the pool until cancelled."""
    last, known = None, {}
    rejoin = rejoin or Rejoin(functools.partial(answers_again, timeout_s=hang_timeout_s))
    try:
        await _watch(rollout, syncer, out, every_s, known, rejoin, external, last)
    finally:
        rejoin.close()


async def _watch(rollout, syncer, out, every_s, known, rejoin, external, last) -> None:
    while True:
        try:
            follow_members(rollout, syncer, out, known, rejoin, external)
            await rejoin.step(syncer.offer)
        except Exception:  # noqa: BLE001 - the next look tries again
            log.exception("following servers/members.json failed")
        membership = getattr(syncer, "membership", None)
        state = (list(rollout.urls), list(membership.joining) if membership else [],
                 membership.generation if membership else 0)
        if state != last:
            write_pool(out, *state)
            last = state
        await asyncio.sleep(every_s)
