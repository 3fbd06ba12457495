"""Many senders (``weights.senders``): the plan, the shard-local delta encoder against the rank-0 one (one
process), and, in one torchrun launch (``_senders_worker.py``, 4 gloo ranks, cases for 2 and 4; two
servers: an SGLang-like receiver with 2 TP worker processes and one on the embedded engine's receive
code), the bytes each trainer rank moves and every server's tensors after every update, through a leave
and a join."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from areal_fast.weights import senders as senders_mod
from areal_fast.weights.delta import DeltaEncoder
from areal_fast.weights.delta_wire import split_entries
from areal_fast.weights.gather import Bucket, Sources
from areal_fast.weights.plan import shard_rows
from areal_fast.weights.senders import (
    ShardShadow,
    assign_owners,
    assign_owners_ref,
    decide,
    delta_entries,
    local_piece,
    pack_buckets,
    plan_wire,
    plan_wire_ref,
    sender_ranks,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sender_ranks_and_owners():
    assert sender_ranks("rank", 4) == [0, 1, 2, 3] and sender_ranks("one", 4) == [0]
    assert sender_ranks("node", 8, local_world=4) == [0, 4] and sender_ranks("rank", 1) == [0]
    with pytest.raises(ValueError, match="weights.senders"):
        sender_ranks("all", 4)
    sizes = [100, 7, 50, 50, 30, 20, 3]
    owner = assign_owners(sizes, [0, 1, 2])
    load = [sum(s for s, o in zip(sizes, owner) if o == k) for k in range(3)]
    assert max(load) <= sum(sizes) / 3 + max(sizes) and sorted(set(owner)) == [0, 1, 2]


def test_owners_heap_equals_the_linear_rule():
    g = np.random.default_rng(0)
    for senders in ([0], [0, 1], [0, 4, 8], list(range(7))):
        sizes = g.integers(0, 50, size=200).tolist() + [0, 0, 49, 49]
        assert assign_owners(sizes, senders) == assign_owners_ref(sizes, senders)


MOE_SHAPES = {"embed": (13, 8), "experts.gate_up_proj": (5, 4, 6), "experts.down_proj": (5, 6, 2),
              "norm": (6,), "scalar": (), "empty": (0, 3), "dense": (9, 4)}


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_the_planner_plan_equals_the_direct_plan(backend, n, monkeypatch):
    """plan_wire asks the reshard planner (C++ core or its twin) which bytes each rank holds of each wire
    tensor; plan_wire_ref computes them directly: the same wire tensors, owners and pieces, for sharded
    and full sources, fused experts, scalars and empty tensors, and for runs that cross rows."""
    from areal_fast import dispatch

    if backend == "native" and dispatch.why_unavailable("native", None):
        pytest.skip(f"native core: {dispatch.why_unavailable('native', None)}")
    names, shapes = list(MOE_SHAPES), list(MOE_SHAPES.values())
    dtypes = [torch.bfloat16] * len(names)
    for shards in (n, 1):
        src = Sources(names, shapes, [None] * len(names), shards)
        for senders in (list(range(n)), [0]):
            got = plan_wire(src, dtypes, n, senders, backend=backend)
            assert got == plan_wire_ref(src, dtypes, n, senders)
            for w in got:  # every element of every wire tensor held once
                assert sum(w.piece_elems(r) for r in range(n)) == w.numel
    # a wire tensor that starts and ends inside rows of its source (head, whole rows, tail)
    cut = [(0, "x", (12,), 3, 12), (0, "y", (2,), 16, 2), (1, "z", (6,), 0, 6)]
    monkeypatch.setattr(senders_mod, "_cut", lambda src: cut)
    src = Sources(["a", "b"], [(5, 4), (3, 2)], [None, None], n)
    got = plan_wire(src, [torch.bfloat16] * 2, n, list(range(n)), backend=backend)
    assert got == plan_wire_ref(src, [torch.bfloat16] * 2, n, list(range(n)))
    assert [sum(w.piece_elems(r) for r in range(n)) for w in got] == [12, 2, 6]


def test_release_gate():
    """Several groups by name from 0.5.6 (the releases read); a server that names no release, or an older
    one, gets the one-sender path; a source build (not a release number) is taken as new."""
    from areal_fast.backends.sglang.weight_sync import takes_many_senders

    assert takes_many_senders("0.5.6") and takes_many_senders("0.5.23") and takes_many_senders("main-abc")
    assert not takes_many_senders("0.5.5") and not takes_many_senders("") and not takes_many_senders(None)


def test_buckets_widest_first_and_pairs_kept():
    src = Sources(["a", "b"], [(4, 3), (5,)], [torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(5)], 1)
    wires = plan_wire(src, [torch.bfloat16, torch.float32], 1, [0])
    counts = np.array([[2, 0]])
    units = delta_entries(wires, decide(wires, counts, 0.25), counts)[0]
    (b,) = pack_buckets(units, 1 << 20)
    assert [e.part for e in b.entries] == ["idx", "whole", "val"]  # 4-byte entries in order, then bf16 values
    assert b.offsets == [0, 8, 28] and b.nbytes == 32


def _sharded(full: dict[str, torch.Tensor], n: int) -> list[Sources]:
    out = []
    for r in range(n):
        local = []
        for t in full.values():
            lo, hi = shard_rows(t.shape[0], n, r)
            local.append(t[lo:hi].contiguous())
        out.append(Sources(list(full), [tuple(t.shape) for t in full.values()], local, n))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shard_delta_bitwise_equal_to_rank0_encoder(n):
    """Each rank diffs its own pieces against its own shadow; the owner's entries equal the rank-0
    encoder's for the whole tensor (indices, values, and the choice nothing / delta / whole), and each
    rank's shadow holds 1/N of the bytes."""
    g = torch.Generator().manual_seed(0)
    full = {"count": torch.arange(10, dtype=torch.int64), "emb": torch.randn(13, 8, generator=g),
            "experts.gate_up_proj": torch.randn(5, 4, 6, generator=g),
            "experts.down_proj": torch.randn(5, 6, 2, generator=g), "same": torch.randn(7, 3, generator=g),
            "dense": torch.randn(9, 4, generator=g), "norm": torch.randn(6, generator=g)}
    dtypes = [torch.int64] + [torch.bfloat16] * 6  # the int64 first: the reference bucket stays aligned
    senders = list(range(n))
    ref = DeltaEncoder(full_every=100, max_changed=0.25)
    shadows = [ShardShadow(full_every=100, max_changed=0.25) for _ in range(n)]

    def ref_entries(state) -> dict:
        names = list(state)
        flat = [state[k].to(dt) for k, dt in zip(names, dtypes)]
        sizes = [t.numel() * t.element_size() for t in flat]
        offs = list(np.cumsum([0] + sizes[:-1]))
        data = torch.cat([t.reshape(-1).view(torch.uint8) for t in flat])
        from areal_fast.weights.experts import to_checkpoint_layout

        b = to_checkpoint_layout(Bucket(0, names, dtypes, [tuple(t.shape) for t in flat], [int(o) for o in offs],
                                        data, last=False))
        out = ref.encode(b)
        return {} if out is None else {nm: out.tensor(i).clone() for i, nm in enumerate(out.names)}

    def shard_entries(state) -> dict:
        srcs = _sharded(state, n)
        wires = plan_wire(srcs[0], dtypes, n, senders)
        pieces = [{w: local_piece(srcs[r], wt, r) for w, wt in enumerate(wires) if wt.segs[r] is not None}
                  for r in range(n)]
        delta_now = [s.begin() for s in shadows]
        assert len(set(delta_now)) == 1
        if not delta_now[0]:
            for r in range(n):
                shadows[r].commit(wires, None, pieces[r], r)
            return None
        counts = np.stack([shadows[r].count(wires, pieces[r]) for r in range(n)])
        fates = decide(wires, counts, 0.25)
        changes = [shadows[r].commit(wires, fates, pieces[r], r) for r in range(n)]
        out = {}
        for units in delta_entries(wires, fates, counts).values():
            for unit in units:
                for e in unit:
                    parts = []
                    for r in range(n):
                        if not e.pieces[r]:
                            continue
                        if e.part == "whole":
                            parts.append(pieces[r][e.wire].contiguous().view(torch.uint8))
                        else:
                            idx, val = changes[r][e.wire]
                            parts.append((idx if e.part == "idx" else val).view(torch.uint8))
                    out[e.name] = torch.cat(parts).view(e.dtype).view(e.shape)
        return out

    state = dict(full)
    ref.begin()
    ref_entries(state)
    ref.done(True)
    shard_entries(state)
    for s in shadows:
        s.done(True)
    whole_bytes = sum(t.numel() * 2 for k, t in state.items() if k != "count")
    assert all(s.nbytes <= whole_bytes / n + 13 * 8 * 2 for s in shadows)  # 1/N (+ a shard row) per rank
    assert sum(s.nbytes for s in shadows) == whole_bytes
    for step in range(1, 4):
        state = {k: v.clone() for k, v in state.items()}
        state["emb"].view(-1)[torch.randint(0, 104, (3,), generator=g)] += 1.0  # a few: a delta
        state["dense"].add_(1.0)  # all: whole
        state["experts.gate_up_proj"][step % 5, 1, 2] += 1.0  # one expert's one element
        state["experts.down_proj"][4, 0, 1] = -0.0 if step == 1 else 3.0
        state["count"] += 1
        assert ref.begin()
        want = ref_entries(state)
        got = shard_entries(state)
        ref.done(True)
        for s in shadows:
            s.done(True)
        assert set(got) == set(want), (sorted(got), sorted(want))
        for k, t in want.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
            assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
        whole, deltas = split_entries(list(want.items()))
        assert "dense" in dict(whole) and "emb" in deltas and "same" not in dict(whole) and "same" not in deltas


