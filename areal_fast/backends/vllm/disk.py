"""Disk weight updates on vLLM servers (``weights.method: disk`` with ``rollout.api: vllm``).

The trainer side is the disk transport's (``DiskWeightSync``: HF safetensors written by rank 0);
only the servers' calls differ. Where the SGLang transport posts ``/update_weights_from_disk``, a
vLLM server gets (``docs/vllm.md``; bodies from ``backends/vllm/requests.py``):

    [POST /pause?mode=keep|abort   if it is not paused already: a reload must not run mid-step;
                                   keep (in place) only where answers label every token (0.33.0 on)]
    POST /collective_rpc reload_weights(weights_path)   (update_config first before 0.16.0)
    POST /update_weight_version {"new_version": V}      (0.27.0 on)
    [POST /resume                  in ``finally``: only if this update paused it]

The resume is in a ``finally``: whether the reload succeeded or failed, a server this update paused
is never left paused (vLLM servers that stayed paused after a disk update: AReaL issue 1160). A
server the rollout client paused stays paused: resuming it is the client's (``continue_all``).
"""

from __future__ import annotations

from areal_fast.backends.sglang.weight_sync import DiskWeightSync
from areal_fast.backends.vllm.compat import VLLMBehaviour, served_release
from areal_fast.backends.vllm.requests import disk_update_calls, pause_query, weight_version_body
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.sync import SyncCalls

DISK_PATH = "/update_weights_from_disk"


class VLLMDiskCalls(SyncCalls):
    """``SyncCalls`` whose ``all(urls, "/update_weights_from_disk", body)`` runs vLLM's disk update on
    each server (see the module docstring); every other call is passed on unchanged."""

    def all(self, urls: list[str], path: str, body: dict | None = None, method: str = "POST") -> list[dict]:
        if path != DISK_PATH:
            return super().all(urls, path, body, method)
        self.run_each(urls, lambda calls, u: self._async_update(calls, u, body))
        return [{} for _ in urls]

    def run_each(self, urls: list[str], update) -> None:
        """``update(calls, url)`` on every server at once; the first server's error is raised after
        all of them ended."""
        futs = [self._calls.run(lambda calls, u=u: update(calls, u)) for u in urls]
        errors = []
        for f in futs:
            try:
                f.result()
            except WeightSyncError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def update_one(self, url: str, body: dict) -> None:
        """The disk update of one server (blocking)."""
        self._calls.run(lambda calls: self._async_update(calls, url, body)).result()

    async def _async_update(self, calls, url: str, body: dict) -> None:
        async def reload(b: VLLMBehaviour) -> None:
            for rpc in disk_update_calls(body["model_path"], b):
                await self._ask(calls, url, "/collective_rpc", rpc, "POST", "reload")

        await self.update_paused(calls, url, reload, body.get("weight_version"), "the disk update")

    async def update_paused(self, calls, url: str, act, version, what: str) -> None:
        """One update of the server at ``url`` (see the module docstring): paused unless it is already,
        ``await act(behaviour)`` (the reload, or an adapter's load), the new label ``version`` (where
        the release labels one and ``version`` is not None), resumed in ``finally`` if paused here."""
        ver = await self._ask(calls, url, "/version", None, "GET")
        try:
            b = VLLMBehaviour(served_release(str(ver.get("version")))[0])
        except ValueError as e:
            raise WeightSyncError(f"{url}: {e}") from None
        paused_here = False
        if b.has_pause and not (await self._ask(calls, url, "/is_paused", None, "GET")).get("is_paused"):
            # keep: in-flight work survives the update, labelled by the answers' per-token spans; before
            # 0.33.0 nothing would tell a kept request's tokens of the two versions apart: abort
            mode = "in_place" if b.token_weight_versions else "abort"
            q = "&".join(f"{k}={v}" for k, v in pause_query(mode, b).items())
            await self._ask(calls, url, f"/pause?{q}", None, "POST")
            paused_here = True
        try:
            await act(b)
            if b.labels_weight_version and version is not None:
                await self._ask(calls, url, "/update_weight_version", weight_version_body(version), "POST")
        finally:
            if paused_here:
                await self._ask(calls, url, "/resume", None, "POST", f"resume after {what}")

    async def _ask(self, calls, url: str, path: str, body, method: str, what: str = "") -> dict:
        return await self._one(calls, url, path, body, method, what)


class VLLMDiskWeightSync(DiskWeightSync):
    """``DiskWeightSync`` whose server calls are vLLM's (:class:`VLLMDiskCalls`)."""

    @property
    def http(self) -> SyncCalls:
        if self._http is None:
            self._http = VLLMDiskCalls(self.config.timeout_s, self.config.resolved_api_key)
        return self._http
