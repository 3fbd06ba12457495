"""Who holds a server's port: the check that keeps the run's key away from a neighbour.

The launcher picks a free port, puts it on the server's command line (readable by anyone in /proc),
and the server binds it only after loading its model, seconds to minutes later. A local neighbour
can bind the port first and answer ``/health``; our first keyed request (``/server_info`` with
``Authorization: Bearer <run key>``) would then hand it the key. So before a launched server is
taken (the start-up wait, the supervisor's promotion of a relaunched server, the reuse of a kept
one), its listening socket must belong to its own process tree: Linux's ``/proc/net/tcp{,6}`` gives
the socket's inode for the port in LISTEN state, ``/proc/<pid>/fd`` the sockets of each process of
the tree. The ``/health`` probe before it carries no key.

A server is taken only when *every* socket listening on its port is its own: nobody listening is
no proof (a neighbour that answered ``/health`` may have closed its socket for a moment and bind
it again before our keyed request), and neither is a listener of ours beside another process's.
Nobody listening yet (a server that is still binding) is asked again until the caller's deadline.

Where this cannot be told (no ``/proc``, a server on another node), :func:`listener_state` answers
``"unknown"`` and the caller goes on: the check protects servers started on this machine (a local
process, or a Slurm step on this node: :func:`on_this_machine`).
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


class PortTaken(RuntimeError):
    """A launched server's port answers, but its listening socket is another process's (or nobody's)."""


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


OWN, OTHER, NOBODY, GONE, UNKNOWN = "own", "other", "nobody", "gone", "unknown"


def listener_state(pid: int | None, port: int, proc: Path = Path("/proc")) -> str:
    """Who listens on TCP ``port``, seen from ``pid``'s process tree: ``"own"`` (every listening socket
    of the port is open in the tree), ``"other"`` (one is not: another process's), ``"nobody"`` (no
    socket listens), ``"gone"`` (no process ``pid`` here) or ``"unknown"`` (no ``/proc`` to tell)."""
    if pid is None or not (proc / "net" / "tcp").exists():
        return UNKNOWN
    if not (proc / str(pid)).exists():
        return GONE
    listening = listening_inodes(port, proc)
    if not listening:
        return NOBODY
    return OWN if listening <= socket_inodes(process_tree(pid, proc), proc) else OTHER


def on_this_machine(p) -> bool:
    """A launched server's process can be looked up in this machine's ``/proc``: a local child
    (``popen``), or a Slurm step that wrote it runs here, in this process's pid and network namespaces
    (``extra['this_machine']``, ``launch.slurm``). A Ray actor's server and others: False."""
    return getattr(p, "popen", None) is not None or bool(getattr(p, "extra", {}).get("this_machine"))


def check_listener(name: str, url: str, pid: int | None, local: bool = True) -> bool:
    """Whether the server ``name`` (``pid``, on this machine when ``local``) at ``url`` may be sent the
    run's key: True when it holds every listening socket of its port (or it cannot be told: not local,
    no ``/proc``); False when nobody listens there now (ask again until the caller's deadline, then
    raise :func:`nobody_listens`); :class:`PortTaken` when another process listens on it."""
    if not local or pid is None:
        return True
    from urllib.parse import urlsplit

    port = urlsplit(url).port
    if port is None:
        return True
    state = listener_state(pid, port)
    if state == OTHER:
        raise PortTaken(f"{name}: {url} answers, but a socket listening on port {port} is not held by {name}'s "
                        f"process (pid {pid}) or its children: another process listens on port {port}. Nothing "
                        f"with the run's key was sent to it; {name} is stopped")
    return state in (OWN, UNKNOWN)


def nobody_listens(name: str, url: str, pid: int | None, waited_s: float) -> PortTaken:
    """The error for a server whose ``/health`` was answered while its own process never listened on
    the port within ``waited_s`` seconds (whatever answered closed its socket)."""
    from urllib.parse import urlsplit

    port = urlsplit(url).port
    return PortTaken(f"{name}: {url} answered /health, but within {waited_s:.0f}s no socket of {name}'s process "
                     f"(pid {pid}) or its children listened on port {port} (nobody listened there when checked: "
                     f"what answered closed its socket). Nothing with the run's key was sent to it; {name} is "
                     f"stopped")
