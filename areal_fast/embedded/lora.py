"""LoRA adapters on the embedded engine, served as vLLM and SGLang serve them (docs/lora.md).

The engine keeps one base model and any number of adapters (up to ``max_loras``) loaded from PEFT
directories (``adapter_config.json`` + ``adapter_model.safetensors``); each request names its
adapter (vLLM: ``model``; SGLang: ``lora_path``) or none (the base). Every target linear layer of
the base is wrapped once by :class:`LoRALinear`, which adds ``scaling * B A x`` per batch row for
that row's adapter, so one decode step serves requests of different adapters together, as the
real servers' multi-LoRA kernels do. The base weights are never touched: loading an adapter
reloads nothing else.

Replacement, as each server does it (read from their sources, docs/lora.md):

* vLLM (``/v1/load_lora_adapter`` with ``load_inplace: true``): the adapter's tensors are swapped
  between two decode steps; requests in flight that name it continue under the new tensors from
  the next step (their KV so far was computed by the old ones), exactly like an in-place reload of
  full weights. Without ``load_inplace`` a loaded name is refused (400).
* SGLang (``/load_lora_adapter`` of a loaded name is refused: unload first): ``/unload_lora_adapter``
  waits until no request in flight names the adapter (SGLang's ``wait_for_unload``), so replacing
  an adapter needs the requests that use it finished or aborted first.

All changes run on the scheduler thread (``Scheduler.call``), never during a forward pass.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."


class LoRAError(ValueError):
    """An adapter that cannot be loaded (the message names the file, module or limit)."""


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])


class LoRALinear(nn.Module):
    """A base ``nn.Linear`` plus, per batch row, that row's adapter (``serving.rows``)."""

    def __init__(self, base: nn.Linear, name: str, serving: LoRAServing):
        super().__init__()
        self.base, self.name = base, name
        self._serving = [serving]  # a list: not a submodule

    @property
    def weight(self):  # code that reads the base's weight through the wrapper (tied heads, dtype probes)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = self._serving[0].rows
        if not rows:
            return out
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(rows):
            if a is not None:
                groups.setdefault(a, []).append(i)
        for name, idx in groups.items():
            ad = self._serving[0].lookup(name)
            ab = ad.weights.get(self.name) if ad is not None else None
            if ab is None:
                continue
            a, b = ab
            if len(idx) == x.shape[0]:
                out = out + (x @ a.T @ b.T) * ad.scaling
            else:
                ix = torch.tensor(idx, device=x.device)
                out = out.index_add(0, ix, (x[ix] @ a.T @ b.T) * ad.scaling)
        return out


