"""The command line and environment of one real vLLM server (the sibling of ``backends/sglang/server_command.py``,
SGLang's and the embedded engine's builder), from vLLM's own CLI flags (``docs/vllm.md``):

    python -m vllm.entrypoints.openai.api_server --model P --host H --port N
        --tensor-parallel-size T --served-model-name default [--config KEYFILE.yaml]
        --logprobs-mode processed_logprobs --generation-config vllm --scheduling-policy priority
        [--dtype D] [--seed S] [--max-num-seqs M] [--load-format F]
        [--weight-transfer-config '{"backend": "nccl"}']      (0.16.0 on, for weights.method distributed;
                                                               "sparse_nccl" for delta updates, 0.32.0 on)
        [--no-enable-prefix-caching]                          (runs that pause in place)
        [extra args] --middleware areal_fast_vllm_keyguard.KeyGuard
    env: VLLM_SERVER_DEV_MODE=1   (mounts /pause, /resume, /abort_requests, /collective_rpc and the
                                   weight-transfer endpoints)
         PYTHONPATH=<keyguard directory>[:$PYTHONPATH]   (where vLLM imports the middleware from)

Two flags make what vLLM answers what the trainer assumes: ``--logprobs-mode processed_logprobs``
(each token's log-prob under the distribution it was sampled from, after temperature, penalties and
top-k/top-p; vLLM's default is the raw model's, at temperature 1), and ``--generation-config vllm``
(vLLM's own sampling defaults, not the checkpoint's generation_config.json: a Qwen2.5-Instruct
checkpoint would bring top_k 20 and a repetition penalty to every request that leaves them out).

The API key travels as SGLang's does: ``--config FILE.yaml`` holding ``api-key: KEY`` (vLLM reads
a YAML config file of long option names too), written by ``backends.keyfile.write_api_key_file``.

The key guard. vLLM checks its key only under ``/v1`` (and ``/v2``, ``/inference``, ``/cohere``):
the dev-mode routes above, the runtime adapter routes and ``/invocations`` would act for anyone who
reaches the port. ``--middleware`` (vLLM's own flag) loads ``keyguard/areal_fast_vllm_keyguard.py``,
a dependency-free ASGI middleware that asks the same key on every route but ``/health``; it comes
last on the line, so vLLM adds it last: the outermost layer, before any middleware of the extra
arguments. It is imported by vLLM's interpreter (an environment of its own): its directory, which
holds that one module, goes first on the server's ``PYTHONPATH`` (:func:`vllm_server_env`).

Scheduling. ``--scheduling-policy priority``: the waiting queue runs the lowest ``priority`` first
(then by arrival), and every completion carries its group's admission order as its priority
(``client.VLLMRolloutClient``). vLLM's default, first come first served, queues by arrival: after
an abort pause every interrupted request is sent again at once, they arrive in no set order, and an
old one can wait behind newer groups' requests through several updates, so the staleness bound
(``docs/staleness.md``) stops holding for it. vLLM 0.11.0 .. 0.33.0 have the flag and the field.

Prefix caching. vLLM caches the KV of prompt prefixes by default; a pause in place
(``/pause?mode=keep&clear_cache=false``) keeps that cache across a weight update (the kept requests
hold blocks, so it cannot be reset either), and a new request with a cached prefix would be
computed on KV of the old weights while labelled with the new version. A run whose pause mode
resolves to in place launches its servers with ``--no-enable-prefix-caching``
(:func:`prefix_caching_for`); the rollout client refuses an in-place pause of a server started by
hand with prefix caching on (``client.VLLMRolloutClient``).

The embedded engine twins vLLM with ``python -m areal_fast.embedded --api vllm
--vllm-version X`` (built by ``sglang_server_command("embedded", ..., extra_args=embedded_vllm_args(X))``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from areal_fast.backends.vllm.compat import (
    DEV_MODE_ENV,
    SCHEDULING_POLICIES,
    SPARSE_TRANSFER_SINCE,
    TRANSFER_BACKENDS,
    VLLMBehaviour,
    vllm_pause_mode,
)
from areal_fast.backends.vllm.requests import DEFAULT_MODEL

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
KEYGUARD_DIR = Path(__file__).resolve().parent / "keyguard"
"""The directory of the key guard's one module, put on a launched server's PYTHONPATH."""
KEYGUARD = "areal_fast_vllm_keyguard.KeyGuard"
"""The import path vLLM's ``--middleware`` loads (see the module docstring)."""
SAMPLING_FLAGS = ("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm")
"""Every launched vLLM server's: behaviour log-probs of the sampled distribution, vLLM's own
sampling defaults (see the module docstring)."""
SCHEDULING_FLAGS = ("--scheduling-policy", "priority")
"""Every launched vLLM server's: requests queued by their group's admission order (see the module
docstring)."""
# vLLM's flags for its parallel layout: a server takes tensor x pipeline x data-parallel GPUs
PARALLEL_FLAGS = {"--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp", "-pp": "pp",
                  "--data-parallel-size": "dp", "-dp": "dp"}


