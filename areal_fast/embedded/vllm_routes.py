"""The embedded engine as vLLM's twin (``--api vllm --vllm-version X``): vLLM's HTTP routes of release
X over the same model and scheduler as the SGLang routes (``docs/vllm.md`` has the facts, per version;
the gates are ``compat.VLLMBehaviour``).

Served (each only from the release that has it, as the version table says):
``POST /v1/completions`` (token ids in, ``token_ids`` and per-token ``logprobs.token_logprobs`` out,
``weight_versions`` spans from 0.33.0), ``GET /health``, ``GET /version``, ``GET /v1/models``,
``GET /server_info`` (the parallel layout),
``POST /collective_rpc`` (``reload_weights`` / ``update_config``: the disk update),
``POST /pause`` / ``/resume``, ``GET /is_paused`` (0.12.0), ``POST /abort_requests`` (0.26.0),
``/shutdown_weight_transfer_engine`` (0.32.0),
``/init_weight_transfer_engine`` and ``/update_weights`` (0.16.0; the NCCL backend's unpacked wire:
one broadcast per tensor from rank 0, over gloo on CPU; with ``--weight-transfer-config
'{"backend": "sparse_nccl"}'`` (0.32.0 on) the sparse backend's: per checkpoint-coordinate patch its
int32 flat indices, then its values, applied to those elements only, NaN values refused as vLLM does),
``/start_weight_update`` and ``/finish_weight_update`` (0.21.0), ``/update_weight_version`` and
``GET /weight_info`` (0.27.0).

Pause modes map onto the scheduler's: vLLM's abort is ours, keep is ``in_place`` (running requests
stay frozen with their KV) or, from 0.20.0 with ``clear_cache=true`` (vLLM's default), ``retract``
(their KV is dropped and recomputed at /resume: vLLM preempts them); wait lets the running requests
finish, then pauses. A completion that arrives during an abort or wait pause is answered 503 from
0.33.0; before, and in keep mode, it is queued and runs after /resume (vLLM's scheduler holds it).
0.16.x's /is_paused answers false during a keep pause, as vLLM's does.

Routed experts (``--enable-return-routed-experts``, docs/moe.md): each choice carries
``routed_experts`` from 0.27.0 (null when the server does not record them or nothing was forwarded),
base64 ``.npy`` of the rows ``[routed_experts_prompt_start, seqlen - 1)``; the request field
``routed_experts_prompt_start`` from 0.32.0, refused as vLLM refuses it (400 naming it) when
negative or past the prompt.

Started as vLLM is (``--max-model-len``, ``--served-model-name``), a completion is checked as vLLM
0.32.0 and 0.33.0 check it, in their order and words: a ``model`` it does not serve is 404 (the
served names listed from 0.32.0), more ``max_tokens`` than the context, a prompt longer than the
context or one that fills it are 400 naming the parameter, and a request that fits gets at most
the rest of the context. ``GET /server_info`` reports ``cache_config.enable_prefix_caching`` as
the twin was started (``--[no-]enable-prefix-caching``; it caches no prefix). Every path but
``/health`` asks the key, as a launched vLLM's key guard does (``backends/vllm/keyguard``).

Scheduling (``--scheduling-policy``, vLLM's flag): the waiting queue is first come first served by
default; with ``priority`` it runs the completions of the lowest ``priority`` first, then by arrival,
as vLLM's priority queue does (``embedded/scheduler.py``). A completion's ``priority`` field (a
64-bit integer, 400 otherwise as vLLM's schema answers) is accepted under either policy: vLLM 0.32.0
and 0.33.0 take a priority under first come first served without a word (their field's description
says otherwise) and ignore it, and so does the twin. ``GET /server_info`` reports
``scheduler_config.policy``.

Request ids are vLLM's: a completion with ``request_id`` R is registered as ``cmpl-R-0`` (the
engine's id of its one choice) and /abort_requests matches that id only; its answer is
``{"aborted": <number of ids given>}`` whether or not they matched, as vLLM answers.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import torch
from aiohttp import web

from areal_fast.backends.vllm.compat import TWIN_TRANSFER_GROUP, VLLM_PAUSE_MODES, VLLMBehaviour
from areal_fast.backends.vllm.requests import engine_request_id
from areal_fast.embedded.request_parsing import BadRequest, read_json
from areal_fast.embedded.sampling import SamplingError, parse_sampling_params
from areal_fast.embedded.scheduler import Request
from areal_fast.embedded.weight_sync import TensorMeta, parse_dtype
from areal_fast.rollout.routed_experts import to_vllm
from areal_fast.weights.delta_wire import DELTA_VAL, delta_name

TRANSFER_GROUP = TWIN_TRANSFER_GROUP
_WAIT_POLL_S = 0.01
# vLLM CompletionRequest field -> our scheduler's sampling key
_TO_SAMPLING = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "min_p": "min_p", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
                "stop_token_ids": "stop_token_ids"}
# fields read here, or accepted at their neutral value
_ACCEPTED = {"model", "prompt", "stream", "echo", "logprobs", "return_token_ids", "request_id", "n", "seed",
             "min_tokens", "return_weight_versions", "frequency_penalty", "presence_penalty",
             "repetition_penalty", "spaces_between_special_tokens", "stop", "priority"}
_INT64 = (-(2**63), 2**63 - 1)  # the range of vLLM's integer request fields (priority)


def _vllm_error(message: str, status: int = 400, param: str | None = None, value=None) -> web.Response:
    """vLLM's error answer; with ``param``, its validation error's (the message names the parameter and value)."""
    error = {"message": message, "type": "NotFoundError" if status == 404 else "BadRequestError", "code": status}
    if param is not None:
        error["param"] = param
        if status == 400:
            error["message"] = f"{message} (parameter={param}, value={value})"
    return web.json_response({"error": error}, status=status)


def _schema_error(field: str, value, bound: int | None) -> web.Response:
    """vLLM's 400 for a request field its schema refuses: not an integer (``bound`` None), or past an
    integer ``bound`` (a lower bound when the value is below it, else the upper one)."""
    if bound is None:
        kind, msg, ctx = "int_type", "Input should be a valid integer", ""
    else:
        below = value < bound
        kind, words, op = ("greater_than_equal", "greater", "ge") if below else ("less_than_equal", "less", "le")
        msg, ctx = f"Input should be {words} than or equal to {bound}", f", 'ctx': {{'{op}': {bound}}}"
    detail = f"{{'type': '{kind}', 'loc': 'body.{field}', 'msg': '{msg}', 'input': '{value}'{ctx}}}"
    return web.json_response({"error": {"message": f"1 validation error:\n  {detail}", "type": "Bad Request",
                                        "param": f"body.{field}", "code": 400}}, status=400)


class VLLMRoutes:
    """vLLM's routes on an ``EngineServer`` (``server``): its scheduler, receiver and tokenizer."""

    def __init__(self, server, version: str, until_done):
        self.s = server
        self.until_done = until_done  # server._until_done_or_gone: the answer, or ClientGone
        self.b = VLLMBehaviour.of(version)
        self.pause_mode: str | None = None  # vLLM's mode while paused
        self.update_open = False

    def add(self, r: web.UrlDispatcher) -> None:
        b = self.b
        r.add_post("/v1/completions", self.completions)
        r.add_get("/health", self.health)
        r.add_get("/version", self.version)
        r.add_get("/v1/models", self.models)
        r.add_post("/collective_rpc", self.collective_rpc)
        r.add_get("/server_info", self.server_info)
        if b.has_pause:
            r.add_post("/pause", self.pause)
            r.add_post("/resume", self.resume)
            r.add_get("/is_paused", self.is_paused)
        if b.has_abort_requests:
            r.add_post("/abort_requests", self.abort_requests)
        if b.has_weight_transfer:
            r.add_post("/init_weight_transfer_engine", self.init_transfer)
            r.add_post("/update_weights", self.update_weights)
        if b.has_transfer_shutdown:
            r.add_post("/shutdown_weight_transfer_engine", self.shutdown_transfer)
        if b.weight_update_sessions:
            r.add_post("/start_weight_update", self.start_update)
            r.add_post("/finish_weight_update", self.finish_update)
        if b.labels_weight_version:
            r.add_post("/update_weight_version", self.update_weight_version)
            r.add_get("/weight_info", self.weight_info)

    # ------------------------------------------------------------------ generation
    def _parse(self, body: dict) -> tuple[str, list[int], object, dict]:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < self.s.vocab_size
                                                            for t in prompt)):
            raise BadRequest(f"prompt: the twin takes a non-empty list of token ids < {self.s.vocab_size}")
        if body.get("stream") or body.get("echo") or body.get("n", 1) != 1:
            raise BadRequest("stream, echo and n > 1 are not served by the embedded engine")
        unknown = sorted(set(body) - _ACCEPTED - set(_TO_SAMPLING))
        if self._has_prompt_start:
            unknown = [k for k in unknown if k != "routed_experts_prompt_start"]
        if unknown:
            raise BadRequest(f"{unknown[0]}: not served by the embedded engine's vLLM twin")
        raw = {_TO_SAMPLING[k]: v for k, v in body.items() if k in _TO_SAMPLING and v is not None}
        raw.setdefault("max_new_tokens", 16)  # vLLM's default max_tokens
        if raw.get("top_k") in (0, -1):
            raw.pop("top_k")
        try:
            params = parse_sampling_params(raw, self.s.vocab_size)
        except SamplingError as e:
            raise BadRequest(str(e)) from None
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        return engine_request_id(rid), list(prompt), params, body

    async def completions(self, request: web.Request) -> web.Response:
        body = await read_json(request, self.s.generate_limit)
        if self.s.scheduler.paused and self.pause_mode in ("abort", "wait") and self.b.refuses_during_pause:
            return _vllm_error("the engine is paused: retry after /resume", status=503)
        rid, prompt, params, body = self._parse(body)
        lora = None
        if self.s.lora is not None:  # an adapter named as the model (engine/lora.py); vLLM's 404 otherwise
            from areal_fast.embedded.lora import LoRARoutes, _NotFound

            try:
                lora = LoRARoutes(self.s).adapter_of_completion(body)
            except _NotFound:
                return self._unknown_model(body)
        elif not self.s.serves_model_name(body.get("model")):
            return self._unknown_model(body)
        too_long = self._context_check(body, prompt, params)
        if too_long is not None:
            return too_long
        routing_start = self._routing_start(body, len(prompt))
        if isinstance(routing_start, web.Response):
            return routing_start
        priority = body.get("priority", 0)
        if type(priority) is not int or not _INT64[0] <= priority <= _INT64[1]:
            return _schema_error("priority", priority, None if type(priority) is not int else
                                 _INT64[0] if priority < _INT64[0] else _INT64[1])
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self.s.scheduler.submit(Request(rid=rid, input_ids=prompt, params=params, lora=lora, priority=priority,
                                        routing_start=routing_start if self.s.routing is not None else None,
                                        on_finish=lambda req: loop.call_soon_threadsafe(
                                            lambda: fut.done() or fut.set_result(req))))
        try:
            req = await self.until_done(fut, request)
        except BaseException:  # the client went away (vLLM aborts such a request too)
            self.s.scheduler.call(lambda: self.s.scheduler.abort(rid, "Abort: client disconnected"))
            raise
        if req.error is not None:
            return _vllm_error(f"engine failed on request {rid!r}: {req.error}", status=500)
        return web.json_response(self._answer(req, body))

    def _unknown_model(self, body: dict) -> web.Response:
        """vLLM's 404 for a completion naming a model it does not serve."""
        message = f"The model `{body.get('model')}` does not exist."
        if self.b.names_model_aliases:
            message += f" Valid aliases: {', '.join(self.s.served_model_names or ['default'])}."
        return _vllm_error(message, status=404, param="model")

    def _context_check(self, body: dict, prompt: list[int], params) -> web.Response | None:
        """vLLM's checks of the context (``--max-model-len``, else the model's max_position_embeddings),
        in its order and words (0.32.0 and 0.33.0): more tokens asked than the context, a prompt longer
        than it, a prompt that fills it (no room for one token: vLLM asks for 0 and refuses that). A
        request that fits gets at most the rest of the context, as vLLM caps ``max_tokens``."""
        context, n = self.s.context_length, len(prompt)
        asked = body.get("max_tokens")
        if isinstance(asked, int) and asked > context:
            return _vllm_error(f"max_tokens={asked} cannot be greater than max_model_len={context}. Please request "
                               f"fewer output tokens.", param="max_tokens", value=asked)
        if n > context:
            qualifier = "at least " if n == context + 1 else ""
            return _vllm_error(f"This model's maximum context length is {context} tokens. However, your prompt "
                               f"contains {qualifier}{n} input tokens, which exceeds this limit even without any "
                               f"output tokens. Please reduce the length of the input prompt.",
                               param="input_tokens", value=n)
        if n == context:
            return _vllm_error("max_tokens must be at least 1, got 0.", param="max_tokens", value=0)
        params.max_new_tokens = min(params.max_new_tokens, context - n)
        return None

    @property
    def _has_prompt_start(self) -> bool:
        return self.b.has_routed_experts_prompt_start

    def _routing_start(self, body: dict, prompt_len: int) -> int | web.Response:
        """``routed_experts_prompt_start`` (0 when left out), or vLLM's 400 for a bad one: its schema's
        answer for a negative or non-integer value, its input check's past the prompt. Checked whether
        or not the server records routing, as vLLM does."""
        start = body.get("routed_experts_prompt_start", 0) if self._has_prompt_start else 0
        if type(start) is not int or start < 0:
            return _schema_error("routed_experts_prompt_start", start, 0 if type(start) is int else None)
        if start > prompt_len:
            return web.json_response({"error": {
                "message": f"routed_experts_prompt_start must be between 0 and the prompt length ({prompt_len}), "
                           f"inclusive. (parameter=routed_experts_prompt_start, value={start})",
                "type": "BadRequestError", "param": "routed_experts_prompt_start", "code": 400}}, status=400)
        return start

    def _answer(self, req: Request, body: dict) -> dict:
        kind = (req.finish_reason or {}).get("type", "length")
        choice = {"index": 0, "text": "", "finish_reason": kind if kind in ("stop", "abort") else "length",
                  "stop_reason": (req.finish_reason or {}).get("matched")}
        if self.s.tokenizer is not None:
            choice["text"] = self.s.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"text_offset": [], "token_logprobs": list(req.logprobs),
                                  "tokens": [f"token_id:{t}" for t in req.output_ids], "top_logprobs": []}
        if body.get("return_token_ids"):
            choice["token_ids"] = list(req.output_ids)
            choice["prompt_token_ids"] = list(req.input_ids)
        if body.get("return_weight_versions") and self.b.token_weight_versions:
            choice["weight_versions"] = _spans(req.versions)
        if self.b.returns_routed_experts:  # null unless recorded and something was forwarded
            rows = self.s.routing.rows_of(req) if self.s.routing is not None else None
            choice["routed_experts"] = None if rows is None else to_vllm(rows, self.s.routing.num_experts)
            req.routing = None
        n_out = len(req.output_ids)
        return {"id": req.rid.removesuffix("-0"), "object": "text_completion", "created": int(time.time()),
                "model": str(body.get("model") or "default"), "choices": [choice],
                "usage": {"prompt_tokens": len(req.input_ids), "completion_tokens": n_out,
                          "total_tokens": len(req.input_ids) + n_out}}

    # ------------------------------------------------------------------ health and info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.s.scheduler.alive else 503)  # paused or not: vLLM's rule

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": str(self.b.version)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "root": self.s.model_path, "owned_by": "vllm",
             "max_model_len": self.s.context_length} for name in self.s.served_model_names or ["default"]]})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode ``GET /server_info?config_format=json``: the parts of ``vllm_config`` the
        weight-transfer sender reads (the parallel layout: the server's ranks in the transfer group,
        and the device), plus ``areal_fast_engine`` so the sender knows it talks to the twin."""
        parallel = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                    "data_parallel_size_local": 1}
        return web.json_response({"vllm_config": {"parallel_config": parallel,
                                                  "device_config": {"device": self.s.device.type},
                                                  "cache_config": {"enable_prefix_caching": self.s.prefix_caching},
                                                  "scheduler_config": {"policy": self.s.scheduler.policy},
                                                  "model_config": {"max_model_len": self.s.context_length},
                                                  "weight_transfer_config": {"backend": self._transfer_backend}},
                                  "areal_fast_engine": "embedded"})

    # ------------------------------------------------------------------ pause, resume, abort
    async def pause(self, request: web.Request) -> web.Response:
        q = request.query
        if self.b.has_pause_modes:
            mode = q.get("mode", "abort")
            if mode not in VLLM_PAUSE_MODES:
                return web.json_response({"detail": f"mode: input should be one of {VLLM_PAUSE_MODES}, got {mode!r}"},
                                         status=422)
        else:
            mode = "wait" if q.get("wait_for_inflight_requests", "false").lower() == "true" else "abort"
        if mode == "wait":
            while not await self.s._on_scheduler(self.s.scheduler.is_idle):
                await asyncio.sleep(_WAIT_POLL_S)
        clear = q.get("clear_cache", "true").lower() != "false"
        ours = "abort" if mode != "keep" else "retract" if clear and self.b.keep_clears_cache else "in_place"
        self.pause_mode = mode
        await self.s._on_scheduler(lambda: self.s.scheduler.pause(ours))
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        await self.s._on_scheduler(self.s.scheduler.resume)
        self.pause_mode = None
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        if self.b.is_paused_misses_keep and self.pause_mode == "keep":
            return web.json_response({"is_paused": False})
        return web.json_response({"is_paused": bool(self.s.scheduler.paused)})

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids:  # engine ids (cmpl-R-0); the scheduler aborts by prefix, and none of those is a prefix of another
            for rid in ids:
                await self.s._on_scheduler(lambda rid=str(rid): self.s.scheduler.abort(rid, "Abort by abort_requests"))
            n = len(ids)  # vLLM counts the ids it was given, matched or not
        else:
            n = await self.s._on_scheduler(lambda: self.s.scheduler.abort(None, "Abort by abort_requests"))
        return web.json_response({"status": "aborted", "aborted": n})

    # ------------------------------------------------------------------ weights
    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method is None:
            return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
        if method == "update_config":
            path = ((kwargs.get("overrides") or {}).get("model_config") or {}).get("model")
            if not isinstance(path, str):
                return _vllm_error("update_config: the twin takes overrides.model_config.model (a path)", 500)
            self.s.model_path = path
            return web.json_response({"results": [None]})
        if method != "reload_weights":
            return _vllm_error(f"collective_rpc method {method!r} is not served by the embedded engine", 500)
        if "weights_path" in kwargs and not self.b.reloads_from_path:
            return _vllm_error(f"reload_weights() got an unexpected keyword argument 'weights_path' "
                               f"(vLLM {self.b.version})", 500)
        path = kwargs.get("weights_path") or self.s.model_path
        named = await asyncio.get_running_loop().run_in_executor(None, self.s.receiver.read_from_disk, path)
        await self.s._on_scheduler(lambda: self.s.receiver.load(named))
        self.s.model_path = path
        return web.json_response({"results": [None]})

    async def init_transfer(self, request: web.Request) -> web.Response:
        info = (await read_json(request)).get("init_info")
        if not isinstance(info, dict):
            return web.json_response({"detail": "init_info: field required"}, status=422)
        backend = "nccl" if self.s.device.type == "cuda" else "gloo"
        args = (str(info["master_address"]), int(info["master_port"]), int(info["rank_offset"]),
                int(info["world_size"]), TRANSFER_GROUP, backend)
        if TRANSFER_GROUP in self.s.receiver.groups:
            self.s.receiver.destroy_group(TRANSFER_GROUP)
        await asyncio.get_running_loop().run_in_executor(None, self.s.receiver.init_group, *args)
        return web.json_response({"message": "Weight transfer initialized"})

    async def shutdown_transfer(self, request: web.Request) -> web.Response:
        if TRANSFER_GROUP in self.s.receiver.groups:
            await asyncio.get_running_loop().run_in_executor(None, self.s.receiver.destroy_group, TRANSFER_GROUP)
        return web.json_response({"message": "Weight transfer shut down"})

    async def start_update(self, request: web.Request) -> web.Response:
        if self.update_open:
            return _vllm_error("start_weight_update called while a weight update is already active", 500)
        self.update_open = True
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        info = (await read_json(request)).get("update_info")
        if not isinstance(info, dict):
            return web.json_response({"detail": "update_info: field required"}, status=422)
        if self.b.weight_update_sessions and not self.update_open:
            return _vllm_error("start_weight_update must be called before update_weights.", 500)
        if self._transfer_backend == "sparse_nccl":
            try:
                metas = sparse_metas(info)
            except (KeyError, TypeError, ValueError) as e:
                return _vllm_error(f"sparse update_info: {e}", 500)
        else:
            if "num_updates_list" in info:  # vLLM's dense NCCLWeightTransferUpdateInfo has no such field
                return _vllm_error("NCCLWeightTransferUpdateInfo got an unexpected keyword argument "
                                   "'num_updates_list' (the server runs backend nccl)", 500)
            metas = [TensorMeta(str(n), parse_dtype(str(d)), tuple(int(x) for x in s))
                     for n, d, s in zip(info.get("names", []), info.get("dtype_names", []), info.get("shapes", []))]
        named = await asyncio.get_running_loop().run_in_executor(None, self.s.receiver.receive, metas,
                                                                 TRANSFER_GROUP, None, False)
        if self._transfer_backend == "sparse_nccl":
            bad = [n for n, t in named if (t.is_floating_point() and bool(torch.isnan(t).any()))
                   or (t.dtype == torch.int32 and t.numel() > 1 and int(torch.unique(t).numel()) != t.numel())]
            if bad:  # vLLM's load_checkpoint_weight_patches: NaN is its unchanged mark; an index given twice
                return _vllm_error("Sparse checkpoint patches contain NaN values, out-of-range indices, or "
                                   f"duplicate indices ({bad[0]})", 500)
        await self.s._on_scheduler(lambda: self.s.receiver.load(named))
        return web.json_response({"message": "Weights updated"})

    @property
    def _transfer_backend(self) -> str:
        return getattr(self.s, "weight_transfer_backend", "nccl")

    async def finish_update(self, request: web.Request) -> web.Response:
        body = await read_json(request) if request.can_read_body else {}
        if not self.update_open:
            return _vllm_error("finish_weight_update called without a matching start_weight_update.", 500)
        self.update_open = False
        if self.b.labels_weight_version and isinstance(body, dict) and body.get("weight_version") is not None:
            self._label(str(body["weight_version"]))
        return web.json_response({"message": "Weight update finished"})

    def _label(self, version: str) -> None:
        self.s.scheduler.call(lambda: setattr(self.s.scheduler, "weight_version", version)).result()

    async def update_weight_version(self, request: web.Request) -> web.Response:
        v = (await read_json(request)).get("new_version")
        if not isinstance(v, str):
            return web.json_response({"detail": "new_version: field required (str)"}, status=422)
        await asyncio.get_running_loop().run_in_executor(None, self._label, v)
        return web.json_response({"success": True, "new_version": v})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.s.scheduler.weight_version})


def sparse_metas(info: dict) -> list[TensorMeta]:
    """The broadcasts of a ``sparse_nccl`` update (vLLM's ``SparseNCCLWeightTransferUpdateInfo``), in its
    order: per patch the int32 indices, then the values, as our delta wire's entry pair (index entry named
    with the tensor's full checkpoint shape), so the receiver applies them as it applies a delta."""
    names, dtypes, shapes, counts = (info[k] for k in ("names", "dtype_names", "shapes", "num_updates_list"))
    if not len(names) == len(dtypes) == len(shapes) == len(counts) or not counts:
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes, {len(counts)} counts")
    out = []
    for n, d, shape, k in zip(names, dtypes, shapes, counts):
        if int(k) < 0:
            raise ValueError(f"Sparse `num_updates_list` entries must be non-negative ({n}: {k})")
        out.append(TensorMeta(delta_name(str(n), [int(x) for x in shape]), torch.int32, (int(k),)))
        out.append(TensorMeta(str(n) + DELTA_VAL, parse_dtype(str(d)), (int(k),)))
    return out


def _spans(versions: list[str]) -> list[dict]:
    spans, start = [], 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append({"version": versions[start], "start": start, "end": i})
            start = i
    return spans
