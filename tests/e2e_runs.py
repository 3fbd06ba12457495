"""Shared pieces of the end-to-end runs (``areal-fast train`` in subprocesses): the shrunken tiny
task's overrides, and warm starts built once per session and handed to each run.

A run warm-starts its model into ``<output_dir>/warm_start``, a cache keyed by everything the model
depends on (``areal_fast.data.warm_start.signature``). The suite builds each warm start its runs
share once (``tests/conftest.py``: ``tiny_warm_start``, ``recipe_warm_start``) and copies it into a
run's output directory before the run starts (:func:`seed_run_dir`); the run finds it up to date
and uses it, as a rerun of the same command would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"

ETA = 1
# The tiny task shrunk to a fraction of a second a step: a 1-block model warm-started for 10 steps,
# short strings, groups of two, a checkpoint every step.
TINY = [
    "model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
    "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
    "model.warm_start.num_key_value_heads=1", "data.synthetic.max_len=6", "data.synthetic.n_train=200",
    "data.synthetic.n_eval=8", "rollout.group_size=2", "rollout.max_new_tokens=8",
    f"rollout.max_staleness={ETA}", "rollout.strict_staleness=true", "rollout.max_concurrent=8",
    "train.batch_size=2", "eval.every_steps=0", "checkpoint.every_steps=1", "log.tensorboard=false",
    "log.progress=false", "reward.workers=1",
]

_BUILD = """
import sys
from areal_fast.config import load_config
from areal_fast.launch.train import model_dir
print(model_dir(load_config(sys.argv[1], sys.argv[2:]), say=lambda *a: None))
"""


def build_warm_start(example: Path, overrides: list[str], where: Path, timeout_s: float = 900) -> Path:
    """The warm start a run of ``example`` with ``overrides`` builds, built under ``where`` by the
    run's own code (in a subprocess: it sets torch's thread count while it trains)."""
    r = subprocess.run([sys.executable, "-c", _BUILD, str(example), f"experiment.output_dir={where}", *overrides],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"building the warm start of {example.name} {' '.join(overrides)} failed: "
                           f"{r.stderr[-3000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def seed_run_dir(warm: Path, out: Path) -> Path:
    """``out`` (a run's output directory, created) holding a copy of the warm start ``warm``."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(warm, out / "warm_start")
    return out


def assert_warm_start_used(warm: Path, out: Path) -> None:
    """The run of ``out`` found the copy of ``warm`` up to date and did not build its own."""
    name = "warm_start.json"  # the build's record (areal_fast.data.warm_start.SIGNATURE_FILE): a rebuild rewrites it
    assert (out / "warm_start" / name).read_text() == (warm / name).read_text(), "the run rebuilt its warm start"


def assert_versions_label_the_tokens(metrics: list[dict], steps: int, eta: int) -> list[dict]:
    """A run's train records (``metrics.jsonl`` rows with ``staleness_max``): one a step, 1..``steps``, each
    within the bound ``eta``, and the labels move with the weights. With ``steps - 1 > eta`` the staleness is
    not the step number (every token labelled with the launch version), and some step trained tokens made by
    earlier weights (every token labelled with the weights current at training time would make it 0
    throughout). Returns the train records."""
    train = [m for m in metrics if "staleness_max" in m]
    seen = [m["staleness_max"] for m in train]
    assert [m["step"] for m in train] == list(range(1, steps + 1)), [m["step"] for m in train]
    assert all(s <= eta for s in seen), seen
    assert max(seen) > 0, seen
    return train

