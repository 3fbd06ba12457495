"""The warm start's options: the decayed learning rate and the imperfect demonstrations
(``model.warm_start.lr_schedule``, ``mistake_fraction``, ``mistake_min_len``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tolerances import FP64_FEW_OPS_RTOL

from areal_fast.config import ConfigError, load_config
from areal_fast.data import tiny_task, warm_start
from areal_fast.data.tokenizer import CharTokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml"
TINY_MODEL = ["model.warm_start.batch_size=4", "model.warm_start.hidden_size=8",
              "model.warm_start.intermediate_size=16", "model.warm_start.num_hidden_layers=1",
              "model.warm_start.num_attention_heads=2", "model.warm_start.num_key_value_heads=1",
              "data.synthetic.max_len=6"]


@pytest.mark.parametrize("override, needle", [
    ("model.warm_start.lr_schedule=cosine", "model.warm_start.lr_schedule"),
    ("model.warm_start.mistake_fraction=1.0", "model.warm_start.mistake_fraction"),
    ("model.warm_start.mistake_fraction=-0.1", "model.warm_start.mistake_fraction"),
    ("model.warm_start.mistake_fraction=nan", "model.warm_start.mistake_fraction"),
    ("model.warm_start.mistake_min_len=0", "model.warm_start.mistake_min_len"),
])
def test_bad_warm_start_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, [override])
    assert needle in str(e.value)


def _demonstrations(n: int, *overrides: str) -> list[dict]:
    cfg = load_config(EXAMPLE, list(overrides))
    rng = random.Random(0)
    return [warm_start.demonstration(rng, cfg.warm_start_recipe()) for _ in range(n)]


def test_mistakes_drop_the_last_character_of_long_enough_strings_at_the_configured_rate():
    n, frac, min_len = 4000, 0.3, 4
    rows = _demonstrations(n, f"model.warm_start.mistake_fraction={frac}",
                           f"model.warm_start.mistake_min_len={min_len}")
    eligible = mistaken = 0
    for r in rows:
        s = r["prompt"][:-1]
        if r["answer"] != s[::-1]:
            assert r["answer"] == s[::-1][:-1], r  # the only mistake there is: the last character dropped
            assert len(s) >= min_len, r  # shorter strings are always right
            mistaken += 1
        eligible += len(s) >= min_len
    # binomial: the observed rate is within 4 standard deviations of the configured one
    tol = 4 * (frac * (1 - frac) / eligible) ** 0.5
    assert abs(mistaken / eligible - frac) < tol, (mistaken, eligible)


def test_clean_demonstrations_are_the_tasks_rows():
    rows = _demonstrations(500, "model.warm_start.mistake_fraction=0")
    assert all(r["answer"] == r["prompt"][:-1][::-1] for r in rows)


def test_linear_schedule_decays_the_warm_start_learning_rate_to_zero(monkeypatch):
    import torch

    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    steps = 4
    linear = [1e-3 * (1 - k / steps) for k in range(steps)]
    for schedule, expected in (("constant", [1e-3] * steps), ("linear", linear)):
        seen.clear()
        cfg = load_config(EXAMPLE, [*TINY_MODEL, f"model.warm_start.steps={steps}", "model.warm_start.lr=1e-3",
                                    f"model.warm_start.lr_schedule={schedule}"])
        tok = CharTokenizer(tiny_task.vocabulary(cfg.data.synthetic))
        recipe = cfg.warm_start_recipe()
        losses = warm_start.supervised_warm_start(warm_start.build_tiny_model(recipe, tok), recipe, tok)
        assert len(losses) == steps
        assert seen == pytest.approx(expected, rel=FP64_FEW_OPS_RTOL), schedule


def test_mistake_settings_are_part_of_the_warm_start_cache_key():
    base = warm_start.signature(load_config(EXAMPLE, []).warm_start_recipe())
    other = warm_start.signature(load_config(EXAMPLE, ["model.warm_start.mistake_fraction=0.25"]).warm_start_recipe())
    assert base != other and other["warm_start"]["mistake_fraction"] == 0.25
