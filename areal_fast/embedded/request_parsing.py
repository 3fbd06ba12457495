"""Request parsing and validation of the embedded engine's HTTP front end (``engine/server.py``).

It owns what a body may be before anything touches the model: the size limit of each kind of body
(answered 413 naming it), the JSON object rule, the sampling keys SGLang knows (a schema 400 from
0.5.22, a bare 500 before, as ``compat.SGLangBehaviour`` says), and every check of a /generate body
(ids inside the vocabulary, the context length, n > 1 expanded into rids as SGLang does). A bad
field raises :class:`BadRequest` (or :class:`ContractError` / :class:`InternalServerError` where
SGLang answers differently); the front end's middleware turns each into SGLang's answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from aiohttp import web

from areal_fast.backends.sglang.compat import SGLANG_SAMPLING_KEYS, SGLangBehaviour, returns_routed_experts
from areal_fast.embedded.sampling import SamplingError, parse_sampling_params

log = logging.getLogger("areal_fast.embedded.server")  # the front end's log, as SGLang's server logs it

# Body limits, sized to the largest legitimate body of each kind:
# - /generate: the prompt's ids as JSON text, at most ~8 bytes per id ("151935, "), for a prompt of
#   up to the context length, plus sampling params and the rest (64 KiB);
# - /update_weights_from_distributed: names, dtypes and shapes of one bucket; a 100k-tensor MoE
#   model's full name list is ~10 MB, so 16 MiB;
# - every other control call: a few fields (64 KiB).
BYTES_PER_ID = 8
GENERATE_OVERHEAD = 64 << 10
UPDATE_META_LIMIT = 16 << 20
CONTROL_LIMIT = 64 << 10
PARSE_OFF_LOOP_BYTES = 256 << 10  # json.loads of 256 KiB takes ~1 ms; bigger bodies go to a thread


class BadRequest(Exception):
    """Raised by validation; becomes a 400 in SGLang's shape."""

    def __init__(self, message: str, schema: bool = False, status: int = 400):
        super().__init__(message)
        self.schema = schema
        self.status = status


class InternalServerError(Exception):
    """An exception SGLang does not catch: answered 500 with a plain "Internal Server Error"."""


class ContractError(Exception):
    """SGLang >= 0.5.22 checks a /generate body against its schema first: 400 ``{"error": "<text>"}``."""


async def read_json(request: web.Request, limit: int = CONTROL_LIMIT) -> dict:
    """The JSON object body; 413 naming the limit when it is larger than this endpoint ever needs."""
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(f"{request.path}: body of {request.content_length} bytes exceeds this endpoint's "
                         f"limit of {limit} bytes", status=413)
    raw = await request.read()
    if len(raw) > limit:
        raise BadRequest(f"{request.path}: body of {len(raw)} bytes exceeds this endpoint's limit of "
                         f"{limit} bytes", status=413)
    if not raw.strip():
        return {}
    try:
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            body = await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
        else:
            body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}", schema=True) from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}", schema=True)
    return body


def check_sampling_keys(raw, sglang: SGLangBehaviour) -> None:
    """Unknown sampling keys: a schema 400 from 0.5.22, a TypeError (HTTP 500) before."""
    if not isinstance(raw, dict):
        return
    unknown = [k for k in raw if k not in SGLANG_SAMPLING_KEYS]
    if not unknown:
        return
    if sglang.generate_schema_400:
        raise ContractError(f"unknown field `{unknown[0]}` in sampling_params")
    # SGLang: SamplingParams(**params) raises TypeError, which nothing catches: a bare 500
    log.error("TypeError: SamplingParams.__init__() got an unexpected keyword argument %r", unknown[0])
    raise InternalServerError()


def parse_generate(body: dict, vocab_size: int, context_length: int, has_tokenizer: bool,
                   sglang: SGLangBehaviour) -> tuple[list[str], list[int], object, bool]:
    """The checked /generate body: (the rids to run, the prompt ids, the sampling params,
    return_logprob). ``has_tokenizer``: whether stop strings can be matched."""
    if "text" in body and "input_ids" not in body:
        raise BadRequest("the embedded engine has no text input; send input_ids")
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise BadRequest("batched input_ids are not supported: send one prompt per /generate call")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids", schema=not isinstance(ids, list))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("input_ids must contain only integers", schema=True)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"input_ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded engine")
    if body.get("logprob_start_len", -1) not in (-1, None):
        raise BadRequest("logprob_start_len must be -1 (output logprobs only) on the embedded engine")
    raw_params = body.get("sampling_params")
    check_sampling_keys(raw_params, sglang)
    try:
        params = parse_sampling_params(raw_params, vocab_size)
    except SamplingError as e:
        raise BadRequest(str(e)) from None
    if params.stop and not has_tokenizer:
        raise BadRequest("sampling_params.stop needs a tokenizer; this checkpoint has none (use stop_token_ids)")
    if len(ids) + params.max_new_tokens > context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_length} "
            f"tokens. You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens "
            f"from the input messages and {params.max_new_tokens} tokens for the completion."
        )
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {rid!r}", schema=True)
    # n > 1: SGLang expands one prompt into n requests named rid_0 .. rid_{n-1} and answers a list
    if params.n == 1:
        rids = [rid or uuid.uuid4().hex]
    else:
        rids = [f"{rid}_{i}" if rid else uuid.uuid4().hex for i in range(params.n)]
    return rids, ids, params, bool(body.get("return_logprob", False))


def parse_routed_experts(body: dict, prompt_len: int, sglang: SGLangBehaviour) -> int | None:
    """SGLang's ``return_routed_experts`` / ``routed_experts_start_len``: the first position whose
    routing to return, or None when not asked (or the release has no such fields). A start outside
    ``[0, prompt length]`` aborts the request with SGLang 0.5.23's message (HTTP 400), whether or not
    the server records routing."""
    if not returns_routed_experts(sglang.version) or not body.get("return_routed_experts", False):
        return None
    if body["return_routed_experts"] is not True:
        raise BadRequest(f"return_routed_experts must be a boolean, got {body['return_routed_experts']!r}",
                         schema=True)
    start = body.get("routed_experts_start_len", 0)
    if type(start) is not int:
        raise BadRequest(f"routed_experts_start_len must be an integer, got {start!r}", schema=True)
    if start > prompt_len:
        raise BadRequest(f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                         f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len.")
    if start < 0:
        raise BadRequest(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                         "routed_experts_start_len.")
    return start
