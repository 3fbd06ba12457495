"""The weight-update endpoints of the embedded engine's HTTP front end (``engine/server.py``).

It owns SGLang's weight-update routes as the engine serves them: /init_weights_update_group and
/destroy_weights_update_group (the broadcast group), /update_weights_from_distributed (one bucket
received from the trainer), /update_weights_from_disk, /update_weights_from_tensor (refused: no
CUDA IPC here), and /begin_weight_update / /end_weight_update where the chosen SGLang release has
weight-update sessions. Each answers SGLang's ``{"success", "message"}`` shape. Rendezvous and
receives run in the default executor (bounded by the group timeout) so the loop keeps answering;
the load itself, the new version and SGLang's flush rule run on the scheduler thread
(``_apply_update``). The receiving of tensors is ``engine/weight_sync.py``.

``WeightUpdateRoutes`` is a part of ``EngineServer``: it reads the server's ``receiver``,
``scheduler``, ``sglang``, ``device``, ``load_format``, ``model_path`` and ``session_open``, and runs
calls on the scheduler thread through its ``_on_scheduler``.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from areal_fast.backends.sglang.compat import ENGINE_LOAD_FORMATS
from areal_fast.embedded.request_parsing import UPDATE_META_LIMIT, BadRequest, read_json
from areal_fast.embedded.scheduler import SchedulerDown
from areal_fast.embedded.weight_sync import TensorMeta, parse_dtype, unaligned_tensor

FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running "
                 "or queued. Retract or finish them, then call /flush_cache.")


class WeightUpdateRoutes:
    """SGLang's weight-update endpoints on the embedded engine; see the module docstring."""

    def _add_weight_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        if self.sglang.weight_update_sessions:
            r.add_post("/begin_weight_update", self.begin_update)
            r.add_post("/end_weight_update", self.end_update)

    @staticmethod
    def _result(ok: bool, message: str, **extra) -> web.Response:
        return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)

    async def init_group(self, request: web.Request) -> web.Response:
        b = await read_json(request)
        try:
            args = (str(b["master_address"]), int(b["master_port"]), int(b["rank_offset"]), int(b["world_size"]),
                    str(b.get("group_name", "weight_update_group")),
                    str(b.get("backend") or ("nccl" if self.device.type == "cuda" else "gloo")))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"init_weights_update_group: missing or bad field {e}", schema=True) from None
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.receiver.init_group, *args)
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to init weight update group: {type(e).__name__}: {e}")
        return self._result(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        b = await read_json(request)
        name = str(b.get("group_name", "weight_update_group"))
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.receiver.destroy_group, name)
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to destroy group: {e}")
        return self._result(True, "Succeeded to destroy custom process group.")

    def _apply_update(self, named, b: dict) -> tuple[bool, str]:
        """Runs on the scheduler thread: optional abort, the load, the version, then SGLang's flush rule."""
        if b.get("abort_all_requests"):
            self.scheduler.abort(None, "Abort by weight update")
        self.receiver.load(named)
        if b.get("weight_version") is not None:
            self.scheduler.weight_version = str(b["weight_version"])
        if b.get("flush_cache", True) and not self.scheduler.is_idle():
            # requests still hold KV of the old weights (e.g. an in_place pause): the flush fails
            if self.sglang.refuses_flush_with_running:
                return False, FLUSH_REFUSED
            self.scheduler.crash("AssertionError: Cache flush failed after updating weights")
            raise SchedulerDown(self.scheduler.crash_reason)
        return True, "Succeeded to update model weights."

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        b = await read_json(request, UPDATE_META_LIMIT)
        names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("update_weights_from_distributed needs lists names, dtypes and shapes", schema=True)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        try:
            metas = [TensorMeta(str(n), parse_dtype(d), tuple(int(x) for x in s))
                     for n, d, s in zip(names, dtypes, shapes)]
        except (ValueError, TypeError) as e:
            raise BadRequest(f"update_weights_from_distributed: {e}") from None
        if self.sglang.weight_update_sessions and not self.session_open:
            return self._result(False, "update_weights_from_distributed must run between begin_weight_update() "
                                       "and end_weight_update()")
        group, fmt = str(b.get("group_name", "weight_update_group")), b.get("load_format")
        if fmt == "flattened_bucket" and self.sglang.checks_bucket_alignment and unaligned_tensor(metas):
            return self._result(False, f"Failed to receive weights: {unaligned_tensor(metas)}")
        loop = asyncio.get_running_loop()
        try:  # off the scheduler: a silent trainer fails this call after the group timeout
            named = await loop.run_in_executor(None, self.receiver.receive, metas, group, fmt,
                                               self.sglang.checks_bucket_alignment)
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to receive weights: {type(e).__name__}: {e}")
        try:
            ok, message = await self._on_scheduler(lambda: self._apply_update(named, b))
        except SchedulerDown:
            raise
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to update weights: {type(e).__name__}: {e}")
        return self._result(ok, message)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        b = await read_json(request)
        path = b.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("update_weights_from_disk needs model_path (str)", schema=True)
        fmt = b.get("load_format") or self.load_format  # null: the format the server was launched with
        if fmt not in ENGINE_LOAD_FORMATS or fmt == "dummy":
            return self._result(False, f"Failed to update weights: load_format {fmt!r} cannot load {path!r} "
                                       f"(the embedded engine reads 'auto' or 'safetensors' checkpoints)",
                                num_paused_requests=0)
        try:
            named = await asyncio.get_running_loop().run_in_executor(None, self.receiver.read_from_disk, path)
            ok, message = await self._on_scheduler(lambda: self._apply_update(named, b))
        except SchedulerDown:
            raise
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to update weights: {type(e).__name__}: {e}", num_paused_requests=0)
        self.model_path = path
        return self._result(ok, message, num_paused_requests=0)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        await read_json(request)
        return self._result(False, "update_weights_from_tensor (CUDA IPC) is not supported by the embedded engine")

    async def begin_update(self, request: web.Request) -> web.Response:
        await read_json(request)
        if self.session_open:
            return self._result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return self._result(True, "Success")

    async def end_update(self, request: web.Request) -> web.Response:
        await read_json(request)
        if not self.session_open:
            return self._result(False, "no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return self._result(True, "Success")