# ---------------------------------------------------------------------------------------- torchrun




@pytest.fixture(scope="module")
def senders_run(tmp_path_factory):
    sys.path.insert(0, HERE)
    from _senders_worker import MOE_SHAPES
    from test_weights_sync import _kill, _spawn_receiver, _spec, _spec_json, _wait_port

    from areal_fast.netutil import find_free_port

    root = tmp_path_factory.mktemp("senders")
    spec = _spec()
    sj = _spec_json(spec)
    procs, servers = [], []
    try:
        dump = root / "server"
        dump.mkdir()
        procs.append(_spawn_receiver(2, sj, str(dump), "0.5.23"))
        shapes = json.dumps({k: list(v) for k, v in spec.hf_shapes().items()})
        twin_dump = root / "twin"
        twin_dump.mkdir()
        twin = [sys.executable, os.path.join(HERE, "_twin_receiver.py"), "--dump", str(twin_dump),
                "--shapes", json.dumps(json.loads(shapes) | MOE_SHAPES)]
        procs.append(subprocess.Popen(twin, stdout=subprocess.PIPE, text=True, start_new_session=True))
        servers.append((_wait_port(procs[0]), 2, str(dump)))
        servers.append((_wait_port(procs[1]), 1, str(twin_dump)))
        out = root / "trainer"
        out.mkdir()
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(find_free_port()), os.path.join(HERE, "_senders_worker.py"), "--out", str(out),
               "--urls", *[s[0] for s in servers], "--shapes", shapes]
        trainer = subprocess.Popen(cmd, env=env, start_new_session=True)
        procs.append(trainer)
        assert trainer.wait(240) == 0, "a trainer rank failed (see its stderr above)"
        yield servers, out, json.loads((out / "stats.json").read_text())["updates"]
    finally:
        for p in procs:
            _kill(p)


