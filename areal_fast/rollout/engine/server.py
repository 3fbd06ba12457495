"""aiohttp front end of the embedded engine: SGLang's HTTP subset with SGLang's JSON shapes.

Handlers validate up front and answer 400 with ``{"error": {"message": ...}}`` (or
``{"object": "error", "message": ..., "code": 400}`` for schema failures, as SGLang does) naming the
bad field; anything that touches the model goes through ``Scheduler.call`` so it runs between two
decode steps on the scheduler thread. Blocking rendezvous calls run in the default executor so the
event loop keeps answering /generate and /health meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import torch
from aiohttp import web

from areal_fast.rollout.engine.sampling import SamplingError, parse_sampling_params
from areal_fast.rollout.engine.scheduler import DuplicateRid, Request, Scheduler
from areal_fast.rollout.engine.weight_sync import TensorMeta, WeightReceiver, parse_dtype

SGLANG_COMPAT_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this engine follows
_FLUSH_POLL_S = 0.01


class BadRequest(Exception):
    """Raised by validation; becomes a 400 in SGLang's shape."""

    def __init__(self, message: str, schema: bool = False):
        super().__init__(message)
        self.schema = schema


def _err(message: str, schema: bool = False, status: int = 400) -> web.Response:
    body = {"object": "error", "message": message, "code": status} if schema else {"error": {"message": message}}
    return web.json_response(body, status=status)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name in ("auto", None):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(name)


