"""The staleness ablation's plan and bookkeeping (bench/bench_staleness.py): the arm list and that each
arm's overrides land in the resolved config, the per-run summary and per-arm aggregation on synthetic
metrics, and resume. Nothing here trains, and nothing asserts a reward or a time."""

import json
import statistics
from pathlib import Path

import pytest

from areal_fast.config import load_config
from bench import bench_staleness as bs
from bench import sweep as sw

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_reverse.yaml")


def test_the_full_sweep_is_108_runs_with_unique_names():
    runs = bs.build_runs(bs.build_arms(), bs.SEEDS)
    assert len(bs.build_arms()) == 6 * 3 * 2 == 36
    assert len(runs) == 108
    assert len({r.name for r in runs}) == 108
    assert runs[0].name == "eta0_recompute_grpo_s1"
    assert {r.seed for r in runs[:36]} == {1}  # seed-major: one complete table after the first 36
    assert {(r.arm.eta, r.arm.objective, r.arm.advantage) for r in runs} == {
        (e, o, a) for e in (0, 1, 2, 4, 8, 16) for o in ("recompute", "loglinear", "naive") for a in ("grpo", "rloo")}


def test_every_runs_overrides_resolve_to_its_arm():
    """Load each run's overrides with the project's config loader: the values the sweep varies are
    the ones the run will use, and the budget (steps x batch) is the same for every run."""
    runs = bs.build_runs(bs.build_arms(), bs.SEEDS)
    budgets = set()
    for run in runs:
        cfg = load_config(RECIPE, [*sw.run_overrides(run, 40, 10, [], batch_size=4),
                                   f"experiment.output_dir=/tmp/unused/{run.name}"])
        assert cfg.rollout.max_staleness == run.arm.eta
        assert cfg.train.ppo.prox_mode == bs.OBJECTIVES[run.arm.objective]
        assert cfg.train.ppo.adv_estimator == run.arm.advantage
        assert cfg.experiment.seed == cfg.train.seed == run.seed
        assert cfg.eval.every_steps == 10
        assert cfg.checkpoint.every_steps == 0 and cfg.experiment.resume is False
        budgets.add((cfg.experiment.total_steps, cfg.train.batch_size, cfg.rollout.group_size))
    assert budgets == {(40, 4, load_config(RECIPE).rollout.group_size)}


def test_the_three_objectives_are_the_three_proximal_modes():
    assert {k: bs.OBJECTIVES[k] for k in bs.DEFAULT_OBJECTIVES} == {
        "recompute": "recompute", "loglinear": "approx", "naive": "none"}
    # the option arms are the decoupled objective (recomputed proximal) plus one loss option each
    assert all(bs.OBJECTIVES[k] == "recompute" for k in bs.OBJECTIVE_LOSS)


def test_an_arm_cannot_override_what_the_sweep_varies():
    """User overrides come before the arm's keys: `rollout.max_staleness=0` on the command line does
    not turn every arm synchronous."""
    run = sw.Run(bs.Arm(8, "naive", "rloo"), 2)
    cfg = load_config(RECIPE, [*sw.run_overrides(run, 5, 5, ["rollout.max_staleness=0", "experiment.seed=9"]),
                               "experiment.output_dir=/tmp/unused"])
    assert cfg.rollout.max_staleness == 8 and cfg.experiment.seed == 2 and cfg.train.ppo.prox_mode == "none"


@pytest.mark.parametrize("kwargs, culprit", [(dict(objectives=["ppo"]), "--objectives"),
                                              (dict(advantages=["gae"]), "--advantages"),
                                              (dict(etas=[-1]), "--etas")])
