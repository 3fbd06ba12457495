"""aiohttp front end of the embedded engine: SGLang's HTTP subset with SGLang's JSON shapes.

It behaves as one chosen SGLang release (``sglang_version``, default the newest we support); every
version-gated behaviour is named in ``compat.SGLangBehaviour`` and described in docs/sglang.md.

This module owns the model, the scheduler and the aiohttp app: the routes, the api-key
middleware (which turns each validation error into SGLang's answer; idle and unauthenticated
connections are limited by ``http/conn_guard.py``, ``conn_limits``), /generate and its answer,
the request control (abort, pause, continue, flush), /health and the info endpoints. Bodies are
read and checked by ``engine/request_parsing.py`` (limits, JSON, sampling keys, the /generate
body); the weight-update endpoints are ``engine/weight_routes.py`` (``WeightUpdateRoutes``, a part
of ``EngineServer``).

Handlers validate up front and answer 400 with ``{"error": {"message": ...}}`` (or
``{"object": "error", "message": ..., "code": 400}`` for schema failures, as SGLang does) naming the
bad field; anything that touches the model goes through ``Scheduler.call`` so it runs between two
decode steps on the scheduler thread. Rendezvous and broadcast receives run in the default executor
(bounded by the group timeout) so the event loop keeps answering meanwhile, and bodies over
``request_parsing.PARSE_OFF_LOOP_BYTES`` are parsed there too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import torch
from aiohttp import web

from areal_fast.backends.sglang.compat import ENGINE_LOAD_FORMATS, SGLangBehaviour
from areal_fast.backends.vllm.compat import DEFAULT_VLLM_VERSION, VLLMBehaviour
from areal_fast.embedded.request_parsing import (  # noqa: F401 - the errors are part of this module's API
    BYTES_PER_ID,
    GENERATE_OVERHEAD,
    UPDATE_META_LIMIT,
    BadRequest,
    ContractError,
    InternalServerError,
    parse_generate,
    parse_routed_experts,
    read_json,
)
from areal_fast.embedded.sampling import parse_sampling_params
from areal_fast.embedded.scheduler import DuplicateRid, Request, Scheduler, SchedulerDown
from areal_fast.embedded.weight_routes import FLUSH_REFUSED, WeightUpdateRoutes  # noqa: F401
from areal_fast.embedded.weight_sync import DEFAULT_GROUP_TIMEOUT_S, WeightReceiver, parse_dtype
from areal_fast.http.auth import AUTH_EXEMPT_PREFIXES
from areal_fast.http.conn_guard import MAX_UNAUTHENTICATED, ConnLimits, authorize
from areal_fast.rollout.config import PAUSE_MODES
from areal_fast.rollout.routed_experts import to_sglang

log = logging.getLogger(__name__)
_FLUSH_POLL_S = 0.01
_HEALTH_POLL_S = 0.01
# SGLang's probe waits this long for any output before /health answers 503 (env as in SGLang).
DEFAULT_HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))

# aiohttp does not cancel a handler whose client went away (handler_cancellation is off), so a
# waiting /generate looks at its connection this often; SGLang aborts such a request too.
DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    """The client of a waiting /generate closed its connection."""


async def _until_done_or_gone(fut: asyncio.Future, request: web.Request):
    """``await fut``, or ClientGone (``fut`` cancelled) once the request's connection has closed."""
    while True:
        done, _ = await asyncio.wait([fut], timeout=DISCONNECT_POLL_S)
        if done:
            return fut.result()
        transport = request.transport
        if transport is None or transport.is_closing():
            fut.cancel()
            raise ClientGone(f"{request.path}: the client closed its connection")


def _err(message: str, schema: bool = False, status: int = 400) -> web.Response:
    body = {"object": "error", "message": message, "code": status} if schema else {"error": {"message": message}}
    return web.json_response(body, status=status)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name in ("auto", None):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(name)