class EngineServer:
    """Model + scheduler + HTTP app. ``build_app()`` returns the aiohttp application."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        seed: int = 0,
        max_running_requests: int = 256,
        weight_version: str = "default",
        host: str = "127.0.0.1",
        port: int = 30000,
        api_key: str | None = None,
        attn_implementation: str = "sdpa",
        sglang_version: str = "0.5.23",
        load_format: str = "auto",
        skip_tokenizer_init: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = model_path
        self.host, self.port, self.api_key = host, port, api_key
        self.device = torch.device(device)
        self.dtype = _resolve_dtype(dtype, self.device)
        torch.manual_seed(seed)
        self.config = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation=attn_implementation
        )
        self.model = model.to(self.device).eval()
        self.tokenizer = self._try_tokenizer(model_path)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.config, "max_position_embeddings", 2**31 - 1))
        self.max_running_requests = max_running_requests
        self.seed = seed
        self.scheduler = Scheduler(
            self.model,
            eos_token_ids=self._eos_ids(),
            max_running=max_running_requests,
            seed=seed,
            weight_version=weight_version,
            tokenizer=self.tokenizer,
        )
        self.receiver = WeightReceiver(self.model)
        self.scheduler.start()

    @staticmethod
    def _try_tokenizer(path: str):
        import os

        # transformers 5 builds an empty tokenizer from config.json alone; only a real one is useful
        if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        except Exception:  # noqa: BLE001 - a checkpoint without tokenizer files is fine (input_ids only)
            return None

    def _eos_ids(self) -> list[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    # ------------------------------------------------------------------ app
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/begin_weight_update", self.begin_update)
        r.add_post("/end_weight_update", self.end_update)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        try:
            return await handler(request)
        except BadRequest as e:
            return _err(str(e), schema=e.schema)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - a 500 with a message instead of a stack trace
            return _err(f"{type(e).__name__}: {e}", status=500)

    @staticmethod
    async def _json(request: web.Request) -> dict:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise BadRequest(f"request body is not valid JSON: {e}", schema=True) from None
        if not isinstance(body, dict):
            raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}", schema=True)
        return body

    async def _on_scheduler(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ------------------------------------------------------------------ /generate
    def _parse_generate(self, body: dict) -> tuple[str, list[int], object, bool]:
        if "text" in body and "input_ids" not in body:
            raise BadRequest("the embedded engine has no text input; send input_ids")
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise BadRequest("batched input_ids are not supported: send one prompt per /generate call")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of token ids", schema=not isinstance(ids, list))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("input_ids must contain only integers", schema=True)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"input_ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded engine")
        if body.get("logprob_start_len", -1) not in (-1, None):
            raise BadRequest("logprob_start_len must be -1 (output logprobs only) on the embedded engine")
        try:
            params = parse_sampling_params(body.get("sampling_params"), self.vocab_size)
        except SamplingError as e:
            raise BadRequest(str(e)) from None
        if params.stop and self.tokenizer is None:
            raise BadRequest("sampling_params.stop needs a tokenizer; this checkpoint has none (use stop_token_ids)")
        if len(ids) + params.max_new_tokens > self.context_length:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens "
                f"from the input messages and {params.max_new_tokens} tokens for the completion."
            )
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest(f"rid must be a string, got {rid!r}", schema=True)
        return rid, ids, params, bool(body.get("return_logprob", False))

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid, ids, params, return_logprob = self._parse_generate(body)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_finish(req: Request) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

        req = Request(rid=rid, input_ids=ids, params=params, on_finish=on_finish)
        try:
            self.scheduler.submit(req)
        except DuplicateRid as e:
            raise BadRequest(str(e)) from None
        try:
            done = await asyncio.shield(fut)
        except asyncio.CancelledError:  # client went away: free the slot like SGLang does
            self.scheduler.call(lambda: self.scheduler.abort(rid, "Abort: client disconnected"))
            raise
        if done.error is not None:  # a 5xx: the client retries on another server
            return _err(f"engine failed while generating rid {rid!r}: {done.error}", status=500)
        return web.json_response(self._response(done, return_logprob))

    def _response(self, req: Request, return_logprob: bool) -> dict:
        spans, start = [], 0
        for i in range(1, len(req.versions) + 1):
            if i == len(req.versions) or req.versions[i] != req.versions[start]:
                spans.append({"version": req.versions[start], "start": start, "end": i})
                start = i
        meta = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.scheduler.weight_version,
            "weight_versions": spans,
            "e2e_latency": time.monotonic() - req.created,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
        out = {"output_ids": req.output_ids, "meta_info": meta}
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        return out

    # ------------------------------------------------------------------ request control
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not isinstance(rid, str):
            raise BadRequest("abort_request needs a string rid or abort_all=true", schema=True)
        target = None if abort_all else rid
        await self._on_scheduler(lambda: self.scheduler.abort(target, "Abort by abort_request"))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"pause_generation mode must be abort, retract or in_place, got {mode!r}")
        if mode == "abort":
            await self._on_scheduler(self.scheduler.pause)
        else:  # in_place and retract: running requests keep their state and resume on continue
            await self._on_scheduler(lambda: setattr(self.scheduler, "paused", True))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._json(request)
        await self._on_scheduler(self.scheduler.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", 0) or 0)
        except ValueError:
            raise BadRequest(f"flush_cache timeout must be a number, got {request.query['timeout']!r}") from None
        deadline = time.monotonic() + timeout
        while True:
            if await self._on_scheduler(self.scheduler.is_idle):
                # no prefix cache to clear: KV lives only with running requests
                return web.Response(text="Cache flushed.\nPlease check backend logs for more details. ")
            if time.monotonic() >= deadline:
                return web.Response(status=400, text="Cache not flushed because there are running requests.")
            await asyncio.sleep(_FLUSH_POLL_S)

    # ------------------------------------------------------------------ weight updates
    @staticmethod
    def _result(ok: bool, message: str, **extra) -> web.Response:
        return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)

    async def init_group(self, request: web.Request) -> web.Response:
        b = await self._json(request)
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
        b = await self._json(request)
        name = str(b.get("group_name", "weight_update_group"))
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.receiver.destroy_group, name)
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to destroy group: {e}")
        return self._result(True, "Succeeded to destroy custom process group.")

    def _apply_update(self, load, b: dict) -> None:
        """Runs on the scheduler thread: optional abort, the load, then the version bump."""
        if b.get("abort_all_requests"):
            self.scheduler.abort(None, "Abort by weight update")
        load()
        if b.get("weight_version") is not None:
            self.scheduler.weight_version = str(b["weight_version"])

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        b = await self._json(request)
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
        group, fmt = str(b.get("group_name", "weight_update_group")), b.get("load_format")

        def load():
            self.receiver.receive(metas, group, fmt)

        try:
            await self._on_scheduler(lambda: self._apply_update(load, b))
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to update weights: {type(e).__name__}: {e}")
        return self._result(True, "Succeeded to update model weights.")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        b = await self._json(request)
        path = b.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("update_weights_from_disk needs model_path (str)", schema=True)
        try:
            await self._on_scheduler(lambda: self._apply_update(lambda: self.receiver.load_from_disk(path), b))
        except Exception as e:  # noqa: BLE001
            return self._result(False, f"Failed to update weights: {type(e).__name__}: {e}", num_paused_requests=0)
        self.model_path = path
        return self._result(True, "Succeeded to update model weights.", num_paused_requests=0)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        await self._json(request)
        return self._result(False, "update_weights_from_tensor (CUDA IPC) is not supported by the embedded engine")

    async def begin_update(self, request: web.Request) -> web.Response:
        await self._json(request)
        await self._on_scheduler(lambda: setattr(self.scheduler, "updating", True))
        return self._result(True, "Weight update begun.")

    async def end_update(self, request: web.Request) -> web.Response:
        await self._json(request)
        await self._on_scheduler(lambda: setattr(self.scheduler, "updating", False))
        return self._result(True, "Weight update ended.")

    # ------------------------------------------------------------------ health and info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.scheduler.alive:
            return web.Response(status=503)
        if self.scheduler.paused or self.scheduler.updating:
            return web.Response(status=200)  # a probe would wait for continue
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}, self.vocab_size)
        req = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0], params=params,
                      on_finish=lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)))
        self.scheduler.submit(req)
        done = await asyncio.wait_for(fut, timeout=20)
        return web.Response(status=200 if done.output_ids or done.finish_reason["type"] == "abort" else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "host": self.host,
            "port": self.port,
            "tp_size": 1,
            "dp_size": 1,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "random_seed": self.seed,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_length,
            "max_total_num_tokens": self.context_length * self.max_running_requests,
            "skip_tokenizer_init": self.tokenizer is None,
            "version": SGLANG_COMPAT_VERSION,
            "engine": "areal_fast.embedded",
            "weight_version": self.scheduler.weight_version,
            "paused": self.scheduler.paused,
            "num_running_requests": self.scheduler.num_in_flight(),
        })
