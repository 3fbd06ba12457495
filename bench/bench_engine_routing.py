"""The embedded engine's routed-experts recording (``--enable-return-routed-experts``, docs/moe.md):
the cost of one decode step of the tiny Qwen3-MoE with the recording against one without.

A batch of ``--batch`` requests (8-token prompts in the KV cache) takes one decode step, the way
the scheduler runs it (``Scheduler._forward``'s two paths: the plain forward, and the forward under
``record_routing`` followed by ``RoutingCapture.store`` into every request's rows); reported: the
fastest of ``--rounds`` x ``--steps`` steps of each, in ms.

    python bench/bench_engine_routing.py [--batch 16] [--rounds 5] [--steps 50]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    from transformers import DynamicCache

    from areal_fast.data.tiny_models import build_tiny_qwen3_moe, load_hf
    from areal_fast.embedded.routing_capture import RoutingCapture
    from areal_fast.embedded.scheduler import Request

    with tempfile.TemporaryDirectory() as d:
        model = load_hf(build_tiny_qwen3_moe(d, vocab_size=64, max_position_embeddings=128))
    cap = RoutingCapture(model)
    b = args.batch
    reqs = [Request(rid=str(i), input_ids=[3] * 8, params=None, on_finish=None, routing_start=0) for i in range(b)]
    with torch.inference_mode():
        cache = model(input_ids=torch.randint(0, 64, (b, 8)), past_key_values=DynamicCache(config=model.config),
                      use_cache=True).past_key_values
        x = torch.randint(0, 64, (b, 1))

        def plain():
            model(input_ids=x, past_key_values=cache, use_cache=True)
            cache.crop(-1)

        def recorded():
            with cap.recording() as got:
                model(input_ids=x, past_key_values=cache, use_cache=True)
            cap.store(reqs, got, [8] * b, 1)
            cache.crop(-1)

        best = {}
        for _ in range(args.rounds):
            for name, fn in (("plain", plain), ("recorded", recorded)):
                t = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                ms = (time.perf_counter() - t) / args.steps * 1e3
                best[name] = min(best.get(name, ms), ms)
    print(f"batch {b}: plain {best['plain']:.3f} ms, recorded {best['recorded']:.3f} ms per decode step "
          f"(+{best['recorded'] - best['plain']:.3f} ms), fastest of {args.rounds} x {args.steps}")


if __name__ == "__main__":
    main()
