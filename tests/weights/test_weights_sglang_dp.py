"""SGLang servers with ``dp_size > 1``: served with DP attention, refused without it, from SGLang's own code.

What SGLang does (0.5.6 and 0.5.23 read): its data-parallel controller, with DP attention
(``enable_dp_attention``, how MoE models are served), starts the workers of ONE TP group of
``tp_size`` ranks (tp_rank 0 .. tp_size-1; the ``dp_size`` attention replicas are slices of it) and
sends each control request to the group's leader, which passes it to every worker; without it,
``dp_size`` replicas each start tp_rank 0 .. tp-1 and each gets the request. Every worker joins the
weight group as ``rank_offset + self.tp_rank`` (``init_weights_update_group``).

- SGLang's own functions, compiled from the wheels' sources (no import of the serving stack: the
  function bodies run as written, with a recording ``init_custom_process_group``): the ranks the
  workers of a DP-attention server take are exactly ``rank_offset .. rank_offset + tp_size - 1``,
  every attention replica among them (``compute_dp_attention_world_info``); the replicas of plain
  DP take the same ranks twice;
- our side: a DP-attention server is joined as ``tp_size`` ranks and receives every update bitwise on
  every worker (in process, gloo); plain DP and the colocated transport with DP attention are
  refused by name before any rendezvous.
"""

from __future__ import annotations

import ast
import threading
import types

import pytest
import torch
from fakes import FakeServer, _broadcast, _join_gloo_group

from areal_fast.backends.sglang.weight_sync import DistributedWeightSync
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.group import ServerFacts

TIMEOUT_S = 30
# where each release keeps the worker's init_weights_update_group, and the dp-attention world info
SOURCES = {
    "0.5.6": {"init": ("sglang/srt/model_executor/model_runner.py", "ModelRunner"),
              "world": [("sglang/srt/layers/dp_attention.py", "compute_dp_attention_world_info")]},
    "0.5.23": {"init": ("sglang/srt/model_executor/model_runner_components/weight_updater.py", "WeightUpdater"),
               "world": [("sglang/srt/runtime_context.py", "derive_attn_tp_size"),
                         ("sglang/srt/runtime_context.py", "derive_attention_ranks"),
                         ("sglang/srt/layers/dp_attention.py", "compute_dp_attention_world_info")]},
}


def _function(root, rel: str, name: str, cls: str | None, namespace: dict):
    """SGLang's function ``name`` (a method of ``cls``) compiled from its source file into ``namespace``."""
    tree = ast.parse((root / rel).read_text())
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    exec(compile(ast.Module([node], []), str(root / rel), "exec"), namespace)  # noqa: S102 - SGLang's own code
    return namespace[name]