def _by(updates, **want):
    return [u for u in updates if all(u[k] == v for k, v in want.items())]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_bytes_through_rank0(senders_run, n):
    """Today rank 0 sends every byte and gathers (N-1)/N of them; with every rank sending, each rank sends
    at most 1/N of the update plus one tensor (a tensor travels whole from one sender), whole or delta."""
    _servers, _out, updates = senders_run
    for kind in ("dense", "moe"):
        (one,) = _by(updates, n=n, kind=kind, version=f"{kind}-n{n}-one-whole")
        r0 = one["ranks"][0]
        assert r0["bytes_to_servers"] == one["update_bytes"] and r0["senders"] == 1
        assert r0["gather_received"] >= one["update_bytes"] * (n - 1) / n
        (one_delta,) = _by(updates, n=n, kind=kind, version=f"{kind}-n{n}-one-delta")
        d_total = one_delta["ranks"][0]["bytes_to_servers"]
        assert 0 < d_total < one["update_bytes"] / 2
        for u in _by(updates, n=n, kind=kind, senders="rank"):
            sent = [r["bytes_to_servers"] for r in u["ranks"]]
            assert u["ranks"][0]["senders"] == n
            total = sum(sent)
            if u["ranks"][0]["mode"] == "whole":
                assert total == u["update_bytes"], u["version"]
            slack = u["largest_tensor_bytes"] + 64  # one tensor (or its delta) + a keep-alive element
            assert max(sent) <= total / n + slack, (u["version"], sent)
            r0 = u["ranks"][0]
            assert r0["gather_received"] == 0
            assert r0["exchange_received"] + r0["exchange_sent"] <= 2 * (total / n + slack), u["version"]
        modes = [u["ranks"][0]["mode"] for u in _by(updates, n=n, kind=kind, senders="rank")]
        # whole, delta, whole (every 2nd); each new group (a server left, then joined) starts whole
        assert modes == ["whole", "delta", "whole", "whole", "delta", "whole", "delta"]
        deltas = [sum(r["bytes_to_servers"] for r in u["ranks"]) for u in _by(updates, n=n, kind=kind, senders="rank")
                  if u["ranks"][0]["mode"] == "delta"]
        assert all(d < one["update_bytes"] / 2 for d in deltas)
        shadow = max(r["shadow_bytes"] for u in _by(updates, n=n, kind=kind, senders="rank") for r in u["ranks"])
        assert shadow <= one["update_bytes"] / n + one["largest_tensor_bytes"]  # 1/N of the model per rank


