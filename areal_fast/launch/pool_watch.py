"""Rank 0's side of elastic servers: follow the launcher's ``servers/members.json``, report the pool.

:func:`watch_members` runs beside the controller (``launch.rank``) for the whole run:

- a member that is neither in the pool nor waiting is offered to the weight sync (``syncer.offer``):
  it gets the next weight update in full, then enters the pool (``weights.membership``);
- a server in the pool, or waiting, that left the members (dead, or removed with
  ``areal-fast servers remove``) leaves the pool now (its requests in flight fail over), unless it
  is the last one;
- ``servers/pool.json`` is rewritten whenever the pool or the waiting list changes: the launcher
  stops a removed server once it is out of the pool.

A run without a members file (servers it did not launch) only writes ``pool.json``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from areal_fast.launch.members import read_members, write_pool

log = logging.getLogger(__name__)
WATCH_S = 0.5


def follow_members(rollout, syncer, out: Path, known: dict | None = None) -> None:
    """One look at the members file (see the module docstring). ``known``: the process (pid) seen
    behind each URL, kept between looks: a server that rank 0 dropped as dead (refused connections)
    while the launcher has not yet taken it out of the members is not offered again; a new process
    on the same address is."""
    members = read_members(out)
    membership = getattr(syncer, "membership", None)
    if members is None or membership is None:
        return
    known = {} if known is None else known
    wanted = [m.url.rstrip("/") for m in members]
    for m, url in zip(members, wanted):
        if url in rollout.urls or url in membership.joining:
            known[url] = m.pid
        elif url not in known or known[url] != m.pid:
            known[url] = m.pid
            syncer.offer(url)
    for url in list(membership.joining):
        if url not in wanted:
            membership.withdraw(url)
            log.warning("server %s left before it joined", url)
    for url in rollout.urls:
        if url not in wanted:
            if len(rollout.urls) == 1:
                log.warning("server %s left the members but is the last in the pool: kept until another joins", url)
                continue
            log.warning("server %s died or was removed (it left the members); out of the pool", url)
            rollout.remove_server(url)


async def watch_members(rollout, syncer, out: Path, every_s: float = WATCH_S) -> None:
    """Follow the members file and publish the pool until cancelled."""
    last, known = None, {}
    while True:
        try:
            follow_members(rollout, syncer, out, known)
        except Exception:  # noqa: BLE001 - the next look tries again
            log.exception("following servers/members.json failed")
        membership = getattr(syncer, "membership", None)
        state = (list(rollout.urls), list(membership.joining) if membership else [],
                 membership.generation if membership else 0)
        if state != last:
            write_pool(out, *state)
            last = state
        await asyncio.sleep(every_s)
