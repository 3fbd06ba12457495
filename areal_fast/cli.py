"""``areal-fast``: the command line.

    areal-fast train CONFIG [KEY=VALUE ...]     train (resumes from the newest checkpoint)
    areal-fast eval CONFIG [--checkpoint DIR]   greedy evaluation of a checkpoint (or the final model)
    areal-fast info                             versions, backends, devices
    areal-fast config CONFIG [KEY=VALUE ...]    print the resolved configuration

Overrides use dotted keys: ``areal-fast train examples/tiny_reverse.yaml train.optim.lr=1e-3``.
A bad key or value exits with status 2 and a message naming the key.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import yaml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="areal-fast", description="Fast asynchronous RL for reasoning LLMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = sub.add_parser("eval", help="greedy evaluation on the held-out set")
    e.add_argument("config")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint", help="HF model directory or training checkpoint (default: <output_dir>/final)")
    c = sub.add_parser("config", help="print the resolved configuration")
    c.add_argument("config")
    c.add_argument("overrides", nargs="*")
    sub.add_parser("info", help="versions and backends")
    return p


def _load(args):
    from areal_fast.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"areal-fast: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _terminate_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "info":
        from areal_fast import __version__, backend

        info = {"areal_fast": __version__, **backend.describe()}
        for mod in ("torch", "transformers", "triton", "sglang", "aiohttp"):
            try:
                info[mod] = __import__(mod).__version__
            except Exception:  # noqa: BLE001 - optional
                info[mod] = "not installed"
        print(json.dumps(info, indent=1, default=str))
        return 0
    cfg = _load(args)
    if args.cmd == "config":
        from areal_fast.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    # SIGTERM (e.g. from `timeout` or a scheduler) unwinds like Ctrl-C: every process is shut down
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    if args.cmd == "train":
        if cfg.launcher == "ray":
            from areal_fast.launch.ray_launcher import run_with_ray as run
        else:
            from areal_fast.launch.train import run_train as run

        try:
            s = run(cfg, progress=False if args.no_progress else None)
        except KeyboardInterrupt:
            print("areal-fast: interrupted; every process was stopped. Run the same command to resume.",
                  file=sys.stderr)
            return 130
        if s:
            first, last = s.get("eval_first") or {}, s.get("eval") or {}
            print(json.dumps({"steps": s.get("steps"), "elapsed_s": round(s.get("elapsed_s", 0), 1),
                              "eval_reward_first": first.get("eval_reward"),
                              "eval_reward_last": last.get("eval_reward"),
                              "output_dir": str(cfg.experiment.out)}))
        return 0
    if args.cmd == "eval":
        from areal_fast.launch.evaluate import run_eval

        print(json.dumps(run_eval(cfg, args.checkpoint)))
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
