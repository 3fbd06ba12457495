"""Every request body we send to a vLLM server, and the reading of its /v1/completions answer.

One builder per call, each asking ``compat.VLLMBehaviour`` what the server's release
takes (``docs/vllm.md`` has the facts, per version). The contract tests parse each body with vLLM's
own pydantic request types (``tests/rollout/test_vllm_contract.py``). Torch-free.

Generation is vLLM's OpenAI-compatible ``POST /v1/completions`` with token ids in (``prompt``: a
list of ints) and out (``return_token_ids``), and the sampled token's log-prob per output token
(``logprobs: 0``: ``choices[0].logprobs.token_logprobs``). Our sampling keys are SGLang's names
(the rollout's one vocabulary); :func:`completion_body` maps them to vLLM's and refuses the ones
vLLM has no equivalent for, naming the key.
"""

from __future__ import annotations

from collections.abc import Sequence

from areal_fast.backends.vllm.compat import PAUSE_MODE_TO_VLLM, VLLMBehaviour

# SGLang sampling key -> vLLM CompletionRequest field (same meaning; both releases 0.11 .. 0.33)
SAMPLING_KEY_TO_VLLM = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "sampling_seed": "seed",
    "logit_bias": "logit_bias",
}
COMPLETIONS_PATH = "/v1/completions"
DEFAULT_MODEL = "default"
"""The ``model`` of a completion when the caller names none; vLLM serves one model per server and
checks the name only against ``--served-model-name`` (the launcher sets it to this)."""


# Every sampling key we send, at its neutral value where the caller leaves it out: vLLM fills a key a
# request leaves out from the model's generation_config.json (a Qwen2.5-Instruct checkpoint brings
# top_k 20 and a repetition penalty), unless the server runs with --generation-config vllm, which our
# launcher passes; a server started by hand may not, so nothing is left to it.
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                    "frequency_penalty": 0.0, "presence_penalty": 0.0}


def completion_body(prompt_ids: Sequence[int], sampling: dict, request_id: str, behaviour: VLLMBehaviour,
                    model: str = DEFAULT_MODEL, routed_experts_prompt_start: int | None = None,
                    priority: int | None = None) -> dict:
    """The body of ``POST /v1/completions`` for one sample of ``prompt_ids`` (token ids in and out,
    one log-prob a token, the weight-version spans where the release has them). Every key of
    ``NEUTRAL_SAMPLING`` is sent, the caller's value or the neutral one; ``top_k`` -1 (ours: off)
    is vLLM's off, 0. ``routed_experts_prompt_start`` (a server started with
    ``--enable-return-routed-experts`` returns the routing of every request): skip that many prompt
    tokens' rows (``rollout/routed_experts.py``; 0.32.0 on). ``priority``: the request's place in a
    server started with ``--scheduling-policy priority`` (lower first, then arrival); every release
    we serve takes the field, and one that schedules first come first served ignores it without a
    word (0.11.0 .. 0.33.0 read it so)."""
    unknown = sorted(k for k in sampling if k not in SAMPLING_KEY_TO_VLLM and k != "n")
    if unknown:
        raise ValueError(f"sampling_params.{unknown[0]}: no vLLM equivalent (vLLM takes "
                         f"{sorted(SAMPLING_KEY_TO_VLLM)})")
    if sampling.get("n", 1) not in (1, None):
        raise ValueError(f"sampling_params.n={sampling['n']!r}: one sample per request")
    body = {"model": model, "prompt": list(prompt_ids), "stream": False, "echo": False,
            "logprobs": 0, "return_token_ids": True, "request_id": request_id, **NEUTRAL_SAMPLING}
    for key, value in sampling.items():
        if key != "n" and value is not None:
            body[SAMPLING_KEY_TO_VLLM[key]] = value
    if body["top_k"] == -1:  # ours: -1 = off; vLLM's off is 0
        body["top_k"] = 0
    body.setdefault("max_tokens", 128)
    if behaviour.token_weight_versions:
        body["return_weight_versions"] = True
    if priority is not None:
        body["priority"] = int(priority)
    if routed_experts_prompt_start is not None:
        body.update(routing_start_field(routed_experts_prompt_start, len(body["prompt"]), behaviour))
    return body


