"""Weight sync over real processes: 2 FSDP2 gloo trainer ranks -> receivers (aiohttp + one
process per TP rank, tests/weights/_weights_receiver.py) over real HTTP and a real gloo group.

One run covers: flattened buckets (several calls), per-tensor broadcasts, disk, tp 1/2/4 with
kv_heads (2) < tp (4), an old server (0.5.20, no begin/end), group reuse, the version, and a
server that rejects a tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
from packaging.version import Version

from areal_fast.netutil import find_free_port
from areal_fast.weights.layout import ModelSpec, hf_to_sglang

HERE = os.path.dirname(os.path.abspath(__file__))
START_TIMEOUT_S = 60
RUN_TIMEOUT_S = 150


def _spec() -> ModelSpec:
    import transformers

    sys.path.insert(0, HERE)
    from _weights_trainer import tiny_qwen2  # noqa: F401 (same config as the trainer)

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=251, tie_word_embeddings=True)
    return ModelSpec.from_hf_config(cfg)


def _spec_json(spec: ModelSpec) -> str:
    return json.dumps({f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "_shapes"})


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the receiver and its TP workers (own session)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _spawn_receiver(tp: int, spec_json: str, dump: str, version: str, fail_tensor: str | None = None):
    cmd = [sys.executable, os.path.join(HERE, "_weights_receiver.py"), "--tp", str(tp), "--spec", spec_json,
           "--dump", dump, "--version", version]
    if fail_tensor:
        cmd += ["--fail-tensor", fail_tensor]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)


def _wait_port(proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 1.0)
        if r:
            line = proc.stdout.readline()
            if line.startswith("PORT "):
                return f"http://127.0.0.1:{int(line.split()[1])}"
        if proc.poll() is not None:
            break
    raise RuntimeError(f"receiver {proc.args} did not start")


pytestmark = pytest.mark.slow  # 2 trainer processes and 4 receivers with 8 TP workers


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    spec = _spec()
    sj = _spec_json(spec)
    root = tmp_path_factory.mktemp("wsync")
    servers = []  # (proc, url, tp, version, dump)
    procs = []
    try:
        layout = [(1, "0.5.20", None), (2, "0.5.23", None), (4, "0.5.23", None),
                  (1, "0.5.23", "model.layers.1.mlp.up_proj.weight")]
        for i, (tp, ver, fail) in enumerate(layout):  # start all, then wait: they boot in parallel
            dump = root / f"server{i}"
            dump.mkdir()
            procs.append(_spawn_receiver(tp, sj, str(dump), ver, fail))
        for (tp, ver, _), proc, i in zip(layout, procs, range(len(layout))):
            servers.append((_wait_port(proc), tp, ver, str(root / f"server{i}")))
        out = root / "trainer"
        out.mkdir()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), WORLD_SIZE="2",
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.join(HERE, "_weights_trainer.py"), "--out", str(out), "--urls",
               *[s[0] for s in servers[:3]], "--fail-url", servers[3][0]]
        trainers = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True)
                    for r in range(2)]
        procs.extend(trainers)
        for t in trainers:
            assert t.wait(RUN_TIMEOUT_S) == 0, "a trainer rank failed (see its stderr above)"
        yield spec, servers, out
    finally:
        for p in procs:
            _kill(p)


def _load(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_received_tensors_bitwise(sync_run, version):
    spec, servers, out = sync_run
    expected = _load(out / f"expected_v{version}.pt")
    assert set(expected) == set(spec.hf_shapes()) and "lm_head.weight" not in expected  # tied: not sent
    for url, tp, _ver, dump in servers[:3]:
        want_shards = hf_to_sglang(expected, spec, tp)
        for r in range(tp):
            got = _load(os.path.join(dump, f"v{version}_rank{r}.pt"))
            assert set(got["full"]) == set(expected), url
            for n, t in expected.items():
                g = got["full"][n]
                assert g.dtype == torch.bfloat16 and g.shape == t.shape, (url, n)
                assert torch.equal(g.view(torch.int16), t.view(torch.int16)), f"{url} rank {r}: {n} differs"
            assert set(got["shard"]) == set(want_shards[r])
            for n, t in want_shards[r].items():
                assert torch.equal(got["shard"][n].view(torch.int16), t.view(torch.int16)), f"tp{tp} r{r}: {n}"


def test_protocol_record(sync_run):
    import urllib.request

    spec, servers, out = sync_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version_after_v2"] == "2" and summary["disk_version"] == "3"
    assert summary["n_inits"] == 1 and summary["disk_dir_removed"]
    for url, _tp, ver, _ in servers[:3]:
        st = json.loads(urllib.request.urlopen(url + "/debug/state", timeout=10).read())
        assert st["init_count"] == 2  # one group per trainer rank (weights.senders: rank), made once, reused
        assert st["weight_version"] == "3"
        calls = st["calls"]
        v1 = [c for c in calls if c.get("weight_version") == "1"]
        v2 = [c for c in calls if c.get("weight_version") == "2"]
        assert len(v1) > 1 and all(c["load_format"] == "flattened_bucket" for c in v1)  # 24 KiB buckets
        assert all(c["load_format"] is None for c in v2)
        assert sum(c["n"] for c in v1) == sum(c["n"] for c in v2) == len(spec.hf_shapes())
        assert [c.get("disk") is not None for c in calls if c.get("weight_version") == "3"] == [True]
        begin_end = 2 if Version(ver) >= Version("0.5.21") else 0  # v1, v2 distributed; the v3 disk load has none
        assert st["begin"] == st["end"] == begin_end


def test_failure_names_server_and_tensor(sync_run):
    _spec_, servers, out = sync_run
    summary = json.loads((out / "summary.json").read_text())
    err = summary["fail_error"]
    assert err is not None and servers[3][0] in err and "model.layers.1.mlp.up_proj.weight" in err
    assert summary["fail_version"] is None


def test_next_sync_after_a_refused_bucket_succeeds(sync_run):
    """0.5.21+ sessions: the failed update still ended its session, so the next one can begin."""
    import urllib.request

    _spec_, servers, out = sync_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["retry_error"] is None and summary["retry_version"] == "5"
    assert summary["retry_n_inits"] == 1  # the same group: the refusing server had taken the bucket
    st = json.loads(urllib.request.urlopen(servers[3][0] + "/debug/state", timeout=10).read())
    assert st["begin"] == st["end"] == 2 and not st["session_open"]
    assert st["refused"] == 1 and st["weight_version"] == "5"
