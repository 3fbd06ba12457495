"""The routed experts of every token the embedded engine forwards (``--enable-return-routed-experts``).

Routing replay (docs/moe.md) needs, for every token, the experts each sparse block routed it to in
the forward that produced the next token's log-prob. SGLang and vLLM record them per KV slot; the
embedded engine records them per request and position:

* a forward hook on every top-k router (``moe_routing.record_routing``, the one recorder of
  both sides) collects the forward's ``[tokens, top_k]`` indices, in the order the routers see the
  tokens: row-major over the batch, so a prefill of ``B`` prompts of length ``n`` (the scheduler
  prefills equal lengths together, no padding) is ``[B * n]`` and a decode step is ``[B]``; the
  left padding of the running batch lives only in the KV cache and the mask, never in the routers'
  input;
* :meth:`RoutingCapture.store` writes row ``p`` of each asking request's rows for every position
  ``p`` that forward computed. A prefill after a retract (prompt plus the output so far, computed
  again) writes those positions again: the last forward of a position wins, as a KV slot
  overwritten by a recompute does in SGLang;
* a row is ``[num_hidden_layers, top_k]`` int16, indexed by the decoder layer (the servers' layout);
  a dense layer's row stays 0, as the servers' capture buffers (zeros, never written for it) send.

Only requests that asked are recorded, and only while one of them is in the forward; with the flag
off the scheduler never enters this module. The rows are freed with the request.
"""

from __future__ import annotations

import numpy as np
import torch
from packaging.version import Version

from areal_fast.moe_routing import record_routing, router_layers, routers


def check_release(api: str, version: Version) -> None:
    """Refuse ``--enable-return-routed-experts`` for a release that has no routed-experts answer."""
    from areal_fast.backends.sglang.compat import ROUTED_EXPERTS_SINCE, returns_routed_experts
    from areal_fast.backends.vllm.compat import ROUTED_EXPERTS_ANSWER_SINCE, VLLMBehaviour

    ok = returns_routed_experts(version) if api == "sglang" else VLLMBehaviour.of(version).returns_routed_experts
    if not ok:
        since = ROUTED_EXPERTS_SINCE if api == "sglang" else ROUTED_EXPERTS_ANSWER_SINCE
        raise ValueError(f"--enable-return-routed-experts: {api} {version} returns no routed experts (the "
                         f"embedded engine serves them as {api} {since} and later do)")


class RoutingCapture:
    """Records the top-k experts of the model's routers for the requests that ask."""

    def __init__(self, model: torch.nn.Module):
        rs = routers(model)
        if not rs:
            raise ValueError("--enable-return-routed-experts: the model has no top-k router (a mixture-of-experts "
                             "model such as Qwen3-MoE is needed)")
        try:
            self.num_layers, self.layer_of = router_layers(model)
        except ValueError as e:
            raise ValueError(f"--enable-return-routed-experts: {e}") from None
        self.top_k = int(rs[0].top_k)
        self.num_experts = int(rs[0].num_experts)
        self.model = model

    def recording(self):
        """Context manager around one forward: yields the per-router lists of recorded indices."""
        return record_routing(self.model)

    def store(self, reqs, got: list[list[torch.Tensor]], starts: list[int], n: int) -> None:
        """Row ``i`` of the forward (``n`` tokens per request, request ``reqs[i]`` at positions
        ``starts[i] ..``) into the rows of each request that asked."""
        if not any(r.routing_start is not None for r in reqs):
            return
        per_router = torch.stack([g[-1] for g in got], dim=1)  # [B * n, routers, top_k]
        full = np.zeros((per_router.shape[0], self.num_layers, self.top_k), dtype=np.int16)
        full[:, self.layer_of] = per_router.to(device="cpu", dtype=torch.int16).numpy()
        full = full.reshape(len(reqs), n, self.num_layers, self.top_k)
        for r, start, rows in zip(reqs, starts, full):
            if r.routing_start is not None:
                r.routing = _write(r.routing, start, rows)
                r.routing_end = max(r.routing_end, start + n)

    def rows_of(self, req) -> np.ndarray | None:
        """The rows a server answers for ``req``: positions ``[start, seqlen - 1)`` (the last sampled
        token was never forwarded), None when nothing was forwarded for it."""
        if req.routing is None:
            return None
        end = min(req.routing_end, len(req.input_ids) + len(req.output_ids) - 1)
        start = min(req.routing_start, end)
        return req.routing[start:end]


def _write(buf: np.ndarray | None, start: int, rows: np.ndarray) -> np.ndarray:
    need = start + len(rows)
    if buf is None or buf.shape[0] < need:
        grown = np.zeros((max(need, 2 * (0 if buf is None else buf.shape[0]), 16), *rows.shape[1:]), dtype=np.int16)
        if buf is not None:
            grown[: buf.shape[0]] = buf
        buf = grown
    buf[start:need] = rows
    return buf
