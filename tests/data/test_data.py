"""Datasets: the task a reward receives keeps every field of the row, gzip'd JSONL, source names,
and the warm-start cache keyed on everything the built model depends on."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from areal_fast.config import load_config
from areal_fast.data.datasets import build_prompts, check_source, load_split, read_rows, task_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml"

ADD_TASK = {"prompt": "Write add(a, b).", "reward": "code", "fn_name": "add", "time_limit_s": 2.0,
            "memory_mb": 256, "partial": True,
            "tests": [{"args": [1, 2], "kwargs": {}, "expected": 3}, {"args": [2, 2], "kwargs": {}, "expected": 5}]}


def _data_cfg(path: Path, *extra: str):
    return load_config(None, [f"data.train={path}", "model.path=x", "model.warm_start.enabled=false", *extra]).data


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(text) if path.name.endswith(".gz") else text)
    return path


def test_a_function_call_code_task_keeps_every_field_the_reward_reads(tmp_path):
    f = _write_jsonl(tmp_path / "code.jsonl", [ADD_TASK])
    (row,) = load_split(_data_cfg(f), "train", seed=0)
    assert row.text == ADD_TASK["prompt"]
    assert row.task == {k: v for k, v in ADD_TASK.items() if k != "prompt"}


def test_a_function_call_task_from_a_file_is_scored_by_the_code_reward(tmp_path):
    from areal_fast.reward.code import code_reward

    f = _write_jsonl(tmp_path / "code.jsonl", [ADD_TASK])
    (row,) = load_split(_data_cfg(f), "train", seed=0)
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    # the second test expects 5 for 2 + 2: with 'partial' kept the score is the fraction passed
    assert code_reward(row.task, right).value == pytest.approx(0.5)
    assert code_reward(row.task, "```python\ndef add(a, b):\n    return 0\n```").value == 0.0


def test_configured_answer_and_tests_fields_are_renamed_and_win(tmp_path):
    cfg = _data_cfg(tmp_path / "d.jsonl", "data.prompt_key=q", "data.answer_key=solution", "data.tests_key=cases")
    row = {"q": "1+1", "answer": "stray", "solution": "2", "cases": [1], "level": 3}
    assert task_of(row, cfg) == {"answer": "2", "tests": [1], "level": 3}
    assert task_of(dict(reversed(list(row.items()))), cfg) == {"answer": "2", "tests": [1], "level": 3}


def test_gzipped_jsonl_is_read_through_gzip(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(3)]
    f = _write_jsonl(tmp_path / "d.jsonl.gz", rows)
    assert read_rows(str(f), _data_cfg(f), "train", 0) == rows
    assert [r.task["answer"] for r in load_split(_data_cfg(f), "train", 0)] == ["0", "1", "2"]


def test_rows_that_are_not_mappings_are_refused_naming_the_row(tmp_path):
    cfg = _data_cfg(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="my.jsonl row 1: a row must be a mapping"):
        build_prompts([{"prompt": "a", "answer": "b"}, [1, 2]], cfg, source="my.jsonl")
    with pytest.raises(ValueError, match="row 0: field 'prompt' .* must be text"):
        build_prompts([{"prompt": ["a"], "answer": "b"}], cfg, source="my.jsonl")


@pytest.mark.parametrize("source, ok", [
    ("synthetic:reverse", True), ("synthetic:sort", False), ("hf:gsm8k:main", True), ("hf:", False),
    ("a/b.jsonl", True), ("a/b.jsonl.gz", True), ("b.parquet", True), ("b.json", False), ("b.csv", False), ("", False),
])
def test_source_names(source, ok):
    if ok:
        check_source(source)
    else:
        with pytest.raises(ValueError):
            check_source(source)


# ----------------------------------------------------------------------------- warm-start cache

TINY_MODEL = ["model.warm_start.steps=1", "model.warm_start.batch_size=2", "model.warm_start.hidden_size=8",
              "model.warm_start.intermediate_size=16", "model.warm_start.num_hidden_layers=1",
              "model.warm_start.num_attention_heads=2", "model.warm_start.num_key_value_heads=1",
              "data.synthetic.max_len=6"]


def test_changing_max_new_tokens_builds_a_new_warm_start(tmp_path):
    from areal_fast.data.warm_start import SIGNATURE_FILE, ensure_warm_start

    def build(*extra):
        cfg = load_config(EXAMPLE, [f"experiment.output_dir={tmp_path}", *TINY_MODEL, *extra])
        path = ensure_warm_start(cfg.warm_start_recipe())
        sig = json.loads((path / SIGNATURE_FILE).read_text())
        return sig, json.loads((path / "config.json").read_text())

    first, model = build("rollout.max_new_tokens=32")
    again, _ = build("rollout.max_new_tokens=32")
    assert again == first  # same settings: the cached model is used as it is (same build record)
    longer, model_longer = build("rollout.max_new_tokens=300")
    assert longer["sig"]["max_new_tokens"] == 300 and longer != first
    assert model["max_position_embeddings"] == 128 and model_longer["max_position_embeddings"] == 2 * (6 + 300)
    other_seed, _ = build("rollout.max_new_tokens=300", "experiment.seed=2")
    assert other_seed["sig"]["seed"] == 2 and other_seed != longer