@pytest.mark.slow
def test_one_sender_per_node(senders_run):
    """``senders: node`` with nodes of 2 ranks: ranks 0 and 2 send about half each, ranks 1 and 3 only
    contribute their rows through the exchange."""
    _servers, _out, updates = senders_run
    for u in _by(updates, senders="node"):
        sent = [r["bytes_to_servers"] for r in u["ranks"]]
        assert sent[1] == sent[3] == 0 and sent[0] > 0 and sent[2] > 0, (u["version"], sent)
        assert u["ranks"][0]["senders"] == 2 and u["ranks"][1]["exchange_sent"] > 0
        if u["ranks"][0]["mode"] == "whole":
            assert sum(sent) == u["update_bytes"] and max(sent) <= u["update_bytes"] / 2 + u["largest_tensor_bytes"]
    assert [u["ranks"][0]["mode"] for u in _by(updates, senders="node")] == ["whole", "delta"]


@pytest.mark.slow
def test_every_server_bitwise_after_every_update(senders_run):
    servers, out, updates = senders_run
    tps = {url: (tp, dump) for url, tp, dump in servers}
    assert len(updates) == 2 * 2 * 9 + 2
    for u in updates:
        want = torch.load(out / f"{u['version']}.pt", weights_only=True)
        for url in u["urls"]:
            tp, dump = tps[url]
            for r in range(tp):
                got = torch.load(os.path.join(dump, f"v{u['version']}_rank{r}.pt"), weights_only=True)["full"]
                for name, t in want.items():
                    assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (u["version"], url, r, name)
        left_out = [url for url in tps if url not in u["urls"]]
        for url in left_out:  # a server that left got nothing of that version
            assert not os.path.exists(os.path.join(tps[url][1], f"v{u['version']}_rank0.pt"))


@pytest.mark.slow
def test_each_server_one_call_stream_per_sender_and_one_flush(senders_run):
    import urllib.request

    servers, _out, updates = senders_run
    for url, _tp, _dump in servers[:1]:  # the SGLang-like receiver records its calls
        st = json.loads(urllib.request.urlopen(url + "/debug/state", timeout=10).read())
        for u in updates:
            if url not in u["urls"]:
                continue
            calls = [c for c in st["calls"] if c["weight_version"] == u["version"]]
            assert sum(1 for c in calls if c["flush"]) == 1, u["version"]  # the cache flushed once per update
            groups = {c["group"] for c in calls}
            if u["senders"] == "rank" and u["ranks"][0]["mode"] == "whole":
                assert len(groups) == u["n"], (u["version"], groups)  # every rank sent over its own group
        assert st["begin"] == st["end"] and not st["session_open"]
