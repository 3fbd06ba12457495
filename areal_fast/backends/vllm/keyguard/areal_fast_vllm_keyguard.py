"""The run's key on every route of a vLLM server: an ASGI middleware vLLM loads by its import path
(``--middleware areal_fast_vllm_keyguard.KeyGuard``, vLLM's own flag from 0.11.0 to 0.33.0 at least).

vLLM checks ``--api-key`` only under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: its dev-mode
routes (``/pause``, ``/resume``, ``/collective_rpc``, ``/update_weights``, ``/sleep``, ...), the
runtime adapter routes and ``/invocations`` act for anyone who can reach the port. This guard answers
401 to every request (HTTP or WebSocket) that does not carry ``Authorization: Bearer KEY`` (compared
in constant time), on every path but ``/health`` (the launcher's readiness check).

The keys are the ones vLLM itself checks under ``/v1``, taken by vLLM's own rule at the first
request: its parsed arguments' ``--api-key`` values (``app.state.args``, 0.27.0 on; however the key
was spelt on the command line or in ``--config``), else ``$VLLM_API_KEY``. A release without
``app.state.args`` (0.11.0 to 0.26) gets the keys read from its command line when vLLM imports this
module (while it builds its app, before it answers ``/health``: the launcher removes its key file
only then): ``--api-key``, else the ``api-key`` of the YAML file of ``--config`` (how the launcher
hands it over, ``backends/keyfile.py``), else ``$VLLM_API_KEY``; a key file named but gone by then
refuses every request but ``/health``: the guard fails closed. With no key anywhere it lets every
request through, as vLLM does.

It runs in vLLM's interpreter (another environment, without areal_fast): the standard library only,
and PyYAML, which vLLM itself needs for ``--config``. The launcher puts this module's directory,
which holds nothing else, on the server's ``PYTHONPATH`` (``backends/vllm/server_command.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys

OPEN_PATHS = frozenset({"/health"})
"""The paths answered without the key: the liveness check, which acts on nothing."""


def _argv_values(argv: list[str], flag: str) -> list[str]:
    """The values of ``flag`` in ``argv`` (``--flag V [V ...]`` or ``--flag=V``), in order."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag:
            for v in argv[i + 1:]:
                if v.startswith("-"):
                    break
                out.append(v)
    return out


def _config_keys(path: str) -> list[str]:
    import yaml  # vLLM's own dependency (its --config reader)

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ImportError(f"areal_fast_vllm_keyguard: --config {path} is not a YAML mapping")
    value = doc.get("api-key", doc.get("api_key"))
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def server_keys(argv: list[str], environ: dict) -> list[str] | None:
    """The keys a vLLM server started with ``argv`` and ``environ`` accepts (vLLM's order: the
    command line, then its ``--config`` file, then ``$VLLM_API_KEY``); empty: no key;
    ``None``: a ``--config`` file is named that cannot be read (the key is not known here)."""
    keys = [k for k in _argv_values(argv, "--api-key") if k]
    for path in _argv_values(argv, "--config")[-1:]:
        if not keys:
            try:
                keys = [k for k in _config_keys(path) if k]
            except OSError:
                return None
    if not keys and environ.get("VLLM_API_KEY"):
        keys = [environ["VLLM_API_KEY"]]
    return keys


def _keys_of_app(scope, environ: dict) -> list[str] | None:
    """vLLM's own keys (its rule: ``args.api_key or [$VLLM_API_KEY]``, empty ones dropped) from its
    parsed arguments (``app.state.args``); None where the app has none (releases before 0.27.0)."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    if args is None:
        return None
    value = getattr(args, "api_key", None)
    keys = [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)] if value else []
    return [k for k in (keys or [environ.get("VLLM_API_KEY", "")]) if k]


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


_FROM_SERVER = object()  # the keys of the server the guard runs in


class KeyGuard:
    """Pure ASGI middleware: the key on every path but :data:`OPEN_PATHS` (see the module docstring).
    vLLM builds it with the next app only: the server's keys; ``keys`` is for tests (a list: those;
    None: not known, as when the key file was gone on a release without ``app.state.args``)."""

    def __init__(self, app, keys: list[str] | None | object = _FROM_SERVER) -> None:
        self.app = app
        self._given = keys
        self._digests: list[bytes] | None = None  # set at the first request that needs them

    def _keys(self, scope) -> list[str] | None:
        if self._given is not _FROM_SERVER:
            return self._given
        keys = _keys_of_app(scope, os.environ)
        return _KEYS if keys is None else keys

    def authorized(self, scope) -> bool:
        if self._digests is None:
            keys = self._keys(scope)
            if keys is None:  # the key file was gone at import, and vLLM has no parsed arguments: nobody
                return False
            self._digests = [_digest(f"Bearer {k}") for k in keys]
        if not self._digests:
            return True
        got = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                got = value
                break
        seen = hashlib.sha256(got).digest()
        ok = False
        for d in self._digests:  # every key compared, in constant time
            ok |= hmac.compare_digest(seen, d)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closed before it is accepted: an HTTP 403 to the client
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


_KEYS = server_keys(sys.argv[1:], dict(os.environ))