class LoRAServing:
    """The adapters of one engine; see the module docstring. ``rows``: the adapter name (or None)
    of each row of the next forward pass, set by the scheduler."""

    def __init__(self, model: nn.Module, max_lora_rank: int = 16, max_loras: int = 4):
        if max_lora_rank < 1 or max_loras < 1:
            raise ValueError(f"max_lora_rank and max_loras must be >= 1, got {max_lora_rank}, {max_loras}")
        self.model, self.max_lora_rank, self.max_loras = model, max_lora_rank, max_loras
        self.adapters: dict[str, Adapter] = {}
        self.retired: dict[str, Adapter] = {}  # unloaded by vLLM's rule: requests in flight still use them
        self.rows: list[str | None] = []
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.modules: dict[str, LoRALinear] = {}
        for name, mod in list(model.named_modules()):
            for child_name, child in list(mod.named_children()):
                if child_name in TARGETS and isinstance(child, nn.Linear):
                    full = f"{name}.{child_name}" if name else child_name
                    wrapped = LoRALinear(child, full, self)
                    setattr(mod, child_name, wrapped)
                    self.modules[full] = wrapped

    def activate(self, names: list[str | None]) -> None:
        """The adapters of the rows of the next forward pass (scheduler thread)."""
        self.rows = list(names) if any(n is not None for n in names) else []

    def read(self, name: str, path: str) -> Adapter:
        """Read and check a PEFT adapter directory (no model state touched: may run off the scheduler)."""
        from safetensors.torch import load_file

        cpath, wpath = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(cpath) or not os.path.isfile(wpath):
            raise LoRAError(f"{path}: not a PEFT adapter directory (adapter_config.json and "
                            f"adapter_model.safetensors are needed)")
        with open(cpath) as f:
            conf = json.load(f)
        rank, alpha = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
        if rank > self.max_lora_rank:
            raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.")
        if conf.get("use_dora") or conf.get("use_rslora"):
            raise LoRAError(f"{cpath}: DoRA / rsLoRA adapters are not served")
        scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
        tensors = load_file(wpath)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            k = key.removeprefix(_PREFIX)
            for part in ("lora_A", "lora_B"):
                marker = f".{part}."
                if marker in k:
                    mod = k.split(marker)[0]
                    pairs.setdefault(mod, {})[part] = t
                    break
            else:
                raise LoRAError(f"{wpath}: {key!r} is not a LoRA matrix")
        weights = {}
        for mod, ab in pairs.items():
            if mod not in self.modules:
                raise LoRAError(f"{wpath}: module {mod!r} is not a target linear layer of this model")
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoRAError(f"{wpath}: module {mod!r} lacks lora_A or lora_B")
            base = self.modules[mod].base
            a, b = ab["lora_A"], ab["lora_B"]
            if tuple(a.shape) != (rank, base.in_features) or tuple(b.shape) != (base.out_features, rank):
                raise LoRAError(f"{wpath}: {mod}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a rank-{rank} "
                                f"adapter on [{base.out_features}, {base.in_features}]")
            weights[mod] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        return Adapter(name, path, rank, scaling, weights)

    def install(self, adapter: Adapter, replace: bool) -> None:
        """Make ``adapter`` the one of its name (scheduler thread): a loaded name only with ``replace``."""
        if adapter.name in self.adapters and not replace:
            raise LoRAError(f"adapter {adapter.name!r} is already loaded")
        if adapter.name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise LoRAError(f"{len(self.adapters)} adapters are loaded, the most this server holds (max_loras)")
        self.adapters[adapter.name] = adapter
        self.retired.pop(adapter.name, None)

    def remove(self, name: str, keep_for_running: bool = False) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"adapter {name!r} is not loaded")
        if keep_for_running:
            self.retired[name] = adapter

    def lookup(self, name: str) -> Adapter | None:
        return self.adapters.get(name) or self.retired.get(name)


