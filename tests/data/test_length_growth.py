"""The synthetic task whose strings lengthen over the run (``data.synthetic.growth``): the centre of the
length distribution moves linearly along the training order, the held-out rows spread evenly over the
whole range, the warm start's demonstrations cover it, nothing changes without it, and bad settings are
refused at load naming the key."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from areal_fast.config import ConfigError, load_config
from areal_fast.data import tiny_task
from areal_fast.data.datasets import PromptStream, load_split
from areal_fast.data.tiny_task import LengthGrowthConfig, SyntheticTaskConfig

GROW = ["data.shuffle=false", "data.synthetic.n_train=3000", "data.synthetic.growth.rows=2000",
        "data.synthetic.growth.end_log_mean=2.5", "data.synthetic.max_len=24", "data.synthetic.n_eval=400"]


def _cfg(**growth) -> SyntheticTaskConfig:
    return SyntheticTaskConfig(log_mean=0.5, log_std=0.6, max_len=24, n_train=3000, n_eval=400,
                               growth=LengthGrowthConfig(**growth))


def _lengths(rows) -> list[int]:
    return [len(r["answer"]) for r in rows]


def test_the_centre_moves_linearly_from_log_mean_to_the_end_and_stays_there():
    cfg = _cfg(rows=2000, end_log_mean=2.5)
    assert [tiny_task.centre(cfg, p) for p in (-1.0, 0.0, 0.25, 1.0, 3.0)] == [0.5, 0.5, 1.0, 2.5, 2.5]
    assert [tiny_task.progress_of(cfg, "train", i) for i in (0, 500, 2000, 2999)] == [0.0, 0.25, 1.0, 1.0]
    assert tiny_task.progress_of(cfg, "eval", 0) == 0.0 and tiny_task.progress_of(cfg, "eval", 399) == 1.0
    assert tiny_task.median_length(cfg, 0.0) == 2 + math.exp(0.5)
    assert tiny_task.median_length(cfg, 1.0) == 2 + math.exp(2.5)
    off = _cfg(rows=0, end_log_mean=2.5)  # off: the end changes nothing
    assert tiny_task.centre(off, 1.0) == 0.5 and tiny_task.progress_of(off, "train", 2999) == 0.0


def test_training_rows_lengthen_along_the_training_order_and_the_median_follows_the_schedule():
    cfg = _cfg(rows=2000, end_log_mean=2.5)
    n = _lengths(tiny_task.generate(cfg, "train", seed=1))
    for lo, hi in ((0, 200), (900, 1100), (2000, 3000)):  # progress ~0.05, 0.5, 1
        want = tiny_task.median_length(cfg, (lo + hi) / 2 / 2000)
        assert abs(statistics.median(n[lo:hi]) - want) <= 1.5, (lo, hi, statistics.median(n[lo:hi]), want)
    assert statistics.mean(n[:200]) < 5 < 12 < statistics.mean(n[2000:])
    # the run reads them in that order: no shuffle, the stream's position is the row
    rows = load_split(load_config(None, GROW).data, "train", seed=1)
    stream = PromptStream(rows, seed=1, shuffle=False)
    assert [stream.at(p).index for p in (0, 1, 1999, 3000)] == [0, 1, 1999, 0]


def test_held_out_rows_cover_the_whole_range_evenly():
    cfg = _cfg(rows=2000, end_log_mean=2.5)
    ev = _lengths(tiny_task.generate(cfg, "eval", seed=1))
    q = len(ev) // 4
    quarters = [statistics.median(ev[i * q:(i + 1) * q]) for i in range(4)]
    assert quarters == sorted(quarters) and quarters[0] < 6 and quarters[-1] > 10, quarters
    train = _lengths(tiny_task.generate(cfg, "train", seed=1)[:2000])  # the growing part, read in order
    assert abs(statistics.mean(ev) - statistics.mean(train)) < 1.0  # the same range, weighed alike


def test_warm_start_demonstrations_are_drawn_over_the_whole_range():
    cfg = _cfg(rows=2000, end_log_mean=2.5)
    rng = random.Random(0)
    n = _lengths([tiny_task.make_row(rng, cfg) for _ in range(2000)])
    assert statistics.median(n) > tiny_task.median_length(cfg, 0.2) and max(n) == 24 and min(n) == 2


def test_without_growth_the_rows_and_the_warm_start_key_are_as_before():
    from areal_fast.data import warm_start

    base = SyntheticTaskConfig(log_mean=0.5, n_train=300, n_eval=50)
    other_end = SyntheticTaskConfig(log_mean=0.5, n_train=300, n_eval=50, growth=LengthGrowthConfig(end_log_mean=2.0))
    rng = random.Random(3)  # the rows before the option: one length draw, then the characters
    old = []
    for _ in range(300):
        k = min(2 + int(math.exp(rng.gauss(0.5, 0.75))), 24)
        s = "".join(rng.choice(base.alphabet) for _ in range(k))
        old.append({"prompt": s + "=", "answer": s[::-1]})
    assert tiny_task.generate(base, "train", 3) == tiny_task.generate(other_end, "train", 3)
    r = random.Random(3)
    assert [tiny_task.make_row(r, base) for _ in range(300)] == old
    recipe = load_config(None, []).warm_start_recipe()
    grown = load_config(None, GROW).warm_start_recipe()
    assert "growth" not in warm_start.signature(recipe)["task"]
    assert warm_start.signature(grown)["task"]["growth"] == {"rows": 2000, "end_log_mean": 2.5}


@pytest.mark.parametrize("override, needle", [
    ([], "data.shuffle: must be false"),
    (["data.shuffle=false", "data.synthetic.growth.rows=5000"], "data.synthetic.growth.rows: must be at most n_train"),
    (["data.shuffle=false", "data.synthetic.growth.end_log_mean=4"], "data.synthetic.growth.end_log_mean: the median"),
    (["data.shuffle=false", "data.synthetic.growth.end_log_mean=inf"], "data.synthetic.growth.end_log_mean"),
    (["data.shuffle=false", "data.synthetic.growth.end_log_mean=1000"],  # exp overflows: still the key
     "data.synthetic.growth.end_log_mean: the median"),
    (["data.shuffle=false", "data.synthetic.growth.rows=-1"], "data.synthetic.growth.rows: must be >= 0"),
    (["data.shuffle=false", "data.train=rows.jsonl"], "data.synthetic.growth.rows: lengths grow only on a synthetic"),
])
def test_bad_growth_settings_are_refused_at_load_naming_the_key(override, needle):
    base = ["data.synthetic.n_train=3000", "data.synthetic.growth.rows=2000", "data.synthetic.max_len=24"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, *override, "model.path=x", "model.warm_start.enabled=false"])
    assert str(e.value).startswith(needle), str(e.value)
