"""``python -m areal_fast.rollout.engine --model-path PATH --host 127.0.0.1 --port N [...]``: serve until killed.

Shared flags use SGLang's names (``areal_fast.rollout.server_command`` builds the command line).
"""

from __future__ import annotations

import argparse
import logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from areal_fast.rollout.engine.compat import DEFAULT_SGLANG_VERSION

    p = argparse.ArgumentParser(prog="python -m areal_fast.rollout.engine", description=__doc__)
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
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health*)")
    p.add_argument("--sglang-version", default=DEFAULT_SGLANG_VERSION,
                   help="the SGLang release whose behaviour to reproduce (0.5.6 .. 0.5.23)")
    p.add_argument("--dist-timeout", type=float, default=120.0,
                   help="seconds a weight-update rendezvous or broadcast may wait before the call fails")
    p.add_argument("--attn-implementation", default="sdpa", help="sdpa or eager")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.tp_size != 1:
        p.error(f"--tp-size {args.tp_size}: the embedded engine runs on one device (tp size 1)")
    return args


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    from areal_fast.rollout.engine.server import EngineServer

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
    )
    web.run_app(server.build_app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