def test_bad_arm_lists_name_the_flag(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        bs.build_arms(**kwargs)


def _metrics(staleness_per_step, evals, samples_per_s=100.0, behav_kl=-0.1):
    rows = [{"kind": "eval", "step": s, "eval_reward": v} for s, v in evals]
    for i, st in enumerate(staleness_per_step, 1):
        rows.append({"kind": "train", "step": i, "time": float(i), "reward": 0.5, "staleness": st,
                     "trained_samples_per_s": samples_per_s, "train/behav_kl": behav_kl, "train/clip_fraction": 0.0})
    return rows


def test_summarise_run_counts_groups_per_staleness():
    run = sw.Run(bs.Arm(2, "recompute", "grpo"), 1)
    rows = _metrics([[0, 0], [1, 1], [2, 1], [2, 3]], [(0, 0.3), (2, 0.6), (4, 0.5)])
    r = sw.summarise_run(run, rows, wall_s=12.0)
    assert r["staleness_hist"] == {"0": 2, "1": 3, "2": 2, "3": 1}
    assert r["staleness_mean"] == pytest.approx((0 * 2 + 1 * 3 + 2 * 2 + 3) / 8)
    assert r["staleness_max"] == 3
    assert r["eval_first"] == 0.3 and r["eval_final"] == 0.5
    assert r["eval_best"] == 0.6  # over the evaluations after training started
    assert r["steps"] == 4 and r["trained_samples"] == 8  # groups (the child multiplies by group_size)
    # bounds per step: min(2, k - 1) = 0, 1, 2, 2; at or above it: 2 + 2 + 1 + 2 of 8 groups
    assert r["staleness_at_bound_fraction"] == pytest.approx(7 / 8)
    assert r["behav_kl_mean"] == pytest.approx(-0.1) and r["clip_fraction_mean"] == 0.0


def test_best_excludes_the_warm_start_evaluation():
    run = sw.Run(bs.Arm(0, "naive", "rloo"), 3)
    r = sw.summarise_run(run, _metrics([[0]], [(0, 0.9), (1, 0.2)]), wall_s=1.0)
    assert r["eval_best"] == 0.2


def test_summarise_run_refuses_an_empty_run():
    with pytest.raises(ValueError, match="eta0_naive_grpo_s1"):
        sw.summarise_run(sw.Run(bs.Arm(0, "naive", "grpo"), 1), [{"kind": "eval", "step": 0, "eval_reward": 0.1}],
                         wall_s=1.0)


def _result(eta, obj, adv, seed, final, best, hist, curve, sps=50.0):
    run = sw.Run(bs.Arm(eta, obj, adv), seed)
    return {"run": run.name, "arm": run.arm.name, "eta": eta, "objective": obj, "advantage": adv, "seed": seed,
            "eval_first": 0.3, "eval_final": final, "eval_best": best, "eval_curve": curve,
            "trained_samples_per_s": sps, "staleness_hist": {str(k): v for k, v in hist.items()}, "wall_s": 10.0}


def test_aggregate_means_spreads_and_pools_histograms():
    res = [_result(4, "recompute", "grpo", 1, 0.5, 0.6, {3: 1, 4: 9}, [[0, 0.3], [10, 0.5]], sps=40.0),
           _result(4, "recompute", "grpo", 2, 0.7, 0.7, {4: 10}, [[0, 0.3], [10, 0.7]], sps=60.0),
           _result(4, "recompute", "grpo", 3, 0.6, 0.8, {2: 2, 4: 8}, [[0, 0.3], [10, 0.6], [20, 0.9]]),
           _result(0, "naive", "rloo", 1, 0.4, 0.4, {0: 10}, [[0, 0.3], [10, 0.4]])]
    rows = bs.aggregate(res)
    assert [r["arm"] for r in rows] == ["eta4_recompute_grpo", "eta0_naive_rloo"]
    a = rows[0]
    assert a["seeds"] == [1, 2, 3]
    assert a["eval_final_mean"] == pytest.approx(0.6)
    assert a["eval_final_spread"] == pytest.approx(statistics.stdev([0.5, 0.7, 0.6]))
    assert a["eval_best_mean"] == pytest.approx(0.7)
    assert a["trained_samples_per_s_mean"] == pytest.approx(50.0)
    assert a["staleness_hist"] == {"2": 2, "3": 1, "4": 27}
    assert a["staleness_mean"] == pytest.approx((2 * 2 + 3 + 4 * 27) / 30)
    assert a["staleness_max"] == 4
    assert a["staleness_at_eta_fraction"] == pytest.approx(27 / 30)
    assert a["eval_curve_mean"] == [[0, pytest.approx(0.3)], [10, pytest.approx(0.6)]]  # steps all seeds have
    assert a["eval_final_vs_sync_mean"] is None  # no eta = 0 run of recompute/grpo among these
    b = rows[1]
    assert b["eval_final_vs_sync_mean"] == 0.0  # the synchronous arm against itself
    assert b["eval_final_spread"] == 0.0 and b["staleness_mean"] == 0.0 and b["staleness_at_eta_fraction"] == 1.0
    paired = bs.aggregate(res + [_result(0, "recompute", "grpo", s, f, f, {0: 10}, [[0, 0.3]])
                                 for s, f in ((1, 0.6), (2, 0.6), (3, 0.9))])
    # finals 0.5, 0.7, 0.6 against sync 0.6, 0.6, 0.9 of the same seeds: -0.1, +0.1, -0.3
    assert paired[0]["eval_final_vs_sync_mean"] == pytest.approx(-0.1)
    assert paired[0]["eval_final_vs_sync_spread"] == pytest.approx(statistics.stdev([-0.1, 0.1, -0.3]))
    table = bs.markdown_table(rows)
    assert table.count("\n") == 4  # header, rule, two arms
    assert "0.600 ± 0.100" in table and "4:90%" in table
    assert table.splitlines()[0].count("|") == table.splitlines()[2].count("|")  # every row has every column


def test_work_dir_refuses_a_changed_sweep_and_a_silent_rerun(tmp_path):
    key = sw.sweep_key(RECIPE, 40, 10, [])
    sw.open_work_dir(tmp_path / "w", key, resume=False)
    with pytest.raises(SystemExit, match="--resume"):
        sw.open_work_dir(tmp_path / "w", key, resume=False)
    with pytest.raises(SystemExit, match="steps"):
        sw.open_work_dir(tmp_path / "w", sw.sweep_key(RECIPE, 41, 10, []), resume=True)
    sw.open_work_dir(tmp_path / "w", key, resume=True)  # the same settings: fine
    with pytest.raises(SystemExit, match="no sweep"):
        sw.open_work_dir(tmp_path / "other", key, resume=True)


def test_resume_skips_finished_runs(tmp_path, monkeypatch):
    """A sweep interrupted after some runs: --resume runs only the others, and the report covers all."""
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--etas", "0,4", "--objectives", "naive", "--advantages", "grpo", "--seeds", "1,2", "--steps", "3",
            "--eval-every", "1", "--servers", "per-run", "--out", str(out)]
    executed, crashed = [], set()

    def fake_execute(run, config, overrides, work_dir, api_key=None, timeout_s=None):
        executed.append(run.name)
        if run.name == "eta4_naive_grpo_s1" and run.name not in crashed:
            crashed.add(run.name)
            return False  # this one crashes the first time: no result file
        rows = _metrics([[min(run.arm.eta, k) for _ in range(2)] for k in range(3)], [(0, 0.3), (3, 0.4)])
        sw.write_json_atomic(sw.result_path(work_dir, run), sw.summarise_run(run, rows, 1.0))
        return True

    monkeypatch.setattr(sw, "execute", fake_execute)
    monkeypatch.setattr(sw, "build_warm_starts", lambda config, overrides, work, seeds: {s: tmp_path for s in seeds})
    monkeypatch.setattr(sw, "_preload", lambda: None)
    with pytest.raises(SystemExit):  # one run failed: the sweep says so with a non-zero exit
        bs.main([*argv, "--work", str(work)])
    assert executed == ["eta0_naive_grpo_s1", "eta4_naive_grpo_s1", "eta0_naive_grpo_s2", "eta4_naive_grpo_s2"]
    assert [r.name for r in sw.pending(bs.build_runs(bs.build_arms([0, 4], ["naive"], ["grpo"]), [1, 2]), work)] \
        == ["eta4_naive_grpo_s1"]
    executed.clear()
    bs.main([*argv, "--resume", str(work)])
    assert executed == ["eta4_naive_grpo_s1"]
    reports = sorted(out.glob("staleness_*.json"))
    assert reports
    rep = json.loads(reports[-1].read_text())
    assert rep["runs_done"] == rep["runs_planned"] == 4
    assert {a["arm"] for a in rep["arms"]} == {"eta0_naive_grpo", "eta4_naive_grpo"}
    assert (out / "staleness.jsonl").is_file()


