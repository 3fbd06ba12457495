"""The one HTTP speaker of SGLang's weight-update protocol: blocking JSON calls in a thread pool.

The trainer is synchronous code (torch.distributed calls), so the HTTP side runs in a small
thread pool: an update request is sent, *not awaited*, while the trainer broadcasts.
Every call carries ``Authorization: Bearer KEY`` when an API key is configured (argument, or
the ``AREAL_FAST_API_KEY`` environment variable), as the servers of a run require.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

from areal_fast.weights.config import API_KEY_ENV

__all__ = ["WeightSyncError", "call", "check_success", "HttpPool", "default_api_key"]


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the server, endpoint and tensors involved.

    ``status``: the HTTP status when the server answered one (None: no answer, or success=false)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def call(url: str, path: str, body: dict | None = None, *, method: str = "POST", timeout_s: float = 600.0,
         api_key: str | None = None) -> dict:
    """One JSON request; raises WeightSyncError on HTTP errors, timeouts and bad JSON."""
    data = None if method == "GET" else json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        hint = " (is the API key right? set AREAL_FAST_API_KEY or api_key=)" if e.code == 401 else ""
        raise WeightSyncError(f"{url}{path}: HTTP {e.code}: {detail}{hint}", status=e.code) from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise WeightSyncError(f"{url}{path}: request failed or timed out after {timeout_s}s: {e}") from None
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"message": raw[:500].decode(errors="replace")}


def check_success(url: str, path: str, answer: dict, what: str = "") -> dict:
    """SGLang answers {"success": bool, "message": str}; success=false becomes WeightSyncError."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"{url}{path} failed{' for ' + what if what else ''}: {answer.get('message', '')}")
    return answer


class HttpPool:
    """Thread pool for concurrent calls to several servers. ``api_key`` None: $AREAL_FAST_API_KEY."""

    def __init__(self, max_workers: int = 16, timeout_s: float = 600.0, api_key: str | None = None):
        self._ex = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weight-sync-http")
        self.timeout_s = timeout_s
        self.api_key = api_key if api_key is not None else default_api_key()

    def call(self, url: str, path: str, body: dict | None = None, method: str = "POST", what: str = "") -> dict:
        try:
            answer = call(url, path, body, method=method, timeout_s=self.timeout_s, api_key=self.api_key)
        except WeightSyncError as e:  # SGLang answers a refused update with 400 + success=false
            if not what:
                raise
            raise WeightSyncError(f"{e} (for {what})", status=e.status) from None
        return check_success(url, path, answer, what)

    def submit(self, url: str, path: str, body: dict | None = None, method: str = "POST", what: str = "") -> Future:
        return self._ex.submit(self.call, url, path, body, method, what)

    def each(self, urls: list[str], path: str, body: dict | None = None, method: str = "POST"
             ) -> list[tuple[str, dict | None, WeightSyncError | None]]:
        """Call every server and wait for all: ``(url, answer, None)`` or ``(url, None, error)``."""
        futs = [(u, self.submit(u, path, body, method)) for u in urls]
        out = []
        for u, f in futs:
            try:
                out.append((u, f.result(), None))
            except WeightSyncError as e:
                out.append((u, None, e))
        return out

    def all(self, urls: list[str], path: str, body: dict | None = None, method: str = "POST") -> list[dict]:
        """Call every server, wait for all, raise the first error (after every call finished)."""
        res = self.each(urls, path, body, method)
        for _u, _a, err in res:
            if err is not None:
                raise err
        return [a for _u, a, _e in res]

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)
