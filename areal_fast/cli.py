"""``areal-fast``: the command line.

    areal-fast train CONFIG [KEY=VALUE ...] [--no-progress]   train (resumes from the newest checkpoint)
    areal-fast eval CONFIG [KEY=VALUE ...] [--checkpoint DIR]  greedy evaluation of a checkpoint or final/
    areal-fast info                                            versions, backends, devices
    areal-fast config CONFIG [KEY=VALUE ...] [--check]        print the resolved configuration
    areal-fast servers list|add|remove|set --run-dir DIR [N | URL]   a running run's servers (docs/elastic.md)
    areal-fast scale RUN N | auto | --min A --max B          a running run's server count, a bound of its
                                                             autoscale policy (docs/autoscale.md)
    areal-fast slurm-script CONFIG [KEY=VALUE ...] > job.sh    an sbatch script of the run (launcher 'slurm')

Overrides use dotted keys: ``areal-fast train examples/tiny_reverse.yaml train.optim.lr=1e-3``;
flags may come anywhere after the command (before, between or after the overrides). A bad key
or value, a name that does not resolve, or something this machine lacks (a model directory, a
data file, a CUDA device) exits with status 2 and a message naming the key, before any process
is started. ``docs/config.md`` describes every key.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from areal_fast.procutil import raise_nofile_limit

_COMMANDS = {
    "train": "train from a YAML config",
    "eval": "greedy evaluation on the held-out set",
    "config": "print the resolved configuration",
    "info": "versions, backends and devices",
    "servers": "list, add or remove the inference servers of a running run",
    "scale": "pin a running run's server count (a bound its autoscale policy keeps), or give it bounds",
    "slurm-script": "print an sbatch script that trains CONFIG on a Slurm allocation (docs/multinode.md)",
}


def _command_parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"areal-fast {cmd}", description=_COMMANDS[cmd], allow_abbrev=False)
    if cmd == "info":
        return p
    if cmd == "servers":
        p.add_argument("action", choices=["list", "add", "remove", "set"])
        p.add_argument("arg", nargs="?",
                       help="add: how many (1); remove: a server URL or how many (1); set: the number "
                            "(the target is at most 1024: elastic.members.MAX_SERVERS)")
        p.add_argument("--run-dir", required=True, help="the run's experiment.output_dir")
        return p
    if cmd == "scale":
        p.add_argument("run", help="the run's experiment.output_dir")
        p.add_argument("n", nargs="?", help="the server count to pin (both bounds), or 'auto' to clear the bound")
        p.add_argument("--min", type=int, help="the fewest servers the policy may keep")
        p.add_argument("--max", type=int, help="the most servers the policy may start")
        return p
    p.add_argument("config", help="YAML run configuration (see docs/config.md)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.optim.lr=1e-5")
    if cmd == "train":
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    elif cmd == "eval":
        p.add_argument("--checkpoint", help="HF model directory or training checkpoint (default: <output_dir>/final)")
    elif cmd == "config":
        p.add_argument("--check", action="store_true",
                       help="also check what the config asks of this machine (files, CUDA devices, packages)")
    return p


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="areal-fast", description="Fast asynchronous RL for reasoning LLMs.",
                                epilog="commands: " + "; ".join(f"{k}: {v}" for k, v in _COMMANDS.items()))
    p.add_argument("cmd", choices=list(_COMMANDS), help="command")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command, then its arguments parsed so that flags may sit anywhere among the overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _top_parser().parse_args(argv or ["--help"])
    top = _top_parser().parse_args(argv[:1])
    args = _command_parser(top.cmd).parse_intermixed_args(argv[1:])
    args.cmd = top.cmd
    return args


def _fail(msg: str) -> SystemExit:
    print(f"areal-fast: config error: {msg}", file=sys.stderr)
    return SystemExit(2)


def _load(args, machine: bool):
    from areal_fast.config import ConfigError, load_config
    from areal_fast.preflight import check_machine

    try:
        cfg = load_config(args.config, args.overrides, training=args.cmd != "eval")  # eval: greedy, trains nothing
        if machine:
            check_machine(cfg)
    except ConfigError as e:
        raise _fail(str(e)) from None
    return cfg


REDELIVER_S = 0.05  # a stop signal that landed in a finalizer comes again this much later


def _terminate_as_interrupt(signum, frame):
    """SIGTERM unwinds like Ctrl-C. While the controller's event loop runs, the loop takes the signal
    over (``rollout/loop.py``); elsewhere this raises, except inside a ``__del__``: Python prints an
    exception raised there and drops it (the run went on), so the signal is sent again a moment later."""
    if _in_finalizer(frame):
        threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def main(argv: list[str] | None = None) -> int:
    raise_nofile_limit()  # the controller's connections (servers, the agent endpoint) are descriptors
    args = parse_args(argv)
    if args.cmd == "info":
        from areal_fast import __version__, dispatch

        info = {"areal_fast": __version__, **dispatch.describe()}
        for mod in ("torch", "transformers", "triton", "sglang", "aiohttp"):
            try:
                info[mod] = __import__(mod).__version__
            except Exception:  # noqa: BLE001 - optional
                info[mod] = "not installed"
        print(json.dumps(info, indent=1, default=str))
        return 0
    if args.cmd == "servers":
        from areal_fast.elastic.members import servers_command

        try:
            print(json.dumps(servers_command(args.action, args.run_dir, args.arg), indent=1))
        except ValueError as e:
            raise _fail(str(e)) from None
        return 0
    if args.cmd == "scale":
        from areal_fast.elastic.autoscale import scale_command

        try:
            print(json.dumps(scale_command(args.run, args.n, args.min, args.max), indent=1))
        except ValueError as e:
            raise _fail(str(e)) from None
        return 0
    cfg = _load(args, machine=args.cmd in ("train", "eval") or getattr(args, "check", False))
    if args.cmd == "slurm-script":
        from areal_fast.launch.slurm import batch_script

        print(batch_script(cfg, args.config, args.overrides), end="")
        return 0
    if args.cmd == "config":
        import yaml

        from areal_fast.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    # SIGTERM (e.g. from `timeout` or a scheduler) unwinds like Ctrl-C: every process is shut down
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    if args.cmd == "train":
        from areal_fast.launch.train import RUN_REFUSED, run_train  # local, Ray or Slurm launcher (cfg.launcher)

        if cfg.launcher == "slurm":  # an allocation to run in, before anything starts
            from areal_fast.launch.slurm import job_ids

            try:
                job_ids(cfg.slurm)
            except ValueError as e:
                raise _fail(str(e)) from None

        try:
            s = run_train(cfg, progress=False if args.no_progress else None)
        except RUN_REFUSED as e:
            print(f"areal-fast: {e}", file=sys.stderr)
            return 1
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
        from pathlib import Path

        from areal_fast.launch.evaluate import run_eval

        if args.checkpoint and not Path(args.checkpoint).is_dir():
            raise _fail(f"--checkpoint: {args.checkpoint!r} is not a directory (a Hugging Face model directory "
                        "or a training checkpoint)")

        print(json.dumps(run_eval(cfg, args.checkpoint)))
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