# ---------------------------------------------------------------------------------------- routes
class LoRARoutes:
    """The adapter endpoints of an ``EngineServer`` (``server``) in SGLang's or vLLM's shape."""

    def __init__(self, server):
        self.s = server

    @property
    def serving(self) -> LoRAServing:
        return self.s.lora

    def add_sglang(self, r) -> None:
        r.add_post("/load_lora_adapter", self.sglang_load)
        r.add_post("/unload_lora_adapter", self.sglang_unload)
        r.add_post("/update_weight_version", self.sglang_weight_version)

    def add_vllm(self, r) -> None:
        r.add_post("/v1/load_lora_adapter", self.vllm_load)
        r.add_post("/v1/unload_lora_adapter", self.vllm_unload)

    def adapter_of_generate(self, body: dict) -> str | None:
        """The adapter a /generate names (SGLang's ``lora_path``: a loaded adapter's name), checked."""
        from areal_fast.embedded.request_parsing import BadRequest

        name = body.get("lora_path")
        if name is None:
            return None
        if isinstance(name, list) and len(name) == 1:
            name = name[0]
        if not isinstance(name, str):
            raise BadRequest(f"lora_path must be the name of a loaded adapter, got {str(name)[:80]!r}")
        if self.serving is None:
            raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name not in self.serving.adapters:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {list(self.serving.adapters)}.")
        return name

    def adapter_of_completion(self, body: dict) -> str | None:
        """The adapter a /v1/completions names in ``model`` (None: the base, 'default'); an unknown
        model is vLLM's 404."""
        model = body.get("model")
        if self.s.serves_model_name(model):
            return None
        if self.serving is not None and model in self.serving.adapters:
            return str(model)
        raise _NotFound(f"The model `{model}` does not exist.")

    # ------------------------------------------------------------------ SGLang
    @staticmethod
    def _sglang_answer(ok: bool, error: str | None, loaded: dict):
        from aiohttp import web

        return web.json_response({"success": ok, "error_message": error, "loaded_adapters": loaded},
                                 status=200 if ok else 400)

    def _loaded(self) -> dict:
        return {n: a.path for n, a in (self.serving.adapters.items() if self.serving else [])}

    async def sglang_load(self, request):
        from areal_fast.embedded.request_parsing import BadRequest, read_json

        b = await read_json(request)
        name, path = b.get("lora_name"), b.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise BadRequest("load_lora_adapter needs lora_name and lora_path (strings)", schema=True)
        if self.serving is None:
            return self._sglang_answer(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", {})
        if name in self.serving.adapters:
            return self._sglang_answer(False, f"Failed to load LoRA adapter {name} because it is already loaded",
                                       self._loaded())
        try:
            await self._load(name, path, replace=False)
        except LoRAError as e:
            return self._sglang_answer(False, str(e), self._loaded())
        return self._sglang_answer(True, None, self._loaded())

    async def sglang_unload(self, request):
        import asyncio

        from areal_fast.embedded.request_parsing import BadRequest, read_json

        b = await read_json(request)
        name = b.get("lora_name")
        if not isinstance(name, str):
            raise BadRequest("unload_lora_adapter needs lora_name (a string)", schema=True)
        if self.serving is None:
            return self._sglang_answer(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", {})
        if name not in self.serving.adapters:
            return self._sglang_answer(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                              f"{list(self.serving.adapters)}", self._loaded())
        # SGLang unregisters the name at once (new requests naming it are refused), then waits until
        # no request in flight uses it (wait_for_unload) before freeing it
        while await self.s._on_scheduler(lambda: self.s.scheduler.uses_adapter(name)):
            await asyncio.sleep(0.01)
        await self.s._on_scheduler(lambda: self.serving.remove(name))
        return self._sglang_answer(True, None, self._loaded())

    async def sglang_weight_version(self, request):
        from aiohttp import web

        from areal_fast.embedded.request_parsing import BadRequest, read_json

        b = await read_json(request)
        version = b.get("new_version")
        if not isinstance(version, str | int):
            raise BadRequest("update_weight_version needs new_version", schema=True)
        sched = self.s.scheduler

        def label():
            if b.get("abort_all_requests", True):  # SGLang's default
                sched.abort(None, "Abort by update_weight_version")
            sched.weight_version = str(version)

        await self.s._on_scheduler(label)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": str(version)})

    # ------------------------------------------------------------------ vLLM
    async def vllm_load(self, request):
        from aiohttp import web

        from areal_fast.embedded.request_parsing import read_json

        b = await read_json(request)
        name, path, inplace = b.get("lora_name"), b.get("lora_path"), bool(b.get("load_inplace", False))
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return _vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if self.serving is None:
            return _vllm_error("LoRA is not enabled (start the server with --enable-lora).", "NotFoundError", 404)
        if name in ("default", self.s.model_path):
            return _vllm_error(f"The lora adapter '{name}' conflicts with a served base model.",
                               "InvalidUserInput", 400)
        if not inplace and name in self.serving.adapters:
            return _vllm_error(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", "InvalidUserInput", 400)
        try:
            await self._load(name, path, replace=True)
        except LoRAError as e:
            return _vllm_error(str(e), "InternalServerError", 500)
        return web.Response(status=200, text=f"Success: LoRA adapter '{name}' added successfully.")

    async def vllm_unload(self, request):
        from aiohttp import web

        from areal_fast.embedded.request_parsing import read_json

        b = await read_json(request)
        name = b.get("lora_name")
        if not name:
            return _vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if self.serving is None or name not in self.serving.adapters:
            return _vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        # vLLM forgets the name at once; requests in flight keep the adapter they were admitted with
        await self.s._on_scheduler(
            lambda: self.serving.remove(name, keep_for_running=True) if name in self.serving.adapters else None)
        return web.Response(status=200, text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _load(self, name: str, path: str, replace: bool) -> None:
        import asyncio

        adapter = await asyncio.get_running_loop().run_in_executor(None, self.serving.read, name, path)
        await self.s._on_scheduler(lambda: self.serving.install(adapter, replace))


class _NotFound(Exception):
    """vLLM's 404 for a completion naming a model it does not serve."""


def _vllm_error(message: str, kind: str, status: int):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)
