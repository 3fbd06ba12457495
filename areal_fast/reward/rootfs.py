"""What the sandbox's root file system contains: the interpreter, its library path, its shared libraries.

`_nsinit.py` builds a fresh root for every run on a small tmpfs, bind-mounts onto it, read-only,
only the host paths listed here, adds a few device nodes, a new /proc and tmpfs /tmp and
/dev/shm, then pivots into it. This module computes the list once per process, as root, outside
the sandbox: `layout(python)` returns the operations in the order `_nsinit.py` applies them::

    ("dir", path)           mkdir on the new root (0755: the sandbox uid may traverse it)
    ("link", path, target)  a symlink, as on the host (/lib -> usr/lib, ld-linux-x86-64.so.2)
    ("bind", path)          bind-mount the host file or directory at the same path, read-only
    ("hide", path)          cover a directory inside a bound one with an empty read-only tmpfs

The interpreter keeps its own paths, so nothing needs relocating: it finds its stdlib where it
was installed. Its site-packages are hidden (they sit inside the stdlib directory of a pyenv or
source build): only the standard library is there, and start-up does not run the host's ``.pth``
files (one here imported certifi: 125 ms per start instead of 25 ms). Directories above a bound
path exist on the new root but hold nothing else: a pyenv under /root shows /root/.pyenv/versions/X
and nothing of the rest of /root.
Shared libraries are those `ldd` lists for the interpreter and for the extension modules on its
module path (stdlib ``lib-dynload``); a third-party package's own native libraries are not
followed.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess

log = logging.getLogger(__name__)

_LDD_TIMEOUT_S = 60.0
OWN_TOPS = ("tmp", "dev", "proc")  # top-level directories the sandbox root gets fresh, never from the host
# Asked of the interpreter itself, without site: where it lives, its stdlib path, its site dirs
_WHERE = ("import json, site, sys, sysconfig; print(json.dumps([sys.executable, sys.path, site.getsitepackages() "
          "+ [sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]]))")
# Library directories bound whole when `ldd` is missing or fails (a weaker but working fallback)
_FALLBACK_LIB_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


class Layout:
    """Builds the ordered operations, replicating host symlinks along each path."""

    def __init__(self):
        self.ops: list[tuple[str, ...]] = []
        self._done: set[str] = set()
        self._bound: list[str] = []

    def _covered(self, path: str) -> bool:
        return any(path == b or path.startswith(b.rstrip("/") + "/") for b in self._bound)

    def add(self, path: str, bind: bool = True) -> None:
        """Make ``path`` resolve on the new root as it does on the host; bind its final target."""
        path = os.path.normpath(path)
        if not os.path.isabs(path):
            raise ValueError(f"sandbox root: path {path!r} must be absolute")
        if path.split("/")[1] in OWN_TOPS:
            raise ValueError(f"sandbox root: {path} is under /{path.split('/')[1]}, which the sandbox mounts afresh")
        if not os.path.lexists(path):
            raise FileNotFoundError(f"sandbox root: {path} does not exist on the host")
        cur = "/"
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            nxt = os.path.join(cur, part)
            last = i == len(parts) - 1
            if self._covered(nxt):
                return  # inside a directory that is already bound whole
            if os.path.islink(nxt):
                target = os.readlink(nxt)
                if nxt not in self._done:
                    self._done.add(nxt)
                    self.ops.append(("link", nxt, target))
                resolved = os.path.normpath(os.path.join(cur, target))
                self.add(resolved, bind=bind and last)
                if last:
                    return
                cur = os.path.realpath(nxt)
                continue
            if last and bind:
                if nxt not in self._done:
                    self._done.add(nxt)
                    self.ops.append(("bind", nxt))
                    if os.path.isdir(nxt):
                        self._bound.append(nxt)
                return
            if nxt not in self._done:
                self._done.add(nxt)
                self.ops.append(("dir", nxt))
            cur = nxt


def _shared_libraries(files: list[str]) -> list[str]:
    """Absolute paths of the shared libraries (and the dynamic loader) that ``files`` load."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise FileNotFoundError("ldd not found")
    out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=_LDD_TIMEOUT_S).stdout
    libs = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].strip().split(" (")[0].strip()
        elif line.startswith("/") and " (" in line:
            target = line.split(" (")[0].strip()  # the dynamic loader: "/lib64/ld-linux-x86-64.so.2 (0x...)"
        else:
            continue
        if target.startswith("/") and target not in libs:
            libs.append(target)
    return libs


def layout(python: str, extra: tuple[str, ...] = ()) -> tuple[tuple[str, ...], ...]:
    """Operations that give the sandbox ``python`` (and ``extra`` host paths), nothing else of the host."""
    where = subprocess.run([python, "-I", "-S", "-c", _WHERE], capture_output=True, text=True, timeout=_LDD_TIMEOUT_S,
                           env={"PATH": "/usr/bin:/bin"})
    if where.returncode != 0:
        raise RuntimeError(f"sandbox root: {python} -I failed: {where.stderr.strip()[-300:]}")
    executable, path, site_dirs = json.loads(where.stdout)
    lay = Layout()
    lay.add(python)
    lay.add(executable)
    # directories first: a file inside a bound directory needs no mount of its own
    module_dirs = [p for p in path if p and os.path.isabs(p) and os.path.exists(p)]
    for p in sorted(module_dirs, key=len):
        lay.add(p)
    for d in dict.fromkeys(os.path.realpath(d) for d in site_dirs):
        if os.path.isdir(d) and lay._covered(d):
            lay.ops.append(("hide", d))
    for p in extra:
        lay.add(p)
    binaries = [os.path.realpath(executable)]
    for d in module_dirs:
        if os.path.isdir(d):
            binaries += sorted(glob.glob(os.path.join(d, "*.so")))
    try:
        libs = _shared_libraries(binaries)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("reward sandbox: cannot list shared libraries (%s); binding %s whole", e,
                    ", ".join(_FALLBACK_LIB_DIRS))
        libs = [d for d in _FALLBACK_LIB_DIRS if os.path.exists(d)]
    for lib in libs:
        lay.add(lib)
    ops = tuple(lay.ops)
    encode(ops)  # refuse what cannot be passed on, now rather than at every run
    return ops


def encode(ops: tuple[tuple[str, ...], ...]) -> str:
    """The text form `_nsinit.py` reads: one operation per line, fields separated by tabs."""
    for op in ops:
        if any("\t" in f or "\n" in f for f in op):
            raise ValueError(f"sandbox root: path {op[1]!r} contains a tab or a newline")
    return "\n".join("\t".join(op) for op in ops)


def with_paths(ops: tuple[tuple[str, ...], ...], paths: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """``ops`` plus what makes ``paths`` (host files or directories) visible, read-only."""
    lay = Layout()
    for op in ops:
        lay.ops.append(op)
        lay._done.add(op[1])
        if op[0] == "bind" and os.path.isdir(op[1]):
            lay._bound.append(op[1])
    for p in paths:
        lay.add(os.path.abspath(p))
    ops = tuple(lay.ops)
    encode(ops)
    return ops
