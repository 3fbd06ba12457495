"""The shipped tiny recipe trains against real vLLM (its CPU build), launched the documented way.

``areal-fast train examples/tiny_reverse.yaml`` with ``rollout.engine: vllm`` (the run launches the
server from its warm-started model, which ships a ``tokenizer.json``), the server's interpreter in
vLLM's own virtual environment (``rollout.server_python``), vLLM's CPU options and disk weight
updates, exactly as ``docs/vllm.md`` tells a user on a CPU machine. What it must show:

- held-out exact match >= 0.7 (the warm start is ~0.2);
- every token labelled with the weights that made it: with ``strict_staleness`` every trained group
  is within ``max_staleness``, the staleness is not the step number (all tokens labelled with the
  launch version would make it so, and strict mode would then drop every group), and almost nothing
  is dropped;
- the watchdogs never asked vLLM for SGLang's ``/model_info`` (each a 404 in vLLM's log).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import real_vllm as rv

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"
STEPS, ETA = 20, 4


def test_the_tiny_recipe_trains_against_real_vllm_with_exact_token_versions(tmp_path):
    try:
        python = rv.vllm_python()
    except rv.VLLMUnavailable as e:
        rv.skip_or_fail(str(e))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(EXAMPLE), f"experiment.output_dir={out}",
           *rv.run_overrides(python), f"experiment.total_steps={STEPS}", "eval.every_steps=10",
           f"rollout.max_staleness={ETA}", "rollout.strict_staleness=true", "log.progress=false",
           "log.tensorboard=false", "log.plots=false"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    server_log = out / "logs" / "server0.log"
    assert r.returncode == 0, (r.stderr[-3000:], server_log.read_text(errors="replace")[-3000:]
                               if server_log.exists() else "")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["eval"]["eval_reward"] >= 0.7, summary["eval"]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "staleness_max" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(m["staleness_max"] <= ETA for m in steps), [m["staleness_max"] for m in steps]
    assert steps[-1]["staleness_mean"] < ETA + 1 <= STEPS - 1  # not the step number: labels move
    dropped, trained = summary["counters"]["dropped_stale"], summary["counters"]["trained_groups"]
    assert dropped <= trained // 10, (dropped, trained)
    log = server_log.read_text(errors="replace")
    assert '"GET /version' in log and "/model_info" not in log and "/v1/completions" in log
