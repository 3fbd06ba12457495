"""Configuration: YAML + dotted overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_fast.config import AppConfig, ConfigError, from_dict, load_config, parse_override, to_dict

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_reverse.yaml"


def test_example_loads_and_overrides_apply():
    cfg = load_config(EXAMPLE, ["train.optim.lr=2e-4", "rollout.max_staleness=0", "experiment.name=x"])
    assert cfg.train.optim.lr == pytest.approx(2e-4)
    assert cfg.rollout.max_staleness == 0
    assert cfg.experiment.out == Path("runs/x")
    assert cfg.model.warm_start.enabled


def test_round_trip_through_dict():
    cfg = load_config(EXAMPLE)
    again = from_dict(AppConfig, to_dict(cfg))
    assert to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize("override, needle", [
    ("train.optim.lrr=1", "unknown key 'train.optim.lrr'"),
    ("nope.x=1", "unknown key 'nope'"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.batch_size=1.5", "train.batch_size: expected an integer"),
    ("train.optim.lr=fast", "train.optim.lr: expected a number"),
    ("train.optim.lr=-1", "optim.lr"),
    ("rollout.engine=vllm", "rollout.engine"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.max_staleness=-1", "rollout.max_staleness"),
    ("rollout.temperature=0.7", "rollout.temperature"),
    ("train.ppo.adv_estimator=ppo", "ppo.adv_estimator"),
    ("weights.method=nccl", "weights.method"),
    ("log.progress=maybe", "log.progress: expected true/false"),
    ("train=3", "train: expected a mapping"),
    ("rollout.max_staleness.x=1", "'rollout.max_staleness' is not a section"),
])
def test_bad_keys_and_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, [override])
    assert needle in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("train.lr")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=null") == (["a"], None)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_model_path_required_without_warm_start():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, ["model.warm_start.enabled=false"])


def test_relative_paths_resolve_against_the_yaml_dir(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "m").mkdir()
    y = tmp_path / "c.yaml"
    y.write_text("model: {path: m}\ndata: {train: data.jsonl}\n")
    cfg = load_config(y)
    assert cfg.model.path == str(tmp_path / "m") and cfg.data.train == str(tmp_path / "data.jsonl")
