"""The one check of the run's API key on the HTTP listeners we serve: the embedded engine
(``embedded/server.py``), the agent endpoint (``areal_fast/agent/server.py``) and the Prometheus
endpoint (``areal_fast/metrics/prometheus.py``).

A request is let in when its ``Authorization`` header is exactly ``Bearer <key>``, compared in
constant time (``hmac.compare_digest``), as SGLang's api-key middleware does. Paths under
``AUTH_EXEMPT_PREFIXES`` (health and metrics probes) need no key. A listener without a key
lets everyone in. ``docs/security.md`` says where the key comes from.
"""

from __future__ import annotations

import hmac

AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")  # as SGLang's api-key middleware


def header_bytes(value: str) -> bytes:
    """A header value as bytes for a comparison: aiohttp keeps undecodable bytes as surrogate
    escapes, which a strict encode refuses (a 500); a non-ASCII key is just a wrong key (401)."""
    return value.encode("utf-8", "surrogateescape")


def authorized(api_key: str | None, path: str, authorization: str | None,
               exempt: tuple[str, ...] = AUTH_EXEMPT_PREFIXES) -> bool:
    """True when a request for ``path`` with this ``Authorization`` header may pass a listener
    that requires ``api_key`` (None or empty: no key required). ``exempt``: the path prefixes that
    need no key (the Prometheus endpoint, whose ``/metrics`` is what the key guards, passes none)."""
    if not api_key or (exempt and path.startswith(exempt)):
        return True
    return hmac.compare_digest(header_bytes(authorization or ""), f"Bearer {api_key}".encode())