class EngineServer(WeightUpdateRoutes):
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
        health_check_timeout_s: float | None = None,
        dist_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        api: str = "sglang",
        vllm_version: str | None = None,
        conn_limits: ConnLimits | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        return_routed_experts: bool = False,
        max_model_len: int | None = None,
        served_model_names: list[str] | None = None,
        prefix_caching: bool = False,
        scheduling_policy: str | None = None,
        weight_transfer_backend: str = "nccl",
        quantization: str | None = None,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.sglang = SGLangBehaviour.of(sglang_version)
        if api not in ("sglang", "vllm"):
            raise ValueError(f"--api {api!r}: the embedded engine speaks 'sglang' or 'vllm'")
        self.api = api  # 'vllm': vLLM's routes instead of SGLang's (embedded/vllm_routes.py)
        self.vllm = VLLMBehaviour.of(vllm_version or DEFAULT_VLLM_VERSION) if api == "vllm" else None
        if load_format not in ENGINE_LOAD_FORMATS:
            raise ValueError(f"--load-format {load_format!r}: the embedded engine loads {ENGINE_LOAD_FORMATS}")
        if dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {dist_timeout_s}")
        self.model_path = model_path
        self.host, self.port, self.api_key = host, port, api_key
        # idle connections (http/conn_guard.py); the rollout client opens one connection per request in
        # flight, up to the requests this engine runs: a run's start burst is its own, not a flood
        self.conn_limits = conn_limits or ConnLimits(max_unauthenticated=max(MAX_UNAUTHENTICATED,
                                                                             max_running_requests))
        self.load_format = load_format
        self.launch_weight_version = weight_version
        self.health_check_timeout_s = (DEFAULT_HEALTH_CHECK_TIMEOUT_S if health_check_timeout_s is None
                                       else health_check_timeout_s)
        self.device = torch.device(device)
        self.dtype = _resolve_dtype(dtype, self.device)
        torch.manual_seed(seed)
        self.config = AutoConfig.from_pretrained(model_path)
        if load_format == "dummy":  # SGLang's dummy format: random weights, nothing read from disk
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype,
                                                     attn_implementation=attn_implementation)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation=attn_implementation
            )
        self.model = model.to(self.device).eval()
        if quantization is not None:  # SGLang's / vLLM's --quantization: serve the block-FP8 weights
            from areal_fast.embedded.fp8 import QUANTIZATIONS, serve_fp8

            if quantization not in QUANTIZATIONS:
                raise ValueError(f"--quantization {quantization!r}: the embedded engine serves {QUANTIZATIONS[1:]}")
            serve_fp8(self.model)
        self.tokenizer = None if skip_tokenizer_init else self._try_tokenizer(model_path)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.config, "max_position_embeddings", 2**31 - 1))
        if api != "vllm" and (max_model_len is not None or served_model_names or prefix_caching
                              or scheduling_policy is not None):
            raise ValueError("max_model_len, served_model_names, prefix_caching and scheduling_policy are vLLM's: "
                             "api 'vllm' only")
        if max_model_len is not None:  # vLLM's --max-model-len (the twin's routes check it as vLLM does)
            if max_model_len < 1:
                raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
            self.context_length = int(max_model_len)
        # vLLM's --served-model-name; without it the launcher's name ('default'), and the checkpoint's path
        self.served_model_names = list(served_model_names) if served_model_names else None
        self.prefix_caching = bool(prefix_caching)  # reported only: the twin caches no prefix
        # vLLM's --weight-transfer-config backend: the wire of /update_weights (embedded/vllm_routes.py)
        from areal_fast.backends.vllm.compat import check_twin_transfer_backend

        self.weight_transfer_backend = check_twin_transfer_backend(weight_transfer_backend, self.vllm)
        self.generate_limit = GENERATE_OVERHEAD + BYTES_PER_ID * min(self.context_length, 1 << 22)
        self.max_running_requests = max_running_requests
        self.seed = seed
        self.scheduler = Scheduler(
            self.model,
            eos_token_ids=self._eos_ids(),
            max_running=max_running_requests,
            seed=seed,
            weight_version=weight_version,
            tokenizer=self.tokenizer,
            policy=scheduling_policy or "fcfs",  # vLLM's --scheduling-policy (SGLang's routes: first come first served)
        )
        self.receiver = WeightReceiver(self.model, timeout_s=dist_timeout_s)
        self.lora = None  # LoRA adapters (engine/lora.py), wrapped after the receiver took the base's names
        if enable_lora:
            from areal_fast.embedded.lora import LoRAServing

            self.lora = LoRAServing(self.model, max_lora_rank=max_lora_rank, max_loras=max_loras)
            self.scheduler.lora = self.lora
        self.routing = None  # --enable-return-routed-experts: engine/routing_capture.py
        if return_routed_experts:
            from areal_fast.embedded.routing_capture import RoutingCapture, check_release

            check_release(api, self.vllm.version if self.vllm is not None else self.sglang.version)
            self.routing = self.scheduler.routing = RoutingCapture(self.model)
        self.session_open = False  # a begin_weight_update without its end (SGLang >= 0.5.21)
        self.scheduler.start()

    def serves_model_name(self, name) -> bool:
        """Whether a vLLM completion's ``model`` names the base model: left out, one of
        ``--served-model-name``, or without that flag 'default' (the launcher's name) or the
        checkpoint's path."""
        if name in (None, ""):
            return True
        if self.served_model_names is not None:
            return name in self.served_model_names
        return name in ("default", self.model_path)

    @staticmethod
    def _try_tokenizer(path: str):
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
        limit = max(self.generate_limit, UPDATE_META_LIMIT)
        app = web.Application(middlewares=[self._middleware], client_max_size=limit)
        r = app.router
        if self.vllm is not None:  # the vLLM twin: vLLM's routes of that release, none of SGLang's
            from areal_fast.embedded.vllm_routes import VLLMRoutes

            VLLMRoutes(self, str(self.vllm.version), _until_done_or_gone).add(r)
            if self.lora is not None:
                self._lora_routes().add_vllm(r)
            app.on_shutdown.append(self._on_shutdown)
            return app
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        self._add_weight_routes(r)
        if self.lora is not None:
            self._lora_routes().add_sglang(r)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        for path in ("/model_info", "/get_model_info"):  # the get_ forms are deprecated in SGLang
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        app.on_shutdown.append(self._on_shutdown)
        return app

    def _lora_routes(self):
        from areal_fast.embedded.lora import LoRARoutes

        return LoRARoutes(self)

    async def _on_shutdown(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        # the vLLM twin asks the key as a launched vLLM's key guard does: on every path but /health
        exempt = AUTH_EXEMPT_PREFIXES if self.vllm is None else ("/health",) if request.path == "/health" else ()
        if not authorize(request, self.api_key, exempt=exempt):  # http/auth.py's check, via http/conn_guard.py
            return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except BadRequest as e:
            return _err(str(e), schema=e.schema, status=e.status)
        except ContractError as e:
            return web.json_response({"error": str(e)}, status=400)
        except InternalServerError:
            return web.Response(status=500, text="Internal Server Error")
        except SchedulerDown as e:
            return _err(f"the engine's scheduler is down: {e}", status=503)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - a 500 with a message instead of a stack trace
            return _err(f"{type(e).__name__}: {e}", status=500)

    async def _on_scheduler(self, fn):
        """Run ``fn`` on the scheduler thread, between two decode steps."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ------------------------------------------------------------------ /generate
    async def generate(self, request: web.Request) -> web.Response:
        body = await read_json(request, self.generate_limit)
        rids, ids, params, return_logprob = parse_generate(body, self.vocab_size, self.context_length,
                                                           self.tokenizer is not None, self.sglang)
        lora = self._lora_routes().adapter_of_generate(body) if "lora_path" in body else None
        routing_start = parse_routed_experts(body, len(ids), self.sglang)
        if self.routing is None:
            routing_start = None  # asked of a server started without the flag: no field, as SGLang answers
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future] = []
        submitted: list[str] = []
        try:
            for rid in rids:
                fut: asyncio.Future = loop.create_future()

                def on_finish(req: Request, fut=fut) -> None:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

                self.scheduler.submit(Request(rid=rid, input_ids=list(ids), params=params, on_finish=on_finish,
                                              lora=lora, routing_start=routing_start))
                submitted.append(rid)
                futs.append(fut)
        except DuplicateRid as e:
            for rid in submitted:
                self.scheduler.call(lambda rid=rid: self.scheduler.abort(rid, "Abort: sibling refused"))
            raise BadRequest(str(e)) from None
        try:
            done = await _until_done_or_gone(asyncio.gather(*futs), request)
        except (asyncio.CancelledError, ClientGone):  # client went away: free the slots like SGLang does
            for rid in rids:
                self.scheduler.call(lambda rid=rid: self.scheduler.abort(rid, "Abort: client disconnected"))
            raise
        failed = [d for d in done if d.error is not None]
        if failed:  # a 5xx: the client retries on another server
            return _err(f"engine failed while generating rid {failed[0].rid!r}: {failed[0].error}", status=500)
        answers = [self._response(d, return_logprob) for d in done]
        return web.json_response(answers if params.n > 1 else answers[0])

    def _response(self, req: Request, return_logprob: bool) -> dict:
        meta = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "total_retractions": req.retractions,
            "e2e_latency": time.monotonic() - req.created,
        }
        if not req.aborted_in_waiting or self.sglang.abort_in_waiting_has_weight_version:
            meta["weight_version"] = self.scheduler.weight_version
        if self.sglang.weight_version_spans:
            spans, start = [], 0
            for i in range(1, len(req.versions) + 1):
                if i == len(req.versions) or req.versions[i] != req.versions[start]:
                    spans.append({"version": req.versions[start], "start": start, "end": i})
                    start = i
            meta["weight_versions"] = spans
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
        # SGLang collects the routing of a request that ran (finished or aborted while running); one
        # aborted in the waiting queue is answered without it
        if self.routing is not None and req.routing_start is not None and not req.aborted_in_waiting:
            rows = self.routing.rows_of(req)
            if rows is not None:
                meta["routed_experts"] = to_sglang(rows)
            req.routing = None
        out = {"output_ids": req.output_ids, "meta_info": meta}
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        return out

    # ------------------------------------------------------------------ request control
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if not abort_all and not isinstance(rid, str):
            raise BadRequest("abort_request needs a string rid or abort_all=true", schema=True)
        # SGLang aborts every request whose rid starts with the given one ("" aborts everything)
        target = None if abort_all else rid
        await self._on_scheduler(lambda: self.scheduler.abort(target, "Abort by abort_request"))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause_generation mode must be one of {PAUSE_MODES}, got {mode!r}", schema=True)
        await self._on_scheduler(lambda: self.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request)
        await self._on_scheduler(self.scheduler.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        raw = request.query.get("timeout", "0") or "0"
        try:
            timeout = float(raw)
        except ValueError:
            raise BadRequest(f"flush_cache timeout must be a number, got {raw!r}") from None
        if not 0 <= timeout < float("inf"):
            raise BadRequest(f"flush_cache timeout must be a finite number >= 0, got {raw!r}")
        deadline = time.monotonic() + timeout
        while True:
            if await self._on_scheduler(self.scheduler.is_idle):
                # no prefix cache to clear: KV lives only with running requests
                return web.Response(text="Cache flushed.\nPlease check backend logs for more details. ")
            if time.monotonic() >= deadline:
                return web.Response(status=400, text="Cache not flushed because there are running requests.")
            await asyncio.sleep(_FLUSH_POLL_S)

    # ------------------------------------------------------------------ health and info
    async def health(self, request: web.Request) -> web.Response:
        """SGLang's probe: a 1-token request; 200 as soon as the scheduler produces ANY output after the
        probe was sent, 503 if nothing comes within the health-check timeout (so a server paused for
        longer than that answers 503), and 503 at once when the scheduler is down."""
        if not self.scheduler.alive:
            return web.Response(status=503)
        loop = asyncio.get_running_loop()
        tic = time.monotonic()
        done = loop.create_future()
        params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}, self.vocab_size)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        try:
            self.scheduler.submit(Request(rid=rid, input_ids=[0], params=params,
                                          on_finish=lambda r: loop.call_soon_threadsafe(
                                              lambda: done.done() or done.set_result(r))))
        except SchedulerDown:
            return web.Response(status=503)
        try:
            while time.monotonic() < tic + self.health_check_timeout_s:
                if done.done() or self.scheduler.last_output > tic:
                    return web.Response(status=200)
                if not self.scheduler.alive:
                    return web.Response(status=503)
                await asyncio.sleep(_HEALTH_POLL_S)
            return web.Response(status=503)
        finally:
            if not done.done():
                self.scheduler.call(lambda: self.scheduler.abort(rid, "Abort: health probe done"))

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,  # the current one
            "load_format": self.load_format,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        })

    async def server_info(self, request: web.Request) -> web.Response:
        # from 0.5.19 the launch configuration: weight_version is the launch value, /model_info the current
        wv = (self.launch_weight_version if self.sglang.server_info_weight_version_is_launch_value
              else self.scheduler.weight_version)
        return web.json_response({
            "model_path": self.model_path,
            "host": self.host,
            "port": self.port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "random_seed": self.seed,
            "load_format": self.load_format,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_length,
            "max_total_num_tokens": self.context_length * self.max_running_requests,
            "skip_tokenizer_init": self.tokenizer is None,
            "version": str(self.sglang.version),
            "engine": "areal_fast.embedded",
            "weight_version": wv,
            "paused": self.scheduler.paused,
            "num_running_requests": self.scheduler.num_in_flight(),
        })
