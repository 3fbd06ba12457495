"""The re-anchored weight-sync model (``tools/sync_model.py``, docs/weight_sync.md): its fit reproduces the
published numbers it was fitted to, the model's parts behave as its docstring says (a many-sender path
never slower than one sender, bounded by a server node's lanes, a delta cheaper than a whole update at
the measured changed share), and a measured per-sender rate replaces the fitted one in the predictions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import bench_sync_senders as p  # noqa: E402
from tools import sync_model as m  # noqa: E402


def test_the_fit_reproduces_its_inputs_and_logs_every_published_number():
    c = m.fit()
    rows = m.checks(c)
    assert len(rows) == len(m.PUBLISHED)
    fits = [r for r in rows if r["part"] == "fit"]
    assert len(fits) == 4 and all(abs(r["ratio"] - 1) < 1e-9 for r in fits)
    assert all(r["ratio"] > 0 for r in rows)


def test_many_senders_are_bounded_by_a_server_nodes_lanes_and_deltas_pay():
    c = m.fit()
    rows = m.predictions(c)
    by = {(r["model"], r["path"]): r for r in rows}
    for model in m.TRAINER_GPUS:
        one, many = by[(model, "one sender (today)")], by[(model, "many senders")]
        assert many["sync_s_whole"] <= one["sync_s_whole"] and many["lanes"] == min(many["senders"], m.LANES_PER_NODE)
        wire_one = one["sync_s_whole"] - c["fixed_s_many"]
        wire_many = many["sync_s_whole"] - c["fixed_s_many"]
        assert abs(wire_one / wire_many - many["lanes"]) < 1e-9, "the wire time divides by the lanes, no more"
        assert one["sync_s_delta"] < one["sync_s_whole"]
    measured = m.predictions({**c, "sender_bytes_per_s": 2 * c["sender_bytes_per_s"]})
    assert measured[0]["sync_s_whole"] < rows[0]["sync_s_whole"]


# --------------------------------------- the GPU day's pieces (bench_sync_senders.py --parts gpu)
def test_the_pieces_codec_rate_is_in_the_models_units_and_bitwise_on_cpu():
    """The bench charges the bytes the model's codec_s charges (one sender, no PCIe), so its measured rate
    replaces the model's HBM rate as it stands; the host's C++ codec is bitwise with the reference there."""
    n = 1 << 20
    f = m.CHANGED * n
    assert abs(m.codec_bytes(n, f) - m.codec_s(n, 1, shadow_over_pcie=False) * m.HBM_BYTES_PER_S) < 1e-3
    (r,) = p.codec_rows("gpu_codec", [("native", "cpu", 1 << 16, (0.05,))])
    assert r["bitwise_equal"] and 0 < r["changed"] <= int(0.05 * (1 << 16)) and r["codec_bytes_per_s"] > 0
    assert "delta_pays" not in r, "no wire given: no wire fields"


def test_the_pieces_skip_without_cuda_and_sync_model_reads_their_rates(tmp_path, monkeypatch, capsys):
    if not torch.cuda.is_available():
        assert [r["skipped"] for r in p.bench_gpu()] == ["no CUDA device"] * 2
    with pytest.raises(SystemExit):  # the interpreter (breakeven) and the GPU part cannot share a process
        p.main(["--parts", "breakeven,gpu", "--no-results"])
    row = {"part": "gpu_codec", "backend": "triton", "bitwise_equal": True, "density": 0.0236,
           "codec_bytes_per_s": 1e12}
    inputs = m.pieces_inputs([row, {**row, "density": 0.25, "codec_bytes_per_s": 9e12},
                              {**row, "backend": "reference", "codec_bytes_per_s": 5e12},
                              {"part": "gpu_nccl", "sender_bytes_per_s_local_bound": 2e11}])
    assert inputs["codec_bytes_per_s"] == 1e12, "Triton's, at the share nearest the model's"
    assert inputs["sender_bytes_per_s_local_bound"] == 2e11
    jsonl = tmp_path / "sync_senders.jsonl"
    jsonl.write_text(json.dumps(row) + "\n" + json.dumps(inputs) + "\n")
    day = tmp_path / "gpu_day.json"
    day.write_text(json.dumps({"steps": [{"step": "sync_pieces", "key": {"rows": {"sync_senders": [row, inputs]}}}]}))
    assert m.read_pieces(jsonl) == m.read_pieces(day) == inputs
    bad = tmp_path / "none.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="none.jsonl"):
        m.read_pieces(bad)
    monkeypatch.setattr(m, "HBM_BYTES_PER_S", m.HBM_BYTES_PER_S)  # main() sets the module's rate: restored
    m.main(["--no-results"])
    base = capsys.readouterr().out
    m.main(["--no-results", "--pieces", str(day), "--pieces-sender-bound"])
    assert m.HBM_BYTES_PER_S == 1e12
    assert capsys.readouterr().out != base, "the measured rates change the predictions"
    with pytest.raises(SystemExit):
        m.main(["--no-results", "--pieces-sender-bound"])
