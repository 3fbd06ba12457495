"""The tiny recipe as a LoRA run on the embedded engine (``examples/tiny_reverse_lora.yaml``): it
learns with the base frozen, so every gain in held-out exact match comes from the adapter the
engine applies to the requests that name it; every update is adapter-only; versions stay within the
staleness bound; a second command resumes from the adapter checkpoint and the engine gets the
restored adapter before generating."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse_lora.yaml"
STEPS, MORE, ETA = 30, 4, 4


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "areal_fast.cli", "train", str(EXAMPLE), f"experiment.output_dir={out}",
            "eval.every_steps=15", "checkpoint.every_steps=15", f"rollout.max_staleness={ETA}",
            "rollout.strict_staleness=true", "log.tensorboard=false", "log.plots=false", *extra]


def test_the_tiny_recipe_learns_as_a_lora_run_and_resumes_from_its_adapter(tmp_path, recipe_warm_start):
    from e2e_runs import assert_versions_label_the_tokens, assert_warm_start_used, seed_run_dir

    out = seed_run_dir(recipe_warm_start, tmp_path / "run")  # the session's warm start of the recipe
    r = subprocess.run(_cmd(out, f"experiment.total_steps={STEPS}"), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_warm_start_used(recipe_warm_start, out)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m["eval_reward"] for m in metrics if m.get("kind") == "eval"]
    assert evals[0] <= 0.3 and evals[-1] >= evals[0] + 0.25, evals  # base frozen: the adapter did it
    steps = assert_versions_label_the_tokens(metrics, STEPS, ETA)
    assert all("sync/adapter_sync_s" in m and "sync/broadcast_s" not in m and "sync/disk_sync_s" not in m
               for m in steps)  # the adapter port on every update, never a whole-model transport
    trainer_ckpt = out / "checkpoints" / f"step_{STEPS:08d}" / "trainer"
    assert sum(f.stat().st_size for f in trainer_ckpt.iterdir()) < 1_000_000  # adapter + Adam state, no base
    final = {p.name for p in (out / "final").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= final and "model.safetensors" not in final

    r = subprocess.run(_cmd(out, f"experiment.total_steps={STEPS + MORE}", "experiment.resume=true"), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if "staleness_max" in m]
    assert steps == list(range(1, STEPS + MORE + 1))  # resumed at STEPS: no step twice, none lost
    evals = [m["eval_reward"] for m in metrics if m.get("kind") == "eval"]
    assert evals[-1] >= evals[0] + 0.25, evals  # the restored adapter reached the engine
