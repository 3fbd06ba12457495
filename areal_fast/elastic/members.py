"""The run directory's server files: how the launcher, trainer rank 0 and the ``areal-fast servers``
command tell each other which inference servers a run has (``docs/elastic.md``).

``<output_dir>/servers/``, each file JSON, replaced atomically (written beside, then renamed), with
one writer each:

- ``members.json`` (the launcher): the healthy servers the run may use (``servers``), with name,
  pid, node and slot, and the servers still starting (``starting``, state "starting": launched, not
  yet answering /health; recorded so that a resume after a kill -9 of the launcher finds them under
  ``rollout.keep_servers``: ``launch.reuse``). Rank 0 offers a new one to the weight sync (it joins
  the pool after its first full update) and drops from the pool a server that left the file (dead,
  or removed on request);
- ``target.json`` (``areal-fast servers``): how many servers the run should have (at most
  `MAX_SERVERS`), and which to remove first; the launcher starts or stops servers until the
  members match it, a few starts a tick (``elastic.supervisor.MAX_STARTS_PER_TICK``);
- ``pool.json`` (rank 0): the servers requests go to, and the ones waiting to join. The launcher
  stops a removed server only once it left the pool (or after a drain deadline).

Files, not a socket: they need no port, survive a crash of either side, work wherever the output
directory is shared (the Ray launcher's requirement already) and can be read by a person.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SERVERS_DIR = "servers"
MEMBERS_FILE, TARGET_FILE, POOL_FILE = "members.json", "target.json", "pool.json"
MAX_SERVERS = 1024
"""The most servers a target may ask for (``areal-fast servers set/add``, ``target.json``): far above
any run we launch, low enough that a typo (``set 100000``) is refused instead of starting servers
until the machines give out. The launcher refuses a target file above it (``elastic.supervisor``)."""


@dataclass
class Member:
    """One server of the run, as the launcher records it."""

    name: str
    url: str
    slot: int
    pid: int | None = None
    node: str = "localhost"
    log: str = ""
    state: str = "healthy"  # "starting": launched, not answering /health yet (not a member rank 0 may use)


@dataclass
class Target:
    """What ``areal-fast servers`` asks for: ``n_servers`` servers, removing ``remove`` first."""

    n_servers: int
    remove: list[str] = field(default_factory=list)


def servers_dir(out: str | os.PathLike) -> Path:
    return Path(out) / SERVERS_DIR


def write_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, atomically: a reader sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path):
    """The JSON at ``path``, or None when it is missing or unreadable (a writer replaces it whole)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_members(out, members: list[Member], model: str | None = None, target: int | None = None,
                  starting: list[Member] = ()) -> None:
    """The launcher's members, the servers it is starting, the model they serve (``launch.reuse``
    checks it on resume) and the number of servers it is heading for."""
    write_json(servers_dir(out) / MEMBERS_FILE, {"servers": [asdict(m) for m in members],
                                                 "starting": [asdict(m) for m in starting], "model": model,
                                                 "target": target, "time": time.time()})


def read_members(out) -> list[Member] | None:
    """The launcher's healthy members, or None when the run has no members file (servers it did not
    launch)."""
    d = read_json(servers_dir(out) / MEMBERS_FILE)
    if not isinstance(d, dict):
        return None
    return [Member(**m) for m in d.get("servers", [])]


def read_starting(out) -> list[Member]:
    """The servers the launcher was starting when it last wrote the members file (state "starting")."""
    d = read_json(servers_dir(out) / MEMBERS_FILE)
    if not isinstance(d, dict):
        return []
    return [Member(**{**m, "state": "starting"}) for m in d.get("starting") or []]


def check_target_size(n: int) -> None:
    """Refuse a number of servers below 0 or above `MAX_SERVERS`, naming the value and the cap."""
    if n < 0:
        raise ValueError(f"n_servers: must be >= 0, got {n}")
    if n > MAX_SERVERS:
        raise ValueError(f"n_servers: {n} servers asked for; a run may have at most {MAX_SERVERS} "
                         "(areal_fast.elastic.members.MAX_SERVERS)")


def write_target(out, target: Target) -> None:
    check_target_size(target.n_servers)
    write_json(servers_dir(out) / TARGET_FILE, asdict(target))


def read_target(out) -> Target | None:
    d = read_json(servers_dir(out) / TARGET_FILE)
    if not isinstance(d, dict) or not isinstance(d.get("n_servers"), int):
        return None
    return Target(int(d["n_servers"]), [str(u).rstrip("/") for u in d.get("remove") or []])


def write_pool(out, urls: list[str], joining: list[str], generation: int = 0) -> None:
    """Rank 0's pool, the servers waiting to join, and the weight group's generation (a resume that
    reuses kept servers destroys their groups up to it: ``launch.reuse``)."""
    write_json(servers_dir(out) / POOL_FILE, {"urls": list(urls), "joining": list(joining), "generation": generation,
                                              "time": time.time()})


def read_pool(out) -> dict | None:
    d = read_json(servers_dir(out) / POOL_FILE)
    return d if isinstance(d, dict) else None


def servers_command(action: str, run_dir, arg: str | None = None) -> dict:
    """``areal-fast servers ACTION --run-dir DIR [ARG]``: ``list`` the members, the pool and the
    target; ``add [N]``, ``remove [URL | N]`` or ``set N`` write the new target (the launcher acts
    on it within a second; a removed server is stopped once out of the pool). A target above
    `MAX_SERVERS` raises ValueError naming it, and nothing is written. Returns what ``list``
    shows, after the change."""
    members = read_members(run_dir)
    if members is None:
        raise ValueError(f"--run-dir {run_dir}: no {SERVERS_DIR}/{MEMBERS_FILE}; is it the output_dir of a run "
                         "whose servers the launcher started?")
    current = read_target(run_dir)
    launcher_target = (read_json(servers_dir(run_dir) / MEMBERS_FILE) or {}).get("target")
    n = current.n_servers if current is not None else launcher_target if isinstance(launcher_target, int) \
        else len(members)
    urls = [m.url for m in members]
    if action == "add":
        write_target(run_dir, Target(n + _count(arg)))
    elif action == "set":
        write_target(run_dir, Target(_count(arg, None)))
    elif action == "remove":
        if arg and "://" in arg:
            url = arg.rstrip("/")
            if url not in urls:
                raise ValueError(f"remove: {url} is not a server of the run ({', '.join(urls) or 'none'})")
            write_target(run_dir, Target(n - 1, [url]))
        else:
            write_target(run_dir, Target(max(0, n - _count(arg))))
    elif action != "list":
        raise ValueError(f"unknown action {action!r}: list, add, remove or set")
    pool = read_pool(run_dir) or {}
    return {"members": urls, "pool": pool.get("urls", []), "joining": pool.get("joining", []),
            "target": (read_target(run_dir) or Target(n)).n_servers}


def _count(arg: str | None, default: int | None = 1) -> int:
    if arg is None and default is not None:
        return default
    try:
        v = int(arg)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of servers, got {arg!r}") from None
    if v < 0:
        raise ValueError(f"expected a number of servers >= 0, got {v}")
    return v
