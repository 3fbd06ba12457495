"""Who holds a server's port: the check that keeps the run's key away from a neighbour.

The launcher picks a free port, puts it on the server's command line (readable by anyone in /proc),
and the server binds it only after loading its model, seconds to minutes later. A local neighbour
can bind the port first and answer ``/health``; our first keyed request (``/server_info`` with
``Authorization: Bearer <run key>``) would then hand it the key. So before a launched server is
taken (the start-up wait, the supervisor's promotion of a relaunched server, the reuse of a kept
one), its listening socket must belong to its own process tree: Linux's ``/proc/net/tcp{,6}`` gives
the socket's inode for the port in LISTEN state, ``/proc/<pid>/fd`` the sockets of each process of
the tree. The ``/health`` probe before it carries no key.

Where this cannot be told (no ``/proc``, a server on another node), :func:`listener_owner` answers
None and the caller goes on: the check protects servers started on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


class PortTaken(RuntimeError):
    """A launched server's port answers, but its listening socket is another process's."""


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    """The inodes of the sockets listening on TCP ``port`` (IPv4 and IPv6) in this network namespace."""
    out = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == _LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(int(f[9]))
    return out


def process_tree(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """``pid`` and every process descended from it (read from each process's ``stat``)."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(d.name))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in tree:
            tree.add(p)
            todo.extend(children.get(p, ()))
    return tree


def socket_inodes(pids: set[int], proc: Path = Path("/proc")) -> set[int]:
    """The socket inodes open in ``pids`` (those whose descriptors this user may read)."""
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(proc / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(proc / str(pid) / "fd" / fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return out


def listener_owner(pid: int | None, port: int, proc: Path = Path("/proc")) -> bool | None:
    """True when a socket listening on ``port`` is open in ``pid``'s process tree; False when the
    port is listened on by others only; None when nobody listens (nothing can be sent there) or it
    cannot be told here."""
    if pid is None or not (proc / "net" / "tcp").exists() or not (proc / str(pid)).exists():
        return None
    listening = listening_inodes(port, proc)
    if not listening:
        return None
    return bool(listening & socket_inodes(process_tree(pid, proc), proc))


def check_listener(name: str, url: str, pid: int | None, local: bool = True) -> None:
    """Raise :class:`PortTaken` when the server ``name`` (``pid``, on this machine when ``local``)
    at ``url`` does not hold its own listening port; nothing when it does or it cannot be told."""
    if not local or pid is None:
        return
    from urllib.parse import urlsplit

    port = urlsplit(url).port
    if port is None:
        return
    if listener_owner(pid, port) is False:
        raise PortTaken(f"{name}: {url} answers, but its listening socket is not held by {name}'s process "
                        f"(pid {pid}) or its children: another process took port {port}. Nothing with the "
                        f"run's key was sent to it; {name} is stopped")
