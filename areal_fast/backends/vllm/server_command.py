"""The command line and environment of one real vLLM server (the sibling of ``backends/sglang/server_command.py``,
SGLang's and the embedded engine's builder), from vLLM's own CLI flags (``docs/vllm.md``):

    python -m vllm.entrypoints.openai.api_server --model P --host H --port N
        --tensor-parallel-size T --served-model-name default [--config KEYFILE.yaml]
        --logprobs-mode processed_logprobs --generation-config vllm
        [--dtype D] [--seed S] [--max-num-seqs M] [--load-format F]
        [--weight-transfer-config '{"backend": "nccl"}']      (0.16.0 on, for weights.method distributed)
    env: VLLM_SERVER_DEV_MODE=1   (mounts /pause, /resume, /abort_requests, /collective_rpc and the
                                   weight-transfer endpoints)

Two flags make what vLLM answers what the trainer assumes: ``--logprobs-mode processed_logprobs``
(each token's log-prob under the distribution it was sampled from, after temperature, penalties and
top-k/top-p; vLLM's default is the raw model's, at temperature 1), and ``--generation-config vllm``
(vLLM's own sampling defaults, not the checkpoint's generation_config.json: a Qwen2.5-Instruct
checkpoint would bring top_k 20 and a repetition penalty to every request that leaves them out).

The API key travels as SGLang's does: ``--config FILE.yaml`` holding ``api-key: KEY`` (vLLM reads
a YAML config file of long option names too), written by ``backends.keyfile.write_api_key_file``.

The embedded engine twins vLLM with ``python -m areal_fast.embedded --api vllm
--vllm-version X`` (built by ``sglang_server_command("embedded", ..., extra_args=embedded_vllm_args(X))``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from areal_fast.backends.vllm.compat import DEV_MODE_ENV, VLLMBehaviour
from areal_fast.backends.vllm.requests import DEFAULT_MODEL

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SAMPLING_FLAGS = ("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm")
"""Every launched vLLM server's: behaviour log-probs of the sampled distribution, vLLM's own
sampling defaults (see the module docstring)."""
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
                        load_format: str | None = None, weight_transfer: bool = False,
                        extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The command of one vLLM ``version`` server. ``weight_transfer`` turns on the NCCL weight-transfer
    engine (refused, naming the version, before 0.16.0). The key file, never the key, is on the line."""
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
    cmd = [python, "-m", VLLM_MODULE, "--model", model_path, "--host", host, "--port", str(port),
           "--tensor-parallel-size", str(tp_size), "--served-model-name", DEFAULT_MODEL, *SAMPLING_FLAGS]
    if api_key_file is not None:
        cmd += ["--config", os.fspath(api_key_file)]
    for flag, value in (("--dtype", dtype), ("--seed", seed), ("--max-num-seqs", max_num_seqs),
                        ("--load-format", load_format)):
        if value is not None:
            cmd += [flag, str(value)]
    if weight_transfer:
        if not b.has_weight_transfer:
            raise ValueError(f"vllm_server_command: vLLM {b.version} has no weight transfer (from 0.16.0)")
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd + list(extra_args)


def vllm_server_env() -> dict[str, str]:
    """Environment entries every vLLM server of a run needs (added to the launcher's environment)."""
    return {DEV_MODE_ENV: "1"}


def embedded_vllm_args(version: str) -> list[str]:
    """The embedded engine's flags that make it vLLM ``version``'s twin."""
    VLLMBehaviour.of(version)
    return ["--api", "vllm", "--vllm-version", str(version)]
