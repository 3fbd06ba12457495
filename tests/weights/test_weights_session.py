"""Weight-update protocol rules, fast and in one process: SGLang-like fake servers over real HTTP
(tests/fakes.py) and a real gloo weight group whose server ranks run in threads.

Covers: sessions from 0.5.21 (ended on every failure, begin refused by one server, disk not
wrapped), a refused bucket followed by a good sync, the disk load_format, server facts read
before use (a server down at first), dp/pp layouts refused by name, the rendezvous under
torchrun's agent-store variable, the store bound to the requested address, and the API key.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from areal_fast.backends.sglang.weight_sync import DiskWeightSync, DistributedWeightSync
from areal_fast.weights.config import API_KEY_ENV, WeightSyncConfig
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.group import HostedStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakes import FakeServer  # noqa: E402

TIMEOUT_S = 30  # every wait in these tests; a regression fails after this instead of hanging


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(**kw) -> FakeServer:
        made.append(FakeServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {  # several buckets at 1 KiB, mixed sizes, one tensor larger than a bucket
        "model.embed_tokens.weight": torch.randn(40, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def _cfg(**kw) -> WeightSyncConfig:
    base = dict(bucket_bytes=1 << 10, dtype="bfloat16", collective="gloo", timeout_s=TIMEOUT_S)
    base.update(kw)
    return WeightSyncConfig(**base)


def _assert_received(server: FakeServer, state: dict[str, torch.Tensor]) -> None:
    assert set(server.received) == set(state)
    for n, t in state.items():
        got = server.received[n]
        assert got.dtype == torch.bfloat16 and got.shape == t.shape, n
        assert torch.equal(got.view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), n


# ----------------------------------------------------------------------------- sessions


def test_begin_refused_by_one_server_ends_the_others(servers):
    ok, refusing, old = servers(), servers(refuse_begin=True), servers(version="0.5.20")
    ws = DiskWeightSync([ok.url, refusing.url, old.url], _cfg())
    ws.read_facts()
    with pytest.raises(WeightSyncError, match=refusing.url.split("//")[1]):
        with ws.session():
            raise AssertionError("the body must not run when a begin failed")
    assert ok.paths().count("/begin_weight_update") == ok.paths().count("/end_weight_update") == 1
    assert not ok.session_open
    assert "/end_weight_update" not in refusing.paths()  # it never began
    assert not any(p.endswith("_weight_update") for p in old.paths())  # 0.5.20 has no sessions
    ws.close()


def test_failed_body_still_ends_every_session(servers):
    a, b = servers(), servers()
    ws = DiskWeightSync([a.url, b.url], _cfg())
    ws.read_facts()
    with pytest.raises(RuntimeError, match="boom"):
        with ws.session():
            raise RuntimeError("boom")
    for s in (a, b):
        assert s.paths()[-2:] == ["/begin_weight_update", "/end_weight_update"] and not s.session_open
    with ws.session() as begun:  # and the next session can begin
        assert begun == [a.url, b.url]
    ws.close()


def test_disk_update_sends_real_load_format_and_no_session(servers, tmp_path):
    new, old = servers(), servers(version="0.5.6")
    ws = DiskWeightSync([new.url, old.url], _cfg(save_root=str(tmp_path)))
    ws.update(_state(), 3)
    for s in (new, old):
        bodies = [b for p, b, _ in s.calls if p == "/update_weights_from_disk"]
        assert len(bodies) == 1
        assert bodies[0]["load_format"] == "auto" and bodies[0]["weight_version"] == "3"
        assert not any(p.endswith("_weight_update") for p in s.paths())  # no begin/end around a disk load
    assert ws.version == "3" and not os.path.exists(ws.last_path)
    ws.close()


def test_disk_load_format_is_validated():
    with pytest.raises(ValueError, match="disk_load_format"):
        WeightSyncConfig(disk_load_format=None)
    with pytest.raises(ValueError, match="disk_load_format"):
        WeightSyncConfig(disk_load_format="dummy")


# ----------------------------------------------------------------------------- distributed


def test_refused_bucket_then_next_sync_succeeds(servers, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # as under torchrun
    state = _state()
    strict = servers(refuse_bucket_with="model.layers.0.mlp.up_proj.weight")
    old = servers(version="0.5.20")
    ws = DistributedWeightSync([strict.url, old.url], _cfg())
    try:
        with pytest.raises(WeightSyncError, match="model.layers.0.mlp.up_proj.weight"):
            ws.update(state, 1)
        assert ws.version is None
        assert not strict.session_open  # ended although a bucket failed
        assert strict.paths().count("/begin_weight_update") == strict.paths().count("/end_weight_update") == 1
        state2 = _state(seed=1)
        ws.update(state2, 2)  # the same group: the refusing server had taken the bucket
        assert ws.version == "2" and ws.n_inits == 1
        for s in (strict, old):
            _assert_received(s, state2)
            assert s.weight_version == "2"
        assert strict.paths().count("/begin_weight_update") == strict.paths().count("/end_weight_update") == 2
        assert not any(p.endswith("_weight_update") for p in old.paths())
        buckets = [b for p, b, _ in strict.calls if p == "/update_weights_from_distributed"]
        assert len(buckets) > 2 and all(b["load_format"] == "flattened_bucket" for b in buckets)
        second = [b for b in buckets if b["weight_version"] == "2"]
        assert [b["flush_cache"] for b in second] == [False] * (len(second) - 1) + [True]  # once, at the end
        assert strict.paths().count("/server_info") == 2  # facts read before each update, once
    finally:
        ws.close()


def test_rendezvous_completes_under_torchrun_agent_store(servers, monkeypatch):
    """torchrun sets TORCHELASTIC_USE_AGENT_STORE=True in every trainer rank; torch's tcp://
    rendezvous then makes only client stores, so the weight group's store must be hosted by
    trainer rank 0 explicitly or the rendezvous never completes."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    s = servers()
    ws = DistributedWeightSync([s.url], _cfg(load_format=None))
    try:
        ws.connect()
        assert ws.pg is not None and ws.world_size == 2 and s.pg is not None
        ws.update(_state(), 7)  # per-tensor broadcasts over the group that was made
        _assert_received(s, _state())
    finally:
        ws.close()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp{,6}) that listen on ``port``."""
    out = []
    for fn in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(fn) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                addr, p = cols[1].rsplit(":", 1)
                if cols[3] == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    out.append(addr)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_store_listens_on_the_requested_address_only():
    store = HostedStore("127.0.0.1", 0, world_size=1, timeout_s=TIMEOUT_S)
    try:
        assert _listening(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
    finally:
        store.close()


def test_server_down_at_first_is_asked_again(servers):
    s = servers(down=True, tp=1)
    ws = DistributedWeightSync([s.url], _cfg())
    with pytest.raises(WeightSyncError, match=f"cannot read the facts of server {s.url}"):
        ws.read_facts()
    s.down, s.tp = False, 2  # it came up, with the layout it really has
    assert ws.read_facts()[s.url].tp_size == 2
    ws.close()


@pytest.mark.parametrize("layout,match", [({"dp": 2}, "dp_size=2"), ({"pp": 2}, "pp_size=2")])
def test_unsupported_layout_is_refused_naming_the_server(servers, layout, match):
    good, bad = servers(), servers(**layout)
    ws = DistributedWeightSync([good.url, bad.url], _cfg())
    with pytest.raises(WeightSyncError, match=match) as e:
        ws.update(_state(), 1)
    assert bad.url in str(e.value)
    assert "/init_weights_update_group" not in good.paths() + bad.paths()  # refused before any rendezvous
    ws.close()


# ----------------------------------------------------------------------------- API key


def test_api_key_is_sent_on_every_call(servers, monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, "k3y")
    s = servers(api_key="k3y")
    ws = DiskWeightSync([s.url], _cfg(save_root=str(tmp_path)))
    ws.update(_state(), 1)
    assert s.calls and all(auth == "Bearer k3y" for _p, _b, auth in s.calls)
    ws.close()


def test_wrong_api_key_is_a_clear_error(servers):
    s = servers(api_key="right")
    ws = DiskWeightSync([s.url], _cfg(api_key="wrong"))
    with pytest.raises(WeightSyncError, match="HTTP 401.*API key"):
        ws.update(_state(), 1)
    ws.close()


# ----------------------------------------------------------------------------- backend choice


def test_cpu_tensors_use_gloo_even_with_a_visible_gpu(servers, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU is "visible"...
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    s = servers()
    ws = DistributedWeightSync([s.url], _cfg(collective=None))  # ...but the tensors are on the CPU
    try:
        ws.update(_state(), 1)
        assert ws.backend == "gloo"
        assert [b["backend"] for p, b, _ in s.calls if p == "/init_weights_update_group"] == ["gloo"]
        _assert_received(s, _state())
    finally:
        ws.close()


def test_backend_choice_from_tensors_and_gpus(monkeypatch, caplog):
    from areal_fast.weights.group import ServerFacts, choose_backend

    cuda0 = torch.device("cuda", 0)
    local = ServerFacts(url="http://127.0.0.1:30000", version="0.5.23")
    remote = ServerFacts(url="http://10.1.2.3:30000", version="0.5.23")
    with pytest.raises(WeightSyncError, match="NCCL only moves CUDA tensors"):
        choose_backend("nccl", torch.device("cpu"), [local])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with caplog.at_level("WARNING"):
        assert choose_backend(None, cuda0, [local]) == "gloo"  # one GPU, shared with a local server
    assert "share GPU" in caplog.text and "ColocatedWeightSync" in caplog.text
    with pytest.raises(WeightSyncError, match="share GPU"):
        choose_backend("nccl", cuda0, [local])
    assert choose_backend(None, cuda0, [remote]) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    elsewhere = ServerFacts(url=local.url, version="0.5.23", gpu_ids=(1,))
    same = ServerFacts(url=local.url, version="0.5.23", gpu_ids=(0,))
    assert choose_backend(None, cuda0, [elsewhere]) == "nccl"
    assert choose_backend(None, cuda0, [same]) == "gloo"
