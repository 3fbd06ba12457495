"""The run's API key for a launched server, off its command line (``/proc/<pid>/cmdline`` is readable by
every local user): :func:`write_api_key_file` writes it into a YAML file only this user can read, which
every kind of server takes with ``--config FILE`` (SGLang's and vLLM's own option: a YAML mapping of
long option names, merged under the command line); :func:`redact_command` hides a key that is on a
command line anyway, for log lines.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path


def write_api_key_file(directory: str | os.PathLike, api_key: str) -> Path:
    """Write ``api-key: KEY`` into a new YAML file in ``directory`` that only this user can read.

    ``directory`` is created with mode 0700 (an existing one must be a real directory owned by this
    user, and is set to 0700); the file gets a fresh name and is created with O_EXCL and mode 0600,
    so nothing another user prepared (a file, a symlink) is ever written through. Returns its path,
    for ``server_command(..., api_key_file=path)``. A server reads the file once, at start-up: the
    caller may remove it as soon as the server answers /health.
    """
    import yaml

    if not api_key or not isinstance(api_key, str):
        raise ValueError(f"write_api_key_file: the API key must be a non-empty string, got {type(api_key).__name__}")
    if api_key.startswith("-") or any(c.isspace() for c in api_key):
        raise ValueError("write_api_key_file: the API key must not start with '-' nor contain white space "
                         "(a server's argument parser would misread it)")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"API key directory {str(d)!r} is not a directory owned by this user (uid "
                              f"{os.getuid()}); refusing to write the key there")
    os.chmod(d, 0o700)
    path = d / f"server-key-{os.getpid()}-{secrets.token_hex(4)}.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump({"api-key": api_key}))  # safe_dump quotes what YAML would read as a number
    return path


def redact_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` for a log line, with the value of ``--api-key`` (``--api-key K`` or ``--api-key=K``) hidden."""
    out = []
    for i, c in enumerate(cmd):
        if i and cmd[i - 1] == "--api-key":
            out.append("***")
        elif c.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(c)
    return out
