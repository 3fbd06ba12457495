"""The shipped tiny recipe trains against real vLLM (its CPU build).

``areal-fast train examples/tiny_reverse.yaml`` with its servers the session's real vLLM server
(``rollout.servers``: started the documented way, with vLLM's CPU options, on the recipe's warm start,
which ships a ``tokenizer.json``) and disk weight updates; the run starts from the same warm start
(``recipe_warm_start``), and the server is restored to it after the run. (A run that launches its
vLLM server itself, as ``docs/vllm.md`` tells a user on a CPU machine, is
``tests/agent/test_agent_real_vllm.py``'s.) What it must show:

- held-out exact match >= 0.7 (the warm start is ~0.2);
- every token labelled with the weights that made it: with ``strict_staleness`` every trained group
  is within ``max_staleness``, the staleness is not the step number (all tokens labelled with the
  launch version would make it so, and strict mode would then drop every group), and almost nothing
  is dropped;
- the watchdogs never asked vLLM for SGLang's ``/model_info`` (each a 404 in vLLM's log).
"""

from __future__ import annotations

import json
from pathlib import Path

import real_vllm as rv

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_reverse.yaml"
STEPS, ETA = 20, 4


def test_the_tiny_recipe_trains_against_real_vllm_with_exact_token_versions(tmp_path, real_vllm, recipe_warm_start):
    from e2e_runs import assert_versions_label_the_tokens, assert_warm_start_used

    out = tmp_path / "run"
    r, log = rv.train_against(real_vllm, recipe_warm_start, EXAMPLE, out, [
        f"experiment.total_steps={STEPS}", "eval.every_steps=10", f"rollout.max_staleness={ETA}",
        "rollout.strict_staleness=true", "log.progress=false", "log.tensorboard=false", "log.plots=false"])
    assert r.returncode == 0, (r.stderr[-3000:], log[-3000:])
    assert_warm_start_used(recipe_warm_start, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["eval"]["eval_reward"] >= 0.7, summary["eval"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert_versions_label_the_tokens(metrics, STEPS, ETA)
    dropped, trained = summary["counters"]["dropped_stale"], summary["counters"]["trained_groups"]
    assert dropped <= trained // 10, (dropped, trained)
    assert '"GET /version' in log and "/model_info" not in log and "/v1/completions" in log