def test_dry_run_lists_every_run_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sw, "execute", lambda *a, **k: pytest.fail("a dry run executed a run"))
    bs.main(["--dry-run", "--work", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert "108 cases" in out and "eta16_naive_rloo_s3" in out and "train.ppo.prox_mode=approx" in out
    assert not (tmp_path / "w").exists()


def test_execute_counts_a_run_without_result_as_failed(tmp_path, monkeypatch):
    """The child is a real forked process: a run that ends without writing its result failed, one that
    wrote it succeeded, and one that crashed does not take the sweep down."""
    run = sw.Run(bs.Arm(1, "recompute", "grpo"), 1)

    def writes(run, config, overrides, work, api_key):
        sw.write_json_atomic(sw.result_path(work, run), {"run": run.name})

    def crashes(run, config, overrides, work, api_key):
        raise RuntimeError("boom")

    monkeypatch.setattr(sw, "_child", lambda *a: None)
    assert sw.execute(run, RECIPE, [], tmp_path) is False
    monkeypatch.setattr(sw, "_child", crashes)
    assert sw.execute(run, RECIPE, [], tmp_path) is False
    monkeypatch.setattr(sw, "_child", writes)
    assert sw.execute(run, RECIPE, [], tmp_path) is True
    assert json.loads(sw.result_path(tmp_path, run).read_text()) == {"run": run.name}


@pytest.mark.slow
def test_a_reset_shared_server_is_back_to_the_warm_start(tmp_path):
    """The sweep reuses one engine per seed: after a run moved its weights, version and pause state,
    reset() must give the next run the warm-start weights at version 0, generating."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def tiny(path, seed):
        torch.manual_seed(seed)
        m = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                         max_position_embeddings=128, eos_token_id=1, bos_token_id=0,
                                         pad_token_id=0))
        with torch.no_grad():  # peaked outputs, so that two models' greedy answers differ
            for p in m.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.3)
        m.save_pretrained(str(path))
        return path

    warm, other = tiny(tmp_path / "warm", 1), tiny(tmp_path / "other", 2)
    servers = sw.SharedServers(RECIPE, [], tmp_path / "work", 1, warm)
    try:
        url = servers.urls[0]

        def greedy():
            r = servers._post(url, "/generate", {"input_ids": [5, 6, 7, 8],
                                                 "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
            return r["output_ids"]

        before = greedy()
        assert servers._post(url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "7"})[
            "success"]
        assert greedy() != before  # the other weights answer differently (else the test shows nothing)
        servers._post(url, "/pause_generation", {"mode": "abort"})
        servers.reset()
        import urllib.request

        req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {servers.api_key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            info = json.loads(r.read())
        assert info["weight_version"] == "0" and info["model_path"] == str(warm.resolve())
        assert greedy() == before  # generating again, with the warm-start weights
    finally:
        servers.close()


def test_the_hard_preset_dry_run_lists_the_whole_hard_sweep(tmp_path, capsys, monkeypatch):
    """--preset hard: 6 etas x 6 objectives x 5 seeds (GRPO) with 4 minibatches, the weak warm start
    and the low learning rate; each option arm's overrides load into the loss option it names; nothing runs."""
    monkeypatch.setattr(sw, "execute", lambda *a, **k: pytest.fail("a dry run executed a run"))
    bs.main(["--preset", "hard", "--dry-run", "--work", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert "180 cases" in out and "eta16_m2po_grpo_s5" in out and "train.ppo.ppo_n_minibatches=4" in out
    assert not (tmp_path / "w").exists()
    args = bs.parse_args(["--preset", "hard"])
    runs = bs.build_plan_runs(args.plan, args.advantages, args.seeds)
    assert len(runs) == len(set(runs)) == 180
    seen = {}
    for run in runs[60:84]:  # the options at eta 16, then 8 (the first 60 are naive vs decoupled)
        cfg = load_config(RECIPE, [*sw.run_overrides(run, args.steps, args.eval_every, args.overrides, args.batch_size),
                                   "experiment.output_dir=/tmp/unused"])
        assert cfg.train.ppo.ppo_n_minibatches == 4 and cfg.experiment.total_steps == 200
        assert cfg.train.batch_size == 8 and cfg.train.optim.lr == 5e-5 and cfg.model.warm_start.steps == 120
        seen[run.arm.objective] = cfg.train.ppo.loss
    assert seen["tis"].tis_cap == 2.0 and seen["tis"].token_mis_upper is None
    assert (seen["icepop"].token_mis_lower, seen["icepop"].token_mis_upper) == (0.5, 5.0)
    assert (seen["seq_mis"].seq_mis_lower, seen["seq_mis"].seq_mis_upper) == (0.5, 2.0)
    assert seen["m2po"].m2po_tau == 0.04 and "naive" not in seen


def test_the_hard_plan_runs_the_naive_decoupled_contrast_first_seed_major():
    """Most information first: naive and decoupled at eta 0/4/16 for every seed (seed-major, so a sweep
    stopped part-way has whole seeds to pair), then eta 1/2/8, then the options at the largest etas."""
    args = bs.parse_args(["--preset", "hard"])
    runs = bs.build_plan_runs(args.plan, args.advantages, args.seeds)
    assert [r.name for r in runs[:6]] == [f"eta{e}_{o}_grpo_s1" for o in ("naive", "recompute") for e in (0, 4, 16)]
    assert runs[6].name == "eta0_naive_grpo_s2"
    assert {(r.arm.objective, r.arm.eta) for r in runs[:30]} == {(o, e) for o in ("naive", "recompute")
                                                                  for e in (0, 4, 16)}
    assert {r.arm.eta for r in runs[30:60]} == {1, 2, 8}
    assert {(r.arm.objective, r.arm.eta) for r in runs[60:80]} == {(o, 16) for o in bs.HARD_OPTIONS}
    # a run two phases name runs once, at its first place
    plan = [(["naive"], [0, 4]), (["naive", "recompute"], [4])]
    assert [r.name for r in bs.build_plan_runs(plan, ["grpo"], [1])] == [
        "eta0_naive_grpo_s1", "eta4_naive_grpo_s1", "eta4_recompute_grpo_s1"]


def test_overrides_may_come_before_the_flags():
    args = bs.parse_args(["train.optim.lr=1e-5", "--steps", "3", "rollout.max_new_tokens=8", "--work", "/tmp/w"])
    assert args.overrides == ["train.optim.lr=1e-5", "rollout.max_new_tokens=8"] and args.steps == 3


def test_option_arms_pair_with_the_decoupled_sync_run_until_their_own_runs():
    """An option arm without its own eta = 0 runs is paired with the decoupled objective's eta = 0 run of
    the same seed, and the table says so; once its own eta = 0 run exists, that one is used."""
    res = [_result(0, "recompute", "grpo", s, f, f, {0: 10}, [[0, 0.2], [10, f]]) for s, f in ((1, 0.5), (2, 0.6))]
    res += [_result(16, "m2po", "grpo", s, f, f, {16: 10}, [[0, 0.2], [10, f]]) for s, f in ((1, 0.4), (2, 0.7))]
    res += [_result(16, "naive", "grpo", 1, 0.3, 0.3, {16: 10}, [[0, 0.2], [10, 0.3]])]  # naive: no fallback
    rows = {r["arm"]: r for r in bs.aggregate(res)}
    m2po = rows["eta16_m2po_grpo"]
    assert m2po["sync_objective"] == "recompute" and m2po["sync_seeds"] == [1, 2]
    assert m2po["eval_final_vs_sync_mean"] == pytest.approx(0.0)  # -0.1 and +0.1
    assert "(vs recompute eta 0)" in bs.markdown_table([m2po])
    assert rows["eta16_naive_grpo"]["eval_final_vs_sync_mean"] is None
    own = bs.aggregate(res + [_result(0, "m2po", "grpo", 1, 0.1, 0.1, {0: 10}, [[0, 0.2], [10, 0.1]])])
    m2po = next(r for r in own if r["arm"] == "eta16_m2po_grpo")
    # seed 1 against its own eta 0 (0.4 - 0.1); seed 2, without one, is left out rather than mixed in
    assert m2po["sync_objective"] == "m2po" and m2po["sync_seeds"] == [1]
    assert m2po["eval_final_vs_sync_mean"] == pytest.approx(0.3)


def test_mean_em_over_the_run_and_the_paired_contrast():
    """The area under the curve leaves out the warm start's evaluation; decoupled minus naive is paired
    by seed, per eta, with a t interval."""
    r = _result(4, "recompute", "grpo", 1, 0.6, 0.6, {4: 1}, [[0, 0.9], [10, 0.2], [20, 0.6]])
    assert sw.eval_mean(r) == pytest.approx(0.4)
    res = [_result(4, o, "grpo", s, f, f, {4: 1}, [[0, 0.2], [10, f]])
           for o, s, f in (("recompute", 1, 0.5), ("recompute", 2, 0.7), ("recompute", 3, 0.6),
                           ("naive", 1, 0.4), ("naive", 2, 0.5), ("naive", 3, 0.6))]
    res.append(_result(0, "naive", "grpo", 1, 0.3, 0.3, {0: 1}, [[0, 0.2], [10, 0.3]]))  # no decoupled twin
    (row,) = sw.contrast(res)
    assert row["eta"] == 4 and row["seeds"] == [1, 2, 3]
    assert row["eval_final_diff_mean"] == pytest.approx(0.1)  # +0.1, +0.2, 0.0
    assert row["eval_final_diff_ci95"] == pytest.approx(sw.ci95_halfwidth([0.1, 0.2, 0.0]))
    assert row["eval_mean_diff_mean"] == pytest.approx(0.1)
    table = bs.contrast_table([row])
    assert table.count("\n") == 3 and "+0.100 ± 0.100" in table



def test_the_pooled_contrast_averages_each_seed_over_the_stale_etas_first():
    """One number per contrast: each seed's differences averaged over eta > 0, then the interval over
    seeds; eta 0 stays out of it, and a seed missing one of those etas is left out, not half counted."""
    diffs = {(4, 1): 0.1, (4, 2): 0.3, (4, 3): 0.0, (16, 1): 0.3, (16, 2): 0.1}  # seed 3 has no eta 16
    res = [_result(0, o, "grpo", s, 0.5, 0.5, {0: 1}, [[0, 0.2], [10, 0.5]])
           for o in ("recompute", "naive") for s in (1, 2, 3)]
    res[0]["eval_final"] = 0.9  # an eta-0 difference that must not enter the pooled row
    for (eta, s), d in diffs.items():
        res += [_result(eta, "recompute", "grpo", s, 0.4 + d, 0.4 + d, {eta: 1}, [[0, 0.2], [10, 0.4 + d]]),
                _result(eta, "naive", "grpo", s, 0.4, 0.4, {eta: 1}, [[0, 0.2], [10, 0.4]])]
    rows = sw.contrast(res)
    assert [r["eta"] for r in rows] == [0, 4, 16, "pooled"]
    pooled = rows[-1]
    assert pooled["etas"] == [4, 16] and pooled["seeds"] == [1, 2]
    assert pooled["eval_final_diff_mean"] == pytest.approx(0.2)  # seed 1: (0.1+0.3)/2, seed 2: (0.3+0.1)/2
    assert pooled["eval_final_diff_ci95"] == pytest.approx(0.0)
    assert pooled["eval_mean_diff_mean"] == pytest.approx(0.2)
    assert "| mean over 4/16 | grpo | 2 |" in bs.contrast_table(rows)
    # one stale eta: nothing to pool
    assert [r["eta"] for r in sw.contrast([r for r in res if r["eta"] != 16])] == [0, 4]

def test_the_plot_takes_six_objectives(tmp_path):
    pytest.importorskip("matplotlib")
    res = [_result(e, o, "grpo", 1, 0.5, 0.5, {e: 1}, [[0, 0.2], [10, 0.5]])
           for o in ("naive", "recompute", *bs.HARD_OPTIONS) for e in (0, 16)]
    assert bs.plot(bs.aggregate(res), tmp_path / "p.png").is_file()
    # no eta 0 run yet (a sweep stopped early): nothing to pair, the curves are still drawn
    stale_only = bs.aggregate([r for r in res if r["eta"] == 16])
    assert all(r["eval_mean_vs_sync_mean"] is None for r in stale_only)
    assert bs.plot(stale_only, tmp_path / "q.png").is_file()


def test_paired_confidence_interval():
    assert sw.ci95_halfwidth([0.1]) is None
    # differences 0.1, 0.2, 0.3: sd 0.1, t(2) = 4.303
    assert sw.ci95_halfwidth([0.1, 0.2, 0.3]) == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