def gpus_of(tp_size: int, args: Sequence[str]) -> int:
    """GPUs one vLLM server takes: ``tp_size`` x its ``--pipeline-parallel-size`` x its
    ``--data-parallel-size`` (``-pp``/``-dp``, ``--flag N`` or ``--flag=N``) in ``args``."""
    sizes = {"tp": tp_size, "pp": 1, "dp": 1}
    args = list(args)
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag in PARALLEL_FLAGS and PARALLEL_FLAGS[flag] != "tp":
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            try:
                sizes[PARALLEL_FLAGS[flag]] = int(value)
            except ValueError:
                raise ValueError(f"{flag}: expected a number of GPUs, got {value!r}") from None
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def vllm_server_command(model_path: str, host: str, port: int, *, version: str, tp_size: int = 1,
                        api_key_file: str | os.PathLike | None = None, dtype: str | None = None,
                        seed: int | None = None, max_num_seqs: int | None = None,
                        load_format: str | None = None, weight_transfer: bool | str = False,
                        prefix_caching: bool = True,
                        scheduling_policy: str = "priority", extra_args: Sequence[str] = (),
                        python: str = sys.executable) -> list[str]:
    """The command of one vLLM ``version`` server. ``weight_transfer`` turns on the NCCL weight-transfer
    engine (refused, naming the version, before 0.16.0): True or 'nccl' the dense one, 'sparse_nccl' the
    sparse one delta updates need (0.32.0 on); a ``--weight-transfer-config`` in ``extra_args`` wins;
    ``prefix_caching`` False turns vLLM's prefix cache off (a run that pauses in place:
    :func:`prefix_caching_for`); ``scheduling_policy``: the
    launcher's ``priority`` (see the module docstring), or ``fcfs``, vLLM's default, for a measurement
    of what a server started without it does. The key file, never the key, is on the line; the key
    guard's ``--middleware`` ends it (see the module docstring)."""
    b = VLLMBehaviour.of(version)
    if not model_path:
        raise ValueError("vllm_server_command: model_path is empty")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"vllm_server_command: port must be an int in 1..65535, got {port!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"vllm_server_command: tp_size must be an int >= 1, got {tp_size!r}")
    if "--api-key" in extra_args or "--config" in extra_args:
        raise ValueError("vllm_server_command: the API key reaches the server in api_key_file (--config); "
                         "remove --api-key / --config from the extra arguments")
    for flag in SAMPLING_FLAGS[::2]:
        if any(a == flag or a.startswith(flag + "=") for a in extra_args):
            raise ValueError(f"vllm_server_command: {flag} is set by the launcher ({' '.join(SAMPLING_FLAGS)}: the "
                             f"log-probs and sampling defaults the trainer assumes); remove it from the extra args")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"vllm_server_command: scheduling_policy must be 'priority' or 'fcfs', "
                         f"got {scheduling_policy!r}")
    if any(a == SCHEDULING_FLAGS[0] or a.startswith(SCHEDULING_FLAGS[0] + "=") for a in extra_args):
        raise ValueError(f"vllm_server_command: {SCHEDULING_FLAGS[0]} is set by the launcher "
                         f"({' '.join(SCHEDULING_FLAGS)}: a request sent again after an abort pause keeps its "
                         f"group's place in the queue, which the staleness bound needs); remove it from the extra args")
    if not prefix_caching and "--enable-prefix-caching" in extra_args:
        raise ValueError("vllm_server_command: --enable-prefix-caching in the extra args of a run that pauses in "
                         "place: a kept cache would serve KV of the old weights after an update; remove it or "
                         "pause with 'abort'")
    cmd = [python, "-m", VLLM_MODULE, "--model", model_path, "--host", host, "--port", str(port),
           "--tensor-parallel-size", str(tp_size), "--served-model-name", DEFAULT_MODEL, *SAMPLING_FLAGS,
           SCHEDULING_FLAGS[0], scheduling_policy]
    if api_key_file is not None:
        cmd += ["--config", os.fspath(api_key_file)]
    for flag, value in (("--dtype", dtype), ("--seed", seed), ("--max-num-seqs", max_num_seqs),
                        ("--load-format", load_format)):
        if value is not None:
            cmd += [flag, str(value)]
    backend = "nccl" if weight_transfer is True else weight_transfer or None
    if backend is not None and backend not in TRANSFER_BACKENDS:
        raise ValueError(f"vllm_server_command: weight_transfer must be a bool or one of {TRANSFER_BACKENDS}, "
                         f"got {weight_transfer!r}")
    if backend is not None and not b.has_weight_transfer:
        raise ValueError(f"vllm_server_command: vLLM {b.version} has no weight transfer (from 0.16.0)")
    if backend == "sparse_nccl" and not b.has_sparse_transfer:
        raise ValueError(f"vllm_server_command: vLLM {b.version}'s sparse_nccl takes no checkpoint-coordinate "
                         f"patches (from {SPARSE_TRANSFER_SINCE}); keep 'nccl' (whole updates)")
    # a --weight-transfer-config among the extra arguments (rollout.server_args: e.g. sparse_nccl, for delta
    # updates) is the run's choice: ours is not added beside it
    if backend is not None and not any(a == "--weight-transfer-config" or a.startswith("--weight-transfer-config=")
                                       for a in extra_args):
        cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    if not prefix_caching and "--no-enable-prefix-caching" not in extra_args:
        cmd.append("--no-enable-prefix-caching")
    return cmd + list(extra_args) + ["--middleware", KEYGUARD]


def prefix_caching_for(pause_mode: str, version: str) -> bool:
    """Whether a launched vLLM ``version`` server of a run with ``rollout.pause_mode`` may cache
    prompt prefixes: not when the pause resolves to in place (see the module docstring)."""
    return vllm_pause_mode(pause_mode, version) != "in_place"


def vllm_server_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment entries every vLLM server of a run needs (added to the launcher's environment
    ``environ``, ``os.environ`` by default): dev mode, and the key guard's directory first on
    ``PYTHONPATH``."""
    environ = os.environ if environ is None else environ
    path = [str(KEYGUARD_DIR), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {DEV_MODE_ENV: "1", "PYTHONPATH": os.pathsep.join(path)}


def embedded_vllm_args(version: str) -> list[str]:
    """The embedded engine's flags that make it vLLM ``version``'s twin, scheduling as a launched
    vLLM server does (``SCHEDULING_FLAGS``)."""
    VLLMBehaviour.of(version)
    return ["--api", "vllm", "--vllm-version", str(version), *SCHEDULING_FLAGS]
