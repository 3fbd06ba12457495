"""The benchmark harness (bench/common.py) and the loss benchmark's bytes and memory models."""

import json

import pytest
import torch

from bench import bench_ppo_loss, common


def test_time_fn_on_cpu_counts_calls_and_orders_percentiles():
    calls = []
    t = common.time_fn(lambda: calls.append(1), warmup=2, reps=7, cuda=False)
    assert len(calls) == 9 and t.reps == 7
    assert 0 <= t.p10_ms <= t.median_ms <= t.p90_ms
    assert t.peak_mem_bytes is None and "median_ms" in t.as_row()
    with pytest.raises(ValueError, match="reps"):
        common.time_fn(lambda: None, reps=0, cuda=False)


def test_percentile_interpolates():
    assert common._percentile([3.0, 1.0, 2.0, 4.0, 5.0], 0.5) == 3.0
    assert common._percentile([0.0, 10.0], 0.1) == pytest.approx(1.0)
    assert common._percentile([7.0], 0.9) == 7.0


def test_append_rows_writes_jsonl_with_provenance(tmp_path):
    prov = common.provenance()
    assert {"date", "commit", "device", "python", "torch"} <= set(prov)
    path = common.append_rows("demo", [{"a": 1}, {"a": 2}], tmp_path, prov)
    common.append_rows("demo", [{"a": 3}], tmp_path, prov)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["a"] for r in rows] == [1, 2, 3]
    assert all(r["bench"] == "demo" and r["provenance"]["commit"] == prov["commit"] for r in rows)
    with pytest.raises(ValueError, match="bad benchmark name"):
        common.append_rows("../x", [{}], tmp_path, prov)


def test_results_from_a_dirty_tree_are_refused_unless_allowed(tmp_path, monkeypatch):
    """Rows into the repository need a committed tree: refused at once when the options are parsed
    (before the run) and again when written; ``--allow-dirty`` (or its variable) lets them through
    stamped ``-dirty``; results outside the repository, a dry run and --no-results are never refused."""
    import argparse

    monkeypatch.setenv(common.ALLOW_DIRTY_ENV, "0")  # recorded: restored (unset) after the action sets it
    monkeypatch.setattr(common, "git_commit", lambda: "abc1234-dirty")
    inside = common.RESULTS_DIR
    with pytest.raises(SystemExit, match="--allow-dirty"):
        common.refuse_dirty(inside)
    with pytest.raises(SystemExit, match="uncommitted"):
        common.append_rows("demo", [{"a": 1}], inside, {"commit": "abc1234-dirty"})
    common.refuse_dirty(tmp_path)  # outside the repository
    common.refuse_dirty(inside, "abc1234")  # clean
    ap = common.add_harness_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit, match="uncommitted"):
        ap.parse_args([])
    assert ap.parse_args(["--dry-run"]).dry_run and ap.parse_args(["--no-results"]).no_results
    assert ap.parse_args(["--results", str(tmp_path)]).results == str(tmp_path)
    assert ap.parse_args(["--allow-dirty"]).allow_dirty
    assert common.os.environ[common.ALLOW_DIRTY_ENV] == "1"  # the bench's own subprocesses inherit it
    common.refuse_dirty(inside)
    path = common.append_rows("demo", [{"a": 1}], tmp_path, {"commit": "abc1234-dirty"})
    assert json.loads(path.read_text())["provenance"]["commit"] == "abc1234-dirty"


def test_device_peaks():
    assert common.device_peaks("NVIDIA H100 80GB HBM3")["hbm_gbs"] == 3350.0
    assert common.device_peaks("cpu") == {"hbm_gbs": None, "bf16_tflops": None}


def test_loss_bytes_model_counts_three_passes_over_the_logits():
    # forward read + backward read + gradient write; a copy is read + write
    assert bench_ppo_loss.LOGIT_PASSES_FWD_BWD == 3 and bench_ppo_loss.LOGIT_PASSES_COPY == 2


def test_eager_reference_estimate_and_skip(monkeypatch):
    T, V = 32768, 151936
    need = bench_ppo_loss.logits_extra_bytes(T, V)
    assert need["eager"] >= 5 * 4 * T * V, "the eager reference holds about five fp32 [T, V] tensors"
    assert need["ours"] < need["compiled"] < need["eager"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 12 * 2**30)  # 10 GiB cached, unused
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * 2**30)
    assert bench_ppo_loss.fits(int(0.89 * 80 * 2**30))[0] and not bench_ppo_loss.fits(int(0.91 * 80 * 2**30))[0]
    ok, why = bench_ppo_loss.fits(need["eager"])
    assert not ok and "GiB" in why and "skipped" in why
    assert bench_ppo_loss.fits(need["ours"]) == (True, "")
    calls = []
    t, why = bench_ppo_loss.guarded(lambda: calls.append(1), need["eager"], warmup=1, reps=2)
    assert t is None and not calls, "a case that cannot fit must not run at all"


def test_vllm_pause_bench_dry_run_and_table(capsys):
    """bench/bench_vllm_pause.py: its dry run starts nothing, its table has a row per mode."""
    from bench import bench_vllm_pause as b

    assert b.main(["--dry-run", "--modes", "abort,keep"]) == 0
    assert "['abort', 'keep']" in capsys.readouterr().out
    rows = [{"mode": m, "tokens_per_s": 1.0, "update_s_median": 0.1, "recomputed_tokens_per_update": 2.0,
             "preemptions_per_update": 0.0, "segments_per_sample": 1.0, "updates": 3, "samples": 4} for m in b.MODES]
    assert [line.split("|")[1].strip() for line in b.table(rows).splitlines()[2:]] == list(b.MODES)
    with pytest.raises(SystemExit):
        b.main(["--dry-run", "--modes", "retract"])