def routing_start_field(start: int, prompt_len: int | None, behaviour: VLLMBehaviour) -> dict:
    """``{"routed_experts_prompt_start": start}`` for a prompt of ``prompt_len`` tokens (None: not
    known here, pre-encoded): the routing rows of the first ``start`` prompt positions are not sent
    (0.32.0 on); ValueError otherwise."""
    from areal_fast.backends.vllm.compat import ROUTED_EXPERTS_PROMPT_START_SINCE

    if not behaviour.has_routed_experts_prompt_start:
        raise ValueError(f"routed_experts_prompt_start: vLLM {behaviour.version}'s completion request has "
                         f"no such field ({ROUTED_EXPERTS_PROMPT_START_SINCE} on)")
    if start < 0 or (prompt_len is not None and start > prompt_len):
        raise ValueError(f"routed_experts_prompt_start={start}: must be within the prompt's {prompt_len} tokens")
    return {"routed_experts_prompt_start": int(start)}


def engine_request_id(request_id: str) -> str:
    """The id vLLM's engine registers for the one choice of a /v1/completions request whose
    ``request_id`` is ``request_id``: ``cmpl-{request_id}-0`` (every release we serve). /abort_requests
    matches this id, not the one the request carried: an abort by the bare id matches nothing and
    is still answered ``{"aborted": 1}``."""
    return f"cmpl-{request_id}-0"


def pause_query(mode: str, behaviour: VLLMBehaviour) -> dict[str, str]:
    """The query of ``POST /pause`` for our pause ``mode`` ('abort' or 'in_place' = vLLM's keep).

    vLLM reads its options from the query string, not a body. Before 0.16.0 it takes
    ``wait_for_inflight_requests`` (false aborts); 'in_place' needs keep (0.16.0 on), and from
    0.20.0 ``clear_cache=false`` too: keep with the default ``clear_cache=true`` drops the kept
    requests' KV, to be recomputed by the new weights at /resume (not in place)."""
    if not behaviour.has_pause:
        raise ValueError(f"vLLM {behaviour.version} has no /pause (from 0.12.0): abort requests by closing them")
    if mode not in PAUSE_MODE_TO_VLLM:
        raise ValueError(f"pause mode {mode!r}: a vLLM server pauses with {sorted(PAUSE_MODE_TO_VLLM)}")
    if behaviour.has_pause_modes:
        query = {"mode": PAUSE_MODE_TO_VLLM[mode]}
        if mode == "in_place" and behaviour.keep_clears_cache:
            query["clear_cache"] = "false"
        return query
    if mode != "abort":
        raise ValueError(f"pause mode {mode!r} (vLLM's keep) needs vLLM >= 0.16.0, this server is {behaviour.version}")
    return {"wait_for_inflight_requests": "false"}


def abort_body(request_ids: Sequence[str] | None) -> dict:
    """``POST /abort_requests``: the requests we sent with these ``request_id``s (each as the
    engine's id, :func:`engine_request_id`), or every request (empty / None)."""
    return {"request_ids": [engine_request_id(r) for r in request_ids or []]}


def disk_update_calls(path: str, behaviour: VLLMBehaviour) -> list[dict]:
    """The ``POST /collective_rpc`` bodies that load the checkpoint at ``path`` in place, in order.

    From 0.16.0 ``reload_weights`` takes ``weights_path``; before, the path is set first by
    ``update_config`` (model_config.model), then ``reload_weights`` reads it."""
    if behaviour.reloads_from_path:
        return [{"method": "reload_weights", "kwargs": {"weights_path": str(path)}}]
    return [{"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": str(path)}}}},
            {"method": "reload_weights"}]


def weight_version_body(version: str) -> dict:
    """``POST /update_weight_version`` (0.27.0 on)."""
    return {"new_version": str(version)}


def init_transfer_body(master_address: str, master_port: int, rank_offset: int, world_size: int) -> dict:
    """``POST /init_weight_transfer_engine`` for the NCCL backend (TCPStore rendezvous): the server's
    workers join ranks ``rank_offset ..`` of a group of ``world_size`` whose rank 0 sends."""
    return {"init_info": {"master_address": master_address, "master_port": int(master_port),
                          "rank_offset": int(rank_offset), "world_size": int(world_size)}}


