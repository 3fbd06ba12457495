"""The mismatch-correction ablation's plan (bench/bench_mismatch_ablation.py): each arm's overrides land
in the resolved config (serving dtype, correction, staleness bound, task), the run order, and the
per-step dashboard read from metrics.jsonl with the paired contrasts. Nothing here trains."""

import json
from pathlib import Path

import pytest

from areal_fast.config import load_config
from bench import bench_mismatch_ablation as bm

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml")
# (tis_cap, token_mis_lower, token_mis_upper, seq_mis_lower, seq_mis_upper, m2po_tau) per correction
EXPECTED = {"none": (None, None, None, None, None, None), "tis": (2.0, None, None, None, None, None),
            "icepop": (None, 0.5, 2.0, None, None, None), "seq_mis": (None, None, None, 0.5, 2.0, None),
            "m2po": (None, None, None, None, None, 0.04)}


def test_every_runs_overrides_resolve_to_its_arm():
    assert len(bm.build_runs(bm.DEFAULT_ARMS, bm.ETAS, (1,))) == 12  # 5 corrections in bf16 + the fp32 control
    runs = bm.build_runs(list(bm.ARMS), bm.ETAS, (1,))
    assert len(runs) == 24 and len({r.name for r in runs}) == 24  # and the 5 corrections under FP8 serving
    for run in runs:
        cfg = load_config(RECIPE, [*bm.run_overrides(run, 30, 10, ["rollout.max_staleness=9"], batch_size=4),
                                   f"experiment.output_dir=/tmp/unused/{run.name}"])
        fp8 = run.arm.arm.endswith("_fp8")
        assert cfg.rollout.server_args == (["--dtype", "bfloat16", "--quantization", "fp8"] if fp8 else
                                           ["--dtype", "float32" if run.arm.arm.endswith("_fp32") else "bfloat16"])
        assert cfg.weights.quantize == ("fp8" if fp8 else None) and cfg.weights.delta == ("off" if fp8 else "auto")
        assert cfg.rollout.max_staleness == run.arm.eta  # the user's word does not override the arm's key
        assert cfg.train.ppo.prox_mode == "recompute"
        loss = cfg.train.ppo.loss
        got = (loss.tis_cap, loss.token_mis_lower, loss.token_mis_upper, loss.seq_mis_lower, loss.seq_mis_upper,
               loss.m2po_tau)
        assert got == EXPECTED[run.arm.correction], run.name  # the recipe's token_mis_upper = 5 is gone
        assert cfg.rollout.max_new_tokens == 24 and cfg.data.synthetic.min_len == 6
        assert (cfg.experiment.total_steps, cfg.train.batch_size, cfg.experiment.seed) == (30, 4, 1)


def test_runs_are_seed_major_with_the_fp32_control_last_in_each_seed():
    runs = bm.build_runs(["none_fp32", "none_fp8", "none", "tis"], [0, 4], [1, 2])
    assert [r.name for r in runs[:8]] == ["eta0_none_s1", "eta4_none_s1", "eta0_tis_s1", "eta4_tis_s1",
                                          "eta0_none_fp8_s1", "eta4_none_fp8_s1",
                                          "eta0_none_fp32_s1", "eta4_none_fp32_s1"]
    assert {r.seed for r in runs[8:]} == {2}
    with pytest.raises(ValueError, match="'icepop2'"):
        bm.build_runs(["icepop2"], [0], [1])


def _result(arm: str, eta: int, seed: int, em: float, k3: float) -> dict:
    return {"arm": f"eta{eta}_{arm}", "objective": arm, "eta": eta, "advantage": "grpo", "seed": seed,
            "dtype": bm.ARMS[arm][1], "eval_first": 0.1, "eval_final": em, "eval_curve": [[0, 0.1], [10, em]],
            "steps_curves": {k: [[1, k3], [2, k3]] if k == "mismatch_k3" else [] for k in bm.STEP_KEYS}}


def test_step_curves_aggregate_and_paired_contrasts(tmp_path):
    rows = [{"kind": "train", "step": 1, "gen_len_mean": 9.0, "train/mismatch_k3": 1e-4, "train/mismatch_k1": 2e-4},
            {"kind": "eval", "step": 1, "eval_reward": 0.3},
            {"kind": "train", "step": 2, "gen_len_mean": 8.0, "train/mismatch_k3": 3e-4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = bm.step_curves(tmp_path / "metrics.jsonl")
    assert curves["mismatch_k3"] == [[1, 1e-4], [2, 3e-4]] and curves["mismatch_k1"] == [[1, 2e-4]]
    assert curves["gen_len_mean"] == [[1, 9.0], [2, 8.0]] and curves["m2po_masked_fraction"] == []

    results = [_result("none", 0, s, 0.5 + s / 100, 1e-4) for s in (1, 2, 3)]
    results += [_result("none_fp32", 0, s, 0.52 + s / 100, 1e-12) for s in (1, 2, 3)]
    agg = {r["arm"]: r for r in bm.aggregate(results)}
    assert agg["eta0_none"]["eval_final_mean"] == pytest.approx(0.52)
    assert agg["eta0_none_fp32"]["mismatch_k3_mean"] == pytest.approx(1e-12)
    cons = bm.contrasts(results)
    assert list(cons) == ["none_fp32_minus_none"]  # paired by seed: a constant +0.02, zero-width interval
    (row,) = cons["none_fp32_minus_none"]
    assert row["eval_final_diff_mean"] == pytest.approx(0.02) and row["eval_final_diff_ci95"] == pytest.approx(0.0)
    assert "none_fp32 minus none" in bm.markdown(bm.aggregate(results), cons)
    # FP8 serving: its corrections against FP8 without one, and FP8 against bf16
    results += [_result(a, 0, s, 0.4 + s / 100 + (0.05 if a == "tis_fp8" else 0), 1e-3)
                for a in ("none_fp8", "tis_fp8") for s in (1, 2, 3)]
    cons = bm.contrasts(results)
    assert {"tis_fp8_minus_none_fp8", "none_fp8_minus_none", "none_fp32_minus_none_fp8"} <= set(cons)
    assert cons["tis_fp8_minus_none_fp8"][0]["eval_final_diff_mean"] == pytest.approx(0.05)
    assert "tis_fp8 minus none_fp8" in bm.markdown(bm.aggregate(results), cons)
