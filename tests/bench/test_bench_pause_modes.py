"""The pause-mode sweep (bench/bench_pause_modes_cpu.py) on the shared sweep harness: each arm's
overrides load into its pause mode at eta 4, a dry run lists every mode and seed and runs nothing, and
the summary has one row per mode. Nothing here trains."""

from pathlib import Path

import pytest

from areal_fast.config import load_config
from bench import bench_pause_modes_cpu as bp
from bench import sweep

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml")


def test_each_arm_loads_into_its_pause_mode():
    for mode in bp.MODES:
        run = sweep.Run(bp.Arm(mode), 2)
        cfg = load_config(RECIPE, [*sweep.run_overrides(run, 5, 5, ["rollout.pause_mode=abort"]),
                                   "experiment.output_dir=/tmp/unused"])
        assert (cfg.rollout.pause_mode, cfg.rollout.max_staleness, cfg.train.ppo.prox_mode) == (mode, 4, "recompute")
        assert cfg.experiment.seed == 2


def test_dry_run_lists_every_mode_and_seed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "execute", lambda *a, **k: pytest.fail("a dry run executed a run"))
    bp.main(["--dry-run", "--seeds", "1,2", "--work", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert "6 cases" in out and "pause_in_place_s2" in out and "rollout.pause_mode=retract" in out
    assert not (tmp_path / "w").exists()
    with pytest.raises(SystemExit):
        bp.main(["--dry-run", "--modes", "keep"])


def test_the_summary_has_one_row_per_mode():
    def result(mode, seed, em):
        return {"pause_mode": mode, "seed": seed, "steps": 40, "eval_first": 0.2, "eval_final": em,
                "eval_curve": [[0, 0.2], [20, em]], "staleness_mean": 3.7, "behav_kl_mean": -0.03,
                "clip_fraction_mean": 0.0, "trained_samples_per_s": 50.0, "wall_s": 10.0}

    extra, md, rows = bp.summary([result("abort", 1, 0.8), result("abort", 2, 0.6), result("retract", 1, 0.9)], "x")
    assert [r["pause_mode"] for r in rows] == ["abort", "retract"] and extra == {"modes": rows}
    assert rows[0]["em_final_mean"] == pytest.approx(0.7) and rows[0]["em_final_per_seed"] == [0.8, 0.6]
    assert "| `abort` | 0.700 ± 0.141 |" in md and md.count("\n| `") == 2