def update_transfer_body(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> dict:
    """``POST /update_weights`` for the NCCL backend: the tensors of this round, in broadcast order."""
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(f"update_weights: {len(names)} names, {len(dtype_names)} dtypes, {len(shapes)} shapes")
    return {"update_info": {"names": list(names), "dtype_names": list(dtype_names),
                            "shapes": [list(s) for s in shapes]}}


def sparse_update_body(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
                       num_updates: Sequence[int]) -> dict:
    """``POST /update_weights`` for the ``sparse_nccl`` backend (0.32.0 on): per patch its checkpoint
    name, values' dtype, the tensor's full checkpoint shape and how many (index, value) pairs follow;
    the worker then receives, per patch in this order, the int32 indices and the values."""
    if not len(names) == len(dtype_names) == len(shapes) == len(num_updates):
        raise ValueError(f"update_weights: {len(names)} names, {len(dtype_names)} dtypes, {len(shapes)} shapes, "
                         f"{len(num_updates)} counts")
    if not names:
        raise ValueError("update_weights: a sparse update of no patch (vLLM refuses an empty num_updates_list)")
    if any(int(n) < 0 for n in num_updates):
        raise ValueError(f"update_weights: negative patch sizes in {list(num_updates)[:8]}")
    return {"update_info": {"names": list(names), "dtype_names": list(dtype_names),
                            "shapes": [list(s) for s in shapes], "num_updates_list": [int(n) for n in num_updates]}}


def finish_transfer_body(weight_version: str | None, behaviour: VLLMBehaviour) -> dict | None:
    """``POST /finish_weight_update`` (0.21.0 on): the new label where the release takes one."""
    if weight_version is None or not behaviour.labels_weight_version:
        return None
    return {"weight_version": str(weight_version)}


class CompletionAnswerError(ValueError):
    """A 2xx /v1/completions answer that breaks the answer rules (the SGLang path's rules, read by
    ``rollout.answer``: token ids are integers >= 0, log-probs finite numbers <= 0, versions in
    ``[0, 2**31)``), or is not one choice with token ids and log-probs, or is another request's."""


def parse_completion(data, expect_logprobs: bool = True, request_id: str | None = None) -> dict:
    """The one choice of a /v1/completions answer as ``{"ids", "logprobs", "finish", "spans",
    "stop_reason"}``: ``finish`` is 'stop', 'length' or 'abort'; ``spans`` the weight_versions spans
    (checked: integer bounds that tile the output, versions under the answer rules) or None. With
    ``request_id`` the answer's ``id``, when it has one, must be that request's (``cmpl-{id}``)."""
    from areal_fast.rollout.answer import checked_logprob, checked_version

    if not isinstance(data, dict):
        raise CompletionAnswerError(f"expected a JSON object, got {str(data)[:200]}")
    if request_id is not None and data.get("id") is not None and data.get("id") != f"cmpl-{request_id}":
        raise CompletionAnswerError(f"the answer is for {str(data.get('id'))[:80]!r}, not cmpl-{request_id}")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise CompletionAnswerError(f"expected one choice, got {str(data)[:200]}")
    c = choices[0]
    ids = c.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**31 for t in ids):
        raise CompletionAnswerError(f"choice.token_ids must be a list of token ids, got {str(ids)[:200]}")
    lps: list[float] = []
    if expect_logprobs:
        lp = (c.get("logprobs") or {}).get("token_logprobs") if isinstance(c.get("logprobs"), dict | None) else None
        if not isinstance(lp, list) or len(lp) != len(ids):
            raise CompletionAnswerError(f"choice.logprobs.token_logprobs must be {len(ids)} log-probs, "
                                        f"got {str(lp)[:200]}")
        try:
            lps = [checked_logprob(x, f"choice.logprobs.token_logprobs[{i}]") for i, x in enumerate(lp)]
        except ValueError as e:
            raise CompletionAnswerError(str(e)) from None
    finish = c.get("finish_reason")
    if finish not in ("stop", "length", "abort"):
        raise CompletionAnswerError(f"choice.finish_reason {str(finish)[:80]!r}: expected stop, length or abort")
    stop_reason = c.get("stop_reason")
    if stop_reason is not None and type(stop_reason) not in (int, str):
        raise CompletionAnswerError(f"choice.stop_reason is a {type(stop_reason).__name__}")
    spans = c.get("weight_versions")
    if spans is not None:
        _check_spans(spans, len(ids), checked_version)
    return {"ids": ids, "logprobs": lps, "finish": finish, "spans": spans, "stop_reason": stop_reason}


def _check_spans(spans, n: int, checked_version) -> None:
    """``weight_versions`` spans: objects with integer ``start`` <= ``end`` that tile ``[0, n)`` in
    order, each ``version`` under the answer rules."""
    if not isinstance(spans, list):
        raise CompletionAnswerError(f"choice.weight_versions is a {type(spans).__name__}, not a list of spans")
    at = 0
    for sp in spans:
        if type(sp) is not dict or type(sp.get("start")) is not int or type(sp.get("end")) is not int \
                or sp["start"] != at or sp["end"] < sp["start"]:
            raise CompletionAnswerError(f"choice.weight_versions span {str(sp)[:80]!r} does not continue the "
                                        f"spans at token {at} (they must tile the {n} tokens in order)")
        try:
            checked_version(sp.get("version"), "choice.weight_versions version")
        except ValueError as e:
            raise CompletionAnswerError(str(e)) from None
        at = sp["end"]
    if at != n:
        raise CompletionAnswerError(f"choice.weight_versions cover {at} of the {n} tokens")
