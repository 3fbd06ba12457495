"""What the run's servers can serve, checked once at load by the config assembler (``areal_fast.config``):
the rules of the ``rollout`` section that need a backend's facts (the section names no backend).

- ``rollout.pause_mode: in_place`` for launched SGLang servers or embedded engines (their flags and
  release: ``sglang.compat.in_place_launch_refusal``);
- which ``rollout.server`` may serve which ``rollout.api`` (``vllm.compat.check_rollout_backend``);
- one validation of a vLLM run: its release with the run's pause mode and ``weights.method``
  (``vllm.compat.vllm_refusal``);
- ``rollout.return_routed_experts``: the servers' release records routing.

Each refusal is a ValueError naming the key and the reason.
"""

from __future__ import annotations

from areal_fast.backends.sglang.compat import (
    ROUTED_EXPERTS_SINCE,
    in_place_launch_refusal,
    parse_sglang_version,
    returns_routed_experts,
)
from areal_fast.backends.vllm.compat import (
    ROUTED_EXPERTS_PROMPT_START_SINCE,
    VLLMBehaviour,
    check_rollout_backend,
    vllm_refusal,
)


def installed_sglang(server: str) -> str | None:
    """The sglang release installed here (launched 'sglang' servers run it), None if unknown."""
    if server != "sglang":
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_rollout_servers(rollout_cfg, weights_method: str) -> None:
    """Refuse (ValueError naming the key) what the servers of ``rollout_cfg`` cannot serve; see the
    module docstring. ``weights_method``: the run's ``weights.method``."""
    r = rollout_cfg
    if r.pause_mode == "in_place" and not r.servers and r.server != "vllm":  # vLLM: vllm_refusal below
        why = in_place_launch_refusal(r.server, r.server_args, installed_sglang(r.server))
        if why:
            raise ValueError(f"rollout.pause_mode: 'in_place' refused for launched {r.server} servers: {why}")
    try:
        check_rollout_backend(r.api, r.server, bool(r.servers), r.vllm_version)
    except ValueError as e:
        raise ValueError(f"rollout.{e}") from None
    if r.api == "vllm":
        why = vllm_refusal(r.vllm_version, pause_mode=r.pause_mode, weights_method=weights_method)
        if why:
            raise ValueError(f"rollout.api 'vllm': {why}")
    if r.return_routed_experts:
        check_routed_experts(r.api, r.server, r.vllm_version, installed_sglang(r.server))


def check_routed_experts(api: str, server: str, vllm_version: str, sglang_version: str | None) -> None:
    """``rollout.return_routed_experts``: refused (naming the release) where the servers cannot answer routing."""
    if api == "vllm" and not VLLMBehaviour.of(vllm_version).has_routed_experts_prompt_start:
        raise ValueError(f"rollout.return_routed_experts: vLLM returns routing from "
                         f"{ROUTED_EXPERTS_PROMPT_START_SINCE} on (routed_experts in the completion answer, "
                         f"routed_experts_prompt_start in the request); this run's vllm_version is {vllm_version}")
    if api == "sglang" and server == "sglang" and sglang_version:
        if not returns_routed_experts(parse_sglang_version(sglang_version)):
            raise ValueError(f"rollout.return_routed_experts: SGLang returns routing from {ROUTED_EXPERTS_SINCE} "
                             f"on (meta_info.routed_experts); the installed sglang is {sglang_version}")
