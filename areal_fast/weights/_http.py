"""Minimal blocking JSON-over-HTTP for weight sync (urllib in a thread pool).

The trainer is synchronous code (torch.distributed calls), so the HTTP side runs in a small
thread pool: an update request is sent, *not awaited*, while the trainer broadcasts.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the server, endpoint and tensors involved."""


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
        raise WeightSyncError(f"{url}{path}: HTTP {e.code}: {detail}") from None
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
    """Thread pool for concurrent calls to several servers."""

    def __init__(self, max_workers: int = 16, timeout_s: float = 600.0, api_key: str | None = None):
        self._ex = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weight-sync-http")
        self.timeout_s = timeout_s
        self.api_key = api_key

    def submit(self, url: str, path: str, body: dict | None = None, method: str = "POST", what: str = "") -> Future:
        def run():
            return check_success(url, path, call(url, path, body, method=method, timeout_s=self.timeout_s,
                                                 api_key=self.api_key), what)

        return self._ex.submit(run)

    def all(self, urls: list[str], path: str, body: dict | None = None, method: str = "POST") -> list[dict]:
        futs = [self.submit(u, path, body, method) for u in urls]
        return [f.result() for f in futs]

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)
