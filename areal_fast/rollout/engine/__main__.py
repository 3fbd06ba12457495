"""``python -m areal_fast.rollout.engine --model PATH --host 127.0.0.1 --port N [...]``: serve until killed."""

from __future__ import annotations

import argparse
import logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_fast.rollout.engine", description=__doc__)
    p.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face checkpoint dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--attn-implementation", default="sdpa", help="sdpa or eager")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


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
    )
    web.run_app(server.build_app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
