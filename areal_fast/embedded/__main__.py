"""``python -m areal_fast.embedded --model-path PATH --host 127.0.0.1 --port N [...]``: serve until killed.

Shared flags use SGLang's names (``areal_fast.backends.sglang.server_command`` builds the command line).

``--config FILE.yaml`` works as in ``sglang.launch_server``: the file is a YAML mapping whose keys
are long option names without the dashes (``api-key: KEY``, ``max-running-requests: 64``; a true
boolean turns a switch on), read as if its options came before the command line, so an option given
on the command line wins. The launcher passes the API key this way, to keep it off the command line
(readable by every local user in ``/proc/<pid>/cmdline``). With no key from either,
``$AREAL_FAST_API_KEY`` is used when set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from areal_fast.backends.vllm.compat import SCHEDULING_POLICIES
from areal_fast.procutil import raise_nofile_limit
from areal_fast.weights.config import API_KEY_ENV


def merge_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's options, put first (SGLang's rule:
    command line over file over defaults). Bad files and keys end in ``parser.error`` naming them."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        parser.error("--config given more than once; a server takes one config file")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            parser.error("--config needs a file name")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    return _config_args(Path(path), parser) + rest


def _config_args(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    import yaml

    if path.suffix.lower() not in (".yaml", ".yml"):
        parser.error(f"--config {path}: the file must be YAML (.yaml or .yml)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: cannot read it: {e}")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"--config {path}: the file must hold a mapping of option names to values, "
                     f"not a {type(data).__name__}")
    actions = {s[2:]: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    out = []
    for key, value in data.items():
        action = actions.get(str(key))
        if action is None or key in ("config", "help"):
            hint = f" (options are spelled with dashes: {str(key).replace('_', '-')!r})" if "_" in str(key) else ""
            parser.error(f"--config {path}: unknown option {key!r}{hint}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key!r} is a switch: give true or false, not {value!r}")
            out += [f"--{key}"] if value else []
        elif value is None or isinstance(value, (list, dict)):
            parser.error(f"--config {path}: {key!r} needs one value, got {value!r}")
        else:
            value = str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"--{key}={value}")  # '=': a value starting with '-' is not read as an option
    return out


def build_parser() -> argparse.ArgumentParser:
    from areal_fast.backends.sglang.compat import DEFAULT_SGLANG_VERSION

    p = argparse.ArgumentParser(prog="python -m areal_fast.embedded", description=__doc__)
    p.add_argument("--model-path", "--model", dest="model", required=True, help="Hugging Face checkpoint dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1, help="must be 1: the embedded engine runs one device")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="do not load a tokenizer (input_ids only)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--random-seed", "--seed", dest="seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--load-format", default="auto", help="auto, safetensors or dummy (random weights)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health*); "
                   f"default ${API_KEY_ENV}. Anyone on this machine can read a command line: prefer --config")
    p.add_argument("--config", metavar="FILE.yaml", help="options from a YAML file (keys: long option names); "
                   "the command line wins")
    p.add_argument("--sglang-version", default=DEFAULT_SGLANG_VERSION,
                   help="the SGLang release whose behaviour to reproduce (0.5.6 .. 0.5.23)")
    p.add_argument("--api", choices=("sglang", "vllm"), default="sglang",
                   help="the HTTP API to serve: SGLang's, or vLLM's (docs/vllm.md)")
    p.add_argument("--vllm-version", default=None,
                   help="with --api vllm: the vLLM release whose routes to serve (0.11.0 .. 0.33.0)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="with --api vllm: the context in tokens (vLLM's flag; default the model's "
                   "max_position_embeddings): a longer prompt, or more tokens asked, is answered 400 as vLLM answers")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="with --api vllm: the names a completion's model may give (vLLM's flag; default 'default', "
                   "the launcher's); another is answered 404 as vLLM answers")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="with --api vllm: vLLM's flag, accepted and reported by /server_info; the twin caches no "
                   "prefix (its answers never reuse KV), so its default is off")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
                   help="with --api vllm: vLLM's flag: the waiting queue first come first served (fcfs, vLLM's "
                   "default) or by each completion's priority, lowest first, then arrival (priority); under fcfs "
                   "a completion's priority is accepted and has no effect, as on vLLM")
    p.add_argument("--weight-transfer-config", default=None,
                   help='with --api vllm: vLLM\'s flag, JSON {"backend": "nccl"} (whole updates, the default) or '
                   '{"backend": "sparse_nccl"} (delta updates as checkpoint-coordinate patches, 0.32.0 on)')
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: serve the linear weights block-quantised (E4M3, 128x128 blocks), as SGLang and vLLM "
                   "serve an FP8 checkpoint; FP8 weights from the trainer are dequantised per block at load")
    p.add_argument("--dist-timeout", type=float, default=120.0,
                   help="seconds a weight-update rendezvous or broadcast may wait before the call fails")
    p.add_argument("--attn-implementation", default="sdpa", help="sdpa or eager")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters loaded at run time "
                   "(vLLM's /v1/load_lora_adapter or SGLang's /load_lora_adapter; docs/lora.md)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    p.add_argument("--max-loras", "--max-loras-per-batch", dest="max_loras", type=int, default=4,
                   help="adapters loaded at once")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record the top-k experts of every token in every sparse block and return them when a "
                   "request asks (SGLang's return_routed_experts, vLLM's routed_experts; docs/moe.md)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(merge_config_file(list(sys.argv[1:] if argv is None else argv), p))
    if not args.api_key:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api != "vllm":
        vllm_flags = (("--max-model-len", args.max_model_len), ("--served-model-name", args.served_model_name),
                      ("--enable-prefix-caching", args.enable_prefix_caching or None),
                      ("--scheduling-policy", args.scheduling_policy),
                      ("--weight-transfer-config", args.weight_transfer_config))
        given = [f for f, v in vllm_flags if v is not None]
        if given:
            p.error(f"{given[0]}: a vLLM flag, served with --api vllm only")
    args.weight_transfer_backend = transfer_backend_of(args.weight_transfer_config, p)
    if args.max_model_len is not None and args.max_model_len < 1:
        p.error(f"--max-model-len {args.max_model_len}: must be >= 1")
    if args.tp_size != 1:
        p.error(f"--tp-size {args.tp_size}: the embedded engine runs on one device (tp size 1)")
    return args


def transfer_backend_of(config: str | None, p: argparse.ArgumentParser) -> str:
    """The backend of vLLM's ``--weight-transfer-config`` JSON (default 'nccl'); a parser error otherwise."""
    if config is None:
        return "nccl"
    try:
        backend = json.loads(config).get("backend", "nccl")
    except (ValueError, AttributeError):
        p.error(f"--weight-transfer-config {config!r}: expected JSON like {{\"backend\": \"sparse_nccl\"}}")
    return str(backend)


def main(argv: list[str] | None = None) -> None:
    raise_nofile_limit()  # every connection is a descriptor: the soft limit (often 1024) is not the ceiling
    from areal_fast.embedded.server import EngineServer
    from areal_fast.http.conn_guard import serve_forever

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    server = EngineServer(
        args.model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        attn_implementation=args.attn_implementation,
        sglang_version=args.sglang_version,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
        dist_timeout_s=args.dist_timeout,
        api=args.api,
        vllm_version=args.vllm_version,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        return_routed_experts=args.enable_return_routed_experts,
        max_model_len=args.max_model_len,
        served_model_names=args.served_model_name,
        prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        weight_transfer_backend=args.weight_transfer_backend,
        quantization=args.quantization,
    )
    serve_forever(server.build_app(), args.host, args.port, server.conn_limits)


if __name__ == "__main__":
    main()
