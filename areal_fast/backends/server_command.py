"""The one dispatcher of inference-server commands: the kind of servers a run has, and the command
line and environment of one launched server of the run, built by its backend's builder:

- ``backends/sglang/server_command.py``: real SGLang and the embedded engine (SGLang's flag names;
  the embedded engine's vLLM twin adds ``backends/vllm/server_command.embedded_vllm_args``);
- ``backends/vllm/server_command.py``: real vLLM.

Every launcher (local, Ray, Slurm, elastic) asks :func:`server_command` and :func:`server_env` here.
The API key never goes on a command line (``/proc/<pid>/cmdline`` is readable by every local user):
``backends/keyfile.py`` writes it into a private YAML file that every kind takes with ``--config FILE``.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

from areal_fast.rollout.config import SERVERS

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"  # the launch flag of all three engines
KINDS = SERVERS  # the kinds of server a run launches: rollout.server's values


class ServerKind(str, enum.Enum):
    """Where the inference servers of a run come from (decided once, by :func:`server_kind`)."""

    EXTERNAL = "external"  # rollout.servers: running already, started by someone else with their own key
    EMBEDDED = "embedded"  # launched by the run: python -m areal_fast.embedded
    SGLANG = "sglang"  # launched by the run: python -m sglang.launch_server
    VLLM = "vllm"  # launched by the run: python -m vllm.entrypoints.openai.api_server (backends/vllm/server_command.py)

    @property
    def launched(self) -> bool:
        """The run starts these servers (and gives them a fresh API key)."""
        return self is not ServerKind.EXTERNAL


def server_kind(rollout_cfg) -> ServerKind:
    """The servers of a run with this ``rollout`` config section: the ones named in ``rollout.servers``
    (external), else ``rollout.n_servers`` launched servers of ``rollout.server``."""
    if rollout_cfg.servers:
        return ServerKind.EXTERNAL
    return launched_kind(rollout_cfg.server)


def launched_kind(engine: str) -> ServerKind:
    """The kind of server a launcher starts for ``rollout.server`` ('embedded', 'sglang' or 'vllm')."""
    if engine not in KINDS:
        raise ValueError(f"rollout.server must be one of {KINDS}, got {engine!r}")
    return ServerKind(engine)


def _split_tp(server_args: list[str]) -> tuple[int, list[str]]:
    """The tensor-parallel size named in SGLang arguments (--tp-size N, --tp N, --tp-size=N; else 1)
    and the other arguments."""
    tp, rest, skip = 1, [], False
    for i, a in enumerate(server_args):
        if skip:
            skip = False
            continue
        for flag in ("--tp-size", "--tp", "--tensor-parallel-size", "-tp"):
            if a == flag and i + 1 < len(server_args):
                tp, skip = int(server_args[i + 1]), True
                break
            if a.startswith(flag + "="):
                tp = int(a.split("=", 1)[1])
                break
        else:
            rest.append(a)
    return tp, rest


def tp_size(server_args: list[str]) -> int:
    return _split_tp(server_args)[0]


def gpus_per_server(rollout_cfg) -> int:
    """GPUs one launched server of ``rollout.server`` takes: SGLang and vLLM their tensor-parallel size, the
    embedded engine one on a CUDA device and none on the CPU."""
    kind = launched_kind(rollout_cfg.server)
    if kind is ServerKind.VLLM:  # tensor x pipeline x data parallel
        from areal_fast.backends.vllm.server_command import gpus_of

        tp, rest = _split_tp(list(rollout_cfg.server_args))
        return gpus_of(tp, rest)
    if kind is ServerKind.SGLANG:
        return tp_size(rollout_cfg.server_args)
    return int(rollout_cfg.device.startswith("cuda"))


def server_command(rollout_cfg, model_path: str, host: str, port: int, *, seed: int,
                   api_key_file: str | Path | None, python: str = sys.executable) -> list[str]:
    """The command of one inference server of the run (``rollout.server``), through the one builder
    of server command lines; ``rollout.server_args`` are appended. The API key travels in
    ``api_key_file`` (``--config``, see ``launch.base.server_key_file``), never on the command line."""
    from areal_fast.backends.sglang.server_command import sglang_server_command as build

    r = rollout_cfg
    server_args = list(r.server_args)
    if r.return_routed_experts and ROUTED_EXPERTS_FLAG not in server_args:  # each engine records routing on it
        server_args.append(ROUTED_EXPERTS_FLAG)
    if api_key_file is not None and "--config" in r.server_args:
        raise ValueError("rollout.server_args: --config is taken by the launcher (it passes the run's API key "
                         "in a private file); give those options in rollout.server_args instead")
    if launched_kind(r.server) is ServerKind.EMBEDDED:
        twin = []  # backend 'vllm': the engine serves vLLM's API of that release (docs/vllm.md)
        if r.api == "vllm":
            from areal_fast.backends.vllm.server_command import embedded_vllm_args

            twin = embedded_vllm_args(r.vllm_version)
        return build("embedded", model_path, host, port, api_key_file=api_key_file, weight_version="0", seed=seed,
                     device=r.device, max_running_requests=max(256, r.max_concurrent * r.group_size),
                     extra_args=twin + server_args, python=python)
    tp, rest = _split_tp(server_args)
    python = r.server_python or python  # a real server may live in an environment of its own
    if launched_kind(r.server) is ServerKind.VLLM:  # real vLLM (backends/vllm/server_command.py)
        from areal_fast.backends.vllm.compat import VLLMBehaviour
        from areal_fast.backends.vllm.server_command import prefix_caching_for, vllm_server_command

        # the weight-transfer engine is on whenever the release has it: the run's weights.method is
        # not known here, and an unused transfer engine costs nothing until /init_weight_transfer_engine
        return vllm_server_command(model_path, host, port, version=r.vllm_version, tp_size=tp,
                                   api_key_file=api_key_file, seed=seed,
                                   max_num_seqs=max(256, r.max_concurrent * r.group_size),
                                   weight_transfer=VLLMBehaviour.of(r.vllm_version).has_weight_transfer,
                                   prefix_caching=prefix_caching_for(r.pause_mode, r.vllm_version),
                                   extra_args=rest, python=python)
    return build("sglang", model_path, host, port, tp_size=tp, api_key_file=api_key_file, weight_version="0",
                 seed=seed, extra_args=rest, python=python)


def server_env(rollout_cfg) -> dict[str, str]:
    """The environment entries of one launched server (vLLM's: its dev-mode endpoints on)."""
    threads = str(rollout_cfg.threads_per_server)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    user = getattr(rollout_cfg, "server_env", None) or {}
    if getattr(rollout_cfg, "server", None) == "vllm":  # dev mode; the key guard's directory on PYTHONPATH
        from areal_fast.backends.vllm.server_command import vllm_server_env

        env.update(vllm_server_env())
        if "PYTHONPATH" in user:  # the user's path after the guard's, which stays first
            user = {**user, **vllm_server_env({"PYTHONPATH": user["PYTHONPATH"]})}
    env.update(user)
    return env
