"""Ports for the processes we start: the one helper every launcher, engine and rendezvous uses.

A port found by binding to 0 comes from the kernel's ephemeral range, the same range every
outgoing TCP connection (HTTP clients, torch stores) takes its local port from, so between
"found free" and "bound by the child" it can be taken by any connection on the machine. Ports
handed out here come from below that range, are checked by binding, and are never handed out
twice by one process.

IPv6: a host with a colon (``::1``, or bracketed as in a URL, ``[::1]``) is bound with
``AF_INET6``; :func:`url_host` gives the bracketed form every URL and ``tcp://`` address needs.
"""

from __future__ import annotations

import random
import socket
import threading
from urllib.parse import urlsplit

_LOW = 20000  # below the usual ephemeral range (32768-60999) and above well-known services
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bare_host(host: str) -> str:
    """``[::1]`` -> ``::1``: the form ``socket.bind`` and ``getaddrinfo`` take."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def url_host(host: str) -> str:
    """``::1`` -> ``[::1]``: the form a URL or a ``tcp://host:port`` address takes (others unchanged)."""
    host = bare_host(host)
    return f"[{host}]" if ":" in host else host


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in bare_host(host) else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, outside the ephemeral range where possible, and
    not returned before by this process. ``host`` may be IPv6 (``::1`` or ``[::1]``)."""
    host = bare_host(host)
    high = _ephemeral_low()
    with _lock:
        if high - _LOW > 1000:
            for _ in range(200):
                port = _rng.randrange(_LOW, high)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        for _ in range(100):  # odd port ranges: fall back to the kernel's choice
            with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    raise RuntimeError(f"no free TCP port found on {host}")


def check_server_url(url, name: str = "server URL"):
    """``urlsplit(url)`` of a server address, refused (``ValueError`` starting with ``name``, never
    showing a password) unless it is ``http(s)://host[:port][/prefix]``: a string without
    whitespace, no user info (``user:password@`` would travel in the Host header: the servers' key
    is the run's api_key), a host, a port in 1..65535, no query or fragment. The one check of a
    server address: the run config, the rollout client and every call to a server (``rollout.calls``)."""
    if not isinstance(url, str):
        raise ValueError(f"{name}: expected 'http(s)://host[:port][/prefix]', got {url!r}")
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise ValueError(f"{name} {parts.scheme}://...@{parts.netloc.rpartition('@')[2]}: user info "
                         "(user:password@) in a server URL is refused (it would travel in the Host header); "
                         "the servers' key is the run's api_key (or $AREAL_FAST_API_KEY)")
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise ValueError(f"{name}: expected 'http(s)://host[:port][/prefix]' without spaces, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{name}: the port of {url!r} must be in 1..65535")
    if parts.query or parts.fragment:
        raise ValueError(f"{name}: a server URL has no query or fragment, got {url!r}")
    return parts