def _sglang_ranks(version: str, tp_size: int, dp_size: int, dp_attention: bool, rank_offset: int = 1):
    """The (group rank, attention dp rank) each worker of such a server joins with, by SGLang's code."""
    from sglang_wheel import install_dir_or_skip

    root = install_dir_or_skip(version)
    joined = []
    fake_torch = types.SimpleNamespace(distributed=types.SimpleNamespace(is_initialized=lambda: True))

    def init_custom_process_group(**kw):
        joined.append((kw["rank"], kw["world_size"]))
        return object()

    import logging

    ns = {"torch": fake_torch, "init_custom_process_group": init_custom_process_group,
          "logger": logging.getLogger("sglang-test"),
          "NetworkAddress": lambda h, p: types.SimpleNamespace(to_tcp=lambda: f"tcp://{h}:{p}")}
    rel, cls = SOURCES[version]["init"]
    init = _function(root, rel, "init_weights_update_group", cls, ns)
    world_ns: dict = {}
    for rel_w, name in SOURCES[version]["world"]:
        world = _function(root, rel_w, name, None, world_ns)
    out = []
    # the workers SGLang's controller starts: one TP group with DP attention, dp_size groups without
    groups = [range(tp_size)] if dp_attention else [range(tp_size // dp_size)] * dp_size
    for replica, tp_ranks in enumerate(groups):
        for tp_rank in tp_ranks:
            worker = types.SimpleNamespace(tp_rank=tp_rank, _model_update_group={})
            ok, msg = init(worker, "127.0.0.1", 1234, rank_offset, 1 + tp_size, "g", "gloo")
            assert ok, msg
            if dp_attention:
                info = (world(True, tp_rank, tp_size, dp_size) if version == "0.5.6"
                        else world(tp_rank, tp_size, dp_size))
                out.append((joined[-1][0], info[2]))
            else:
                out.append((joined[-1][0], replica))
    return out


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_sglangs_own_code_gives_dp_attention_workers_distinct_ranks(version):
    tp, dp = 4, 2
    got = _sglang_ranks(version, tp, dp, dp_attention=True)
    facts = ServerFacts(url="u", version=version, tp_size=tp, dp_size=dp, dp_attention=True)
    facts.check_layout()  # served
    assert sorted(r for r, _ in got) == list(range(1, 1 + facts.tp_size)), "our plan: tp_size ranks from the offset"
    assert {d for _, d in got} == set(range(dp)), "every attention replica is among them"
    # plain DP: the replicas take the same ranks, which is why it stays refused
    plain = _sglang_ranks(version, tp, dp, dp_attention=False)
    assert len({r for r, _ in plain}) < len(plain)
    with pytest.raises(WeightSyncError, match="dp_size=2 without DP attention.*share ranks"):
        ServerFacts(url="u", version=version, tp_size=tp // dp, dp_size=dp).check_layout()
    with pytest.raises(WeightSyncError, match="DP attention; this transport builds"):
        facts.check_layout(dp_attention_ok=False)


def test_facts_read_dp_attention_from_server_info():
    info = {"version": "0.5.23", "tp_size": 8, "dp_size": 8, "enable_dp_attention": True}
    f = ServerFacts.from_info("u", info)
    assert f.dp_attention and f.tp_size == 8
    assert not ServerFacts.from_info("u", {**info, "enable_dp_attention": "yes"}).dp_attention


class DPAttentionServer(FakeServer):
    """A fake SGLang server with DP attention: its tp workers (threads) each join as rank_offset +
    tp_rank and each receive every bucket, as SGLang's workers do."""

    def __init__(self, tp: int, dp: int, **kw):
        super().__init__(tp=tp, dp=dp, **kw)
        self.pgs = []
        self.per_worker: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def _answer(self, path, body):
        if path in ("/server_info", "/get_server_info"):
            code, ans = super()._answer(path, body)
            return code, {**ans, "enable_dp_attention": True}
        if path == "/init_weights_update_group":
            pgs = [None] * self.tp

            def join(r):
                pgs[r] = _join_gloo_group(body["master_address"], body["master_port"], body["world_size"],
                                          body["rank_offset"] + r, body["group_name"], 60)

            ts = [threading.Thread(target=join, args=(r,)) for r in range(self.tp)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            self.pgs = pgs
            return 200, {"success": True, "message": "ok"}
        return super()._answer(path, body)

    def _receive(self, body):
        metas = [(n, getattr(torch, d), torch.Size(s)) for n, d, s in zip(body["names"], body["dtypes"],
                                                                        body["shapes"])]
        total = sum(dt.itemsize * s.numel() for _n, dt, s in metas)
        bufs = [torch.empty(total, dtype=torch.uint8) for _ in range(self.tp)]
        ts = [threading.Thread(target=_broadcast, args=(self.pgs[r], bufs[r])) for r in range(self.tp)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        for r in range(self.tp):
            off = 0
            for n, dt, s in metas:
                nb = dt.itemsize * s.numel()
                self.per_worker[r][n] = bufs[r][off: off + nb].view(dt).view(s).clone()
                off += nb
        return dict(self.per_worker[0])


def test_a_dp_attention_server_gets_every_update_on_every_worker():
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(300, generator=g)}
    srv = DPAttentionServer(tp=2, dp=2)
    cfg = WeightSyncConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S, master_addr="127.0.0.1", collective="gloo")
    ws = DistributedWeightSync([srv.url], cfg)
    try:
        ws.update(state, 1)
        assert ws.world_size == 1 + 2, "the server's ranks are its tp_size workers"
        for r in range(2):
            assert all(torch.equal(srv.per_worker[r][n], t) for n, t in state.items()), f"worker {r}"
    finally:
        ws.close()
        srv.close()
