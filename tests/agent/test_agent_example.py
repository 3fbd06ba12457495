"""The lookup agent example (``areal_fast/recipes/lookup_agent.py``, ``examples/tiny_lookup_agent.yaml``):
with a scripted model, a call with the right key gets the stored value as the answer, a miss finds
nothing (with ``max_calls`` 2 the model queries again after the empty result), an answer without a
call is a guess; and the example trains
end to end (``areal-fast train``, shrunk to two steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_agent_session import EOS, TOK, ScriptedRollout, ids, run

from areal_fast.agent.client import AgentClient
from areal_fast.data import tiny_task
from areal_fast.data.datasets import PromptRow
from areal_fast.recipes.lookup_agent import store
from areal_fast.workflow import EpisodeEngine
from areal_fast.workflow.api import load_workflow

ROOT = Path(__file__).resolve().parents[2]
ROW = PromptRow(index=0, text="3719", task={})


class Exact:
    async def score(self, task, completion):
        return type("R", (), {"value": tiny_task.reward(task, completion), "status": "ok"})()


def _episode(outputs, **agent_args):
    rollout = ScriptedRollout(outputs)
    eng = EpisodeEngine(rollout, Exact(), TOK, {"max_new_tokens": 8, "temperature": 1.0}, "lookup-ep", training=True,
                        chat_client=AgentClient.for_engine)
    wf = load_workflow("areal_fast.agent.workflow:openai_agent")
    trajectories = run(wf(ROW, eng, agent="areal_fast.recipes.lookup_agent:solve", call_marker="*",
                          agent_args=agent_args))
    return trajectories, rollout


def test_the_value_comes_only_through_a_lookup_with_the_exact_key():
    table, key = store(ROW.text)
    wrong = next(k for k in map(str, range(100, 1000)) if k not in table)
    (right,), _ = _episode([ids(key[::-1] + "*") + [EOS]])
    assert right.reward == 1.0 and right.info["tool_calls"] == 1.0
    (miss,), _ = _episode([ids(wrong[::-1] + "*") + [EOS]])
    assert miss.reward == 0.0 and miss.info["calls"] == 1.0  # one query by default: a miss finds nothing
    (retry,), rollout = _episode([ids(wrong[::-1] + "*") + [EOS], ids(key[::-1] + "*") + [EOS]], max_calls=2)
    assert retry.reward == 1.0 and retry.info["calls"] == 2.0
    first = [TOK.bos_token_id] + ids(f"*{key}=")
    assert rollout.prompts == [first, first + ids(wrong[::-1] + "*") + [EOS]]  # the miss: an empty result
    (guess,), _ = _episode([ids(table[key][::-1][:2]) + [EOS]])  # no call: the value cannot be known
    assert guess.reward == 0.0 and guess.info["tool_calls"] == 0.0


@pytest.mark.slow
def test_lookup_example_trains_end_to_end(tmp_path):
    pytest.importorskip("openai")
    tiny = ["model.warm_start.steps=10", "model.warm_start.hidden_size=32", "model.warm_start.intermediate_size=64",
            "model.warm_start.num_hidden_layers=1", "model.warm_start.num_attention_heads=2",
            "model.warm_start.num_key_value_heads=1", "data.synthetic.n_eval=8", "rollout.group_size=2",
            "rollout.max_concurrent=8", "train.batch_size=4", "experiment.total_steps=2", "eval.every_steps=2",
            "checkpoint.every_steps=0", "log.tensorboard=false", "log.progress=false"]
    cmd = [sys.executable, "-m", "areal_fast.cli", "train", str(ROOT / "examples" / "tiny_lookup_agent.yaml"),
           f"experiment.output_dir={tmp_path}", *tiny]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 2 and all(r["episode/calls"] >= 1.0 for r in train)
    assert [r["step"] for r in rows if "eval_reward" in r] == [0, 2]
