"""Which route the one liveness check asks a server (``rollout.calls.ServerCalls.health``).

SGLang and the embedded engine answer ``GET /model_info`` without their scheduler; vLLM has no
``/model_info`` and its API server answers ``GET /version`` alone. The vLLM client registers its
servers here; a server that answers 404 on ``/model_info`` is registered for ``/version`` by the
check itself. Torch-free.
"""

from __future__ import annotations

LIVENESS_PATH = "/model_info"  # SGLang's (and the embedded engine's): answered without the scheduler
VLLM_LIVENESS_PATH = "/version"  # vLLM has no /model_info; /version is answered by its API server alone
_liveness_paths: dict[str, str] = {}


def register_liveness_path(url: str, path: str) -> None:
    """The liveness check asks ``path`` of ``url`` from now on (the vLLM client registers its
    servers; a server that answers 404 on /model_info is registered for vLLM's route at once)."""
    _liveness_paths[url.rstrip("/")] = path


def liveness_path(url: str) -> str:
    """What the liveness check asks ``url``: ``/model_info`` unless registered otherwise."""
    return _liveness_paths.get(url.rstrip("/"), LIVENESS_PATH)


def learn_liveness_route(url: str, path: str, status: int) -> None:
    """After the check asked ``path``: a 404 on ``/model_info`` is a server without it (vLLM), asked
    ``/version`` from now on."""
    if status == 404 and path == LIVENESS_PATH:
        register_liveness_path(url, VLLM_LIVENESS_PATH)
