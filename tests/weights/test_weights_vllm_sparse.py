"""Delta updates to vLLM through its own sparse path (``backends/vllm/sparse.py``, the ``sparse_nccl``
weight-transfer backend, 0.32.0 on), judged by vLLM 0.33.0's own code run on CPU from the wheel
(``tests/vllm_wheel.py``): its ``SparseNCCLWeightTransferEngine.receive_weights`` (the worker's side of
``/update_weights``: the update info's own validation, the per-patch broadcasts in its order) and
``load_checkpoint_weight_patches`` (NaN-masked loads through the model's loader), for the tiny dense
Qwen2 and the tiny Qwen3-MoE (experts in checkpoint coordinates, one tensor per expert):

- after every update (whole, deltas, the whole anchor every ``delta_full_every``, deltas again) the
  model behind vLLM's engine holds, in its fused runtime layout (qkv, gate-up, w13/w2), bitwise the
  trainer's tensors; a delta update moves 6 bytes per changed element, a whole one 6 per element;
- the same received patches through a tp 2 loader (each rank its slice) give each rank its slice;
- vLLM's own trainer-side sender (``SparseNCCLTrainerWeightTransferEngine``) announces our patches with
  our body and broadcasts them in our order;
- the embedded twin launched with ``--weight-transfer-config '{"backend": "sparse_nccl"}'`` takes the
  same wire over real HTTP and gloo, bitwise, several buckets per update;
- what cannot work is refused before a rendezvous, naming the server: mixed backends, ``delta: off``
  to a sparse server, ``on`` to a dense one, a pre-0.32 sparse server; a NaN weight (vLLM's mark).

The engine stands behind an in-process stand-in of the server's HTTP side; its communicator is gloo
(the twin's wire: vLLM's is NCCL, same broadcasts). One bucket per update there: vLLM's loader swaps
``torch.Tensor.copy_`` process-wide while it loads, which the trainer's own packing of a next bucket
in the same process must not meet. Real vLLM is not started: the CPU build installed here (0.32.0)
has the same sparse receive code, but its engine is NCCL-only (``PyNcclCommunicator``), which a CPU
server cannot open.
"""

from __future__ import annotations

import types
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from fakes import _broadcast, _join_gloo_group

from areal_fast.backends.vllm.compat import TWIN_TRANSFER_GROUP, VLLMBehaviour
from areal_fast.backends.vllm.requests import sparse_update_body
from areal_fast.backends.vllm.server_command import vllm_server_command
from areal_fast.backends.vllm.sparse import bucket_patches, patches_body
from areal_fast.backends.vllm.transfer import VLLMServer, VLLMTransferWeightSync, choose_wire
from areal_fast.data.tiny_models import build_tiny_qwen2, build_tiny_qwen3_moe
from areal_fast.weights.config import WeightSyncConfig
from areal_fast.weights.errors import WeightSyncError
from areal_fast.weights.experts import to_checkpoint_state
from areal_fast.weights.gather import Bucket

VERSION = "0.33.0"
TIMEOUT_S = 60
CHANGED = 0.02  # of the elements per delta update (lr 1e-6's steady state is ~2-3 %, docs/weight_sync.md)


# ----------------------------------------------------------------------------- vLLM's side


def _vllm_sparse():
    """vLLM 0.33.0's checkpoint_weight_patch and sparse engine modules, run from the wheel's sources."""
    from vllm_wheel import vllm_source_module

    patch = vllm_source_module(VERSION, "vllm.model_executor.model_loader.checkpoint_weight_patch")
    engine = vllm_source_module(VERSION, "vllm.distributed.weight_transfer.sparse_nccl_engine")
    return patch, engine


class _CpuTorch(types.ModuleType):
    """torch for the engine module, but ``torch.cuda.current_stream`` answers None (its receive asks
    for the CUDA stream to hand to the communicator; the gloo one takes none)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(current_stream=lambda device=None: None)

    def __getattr__(self, name):
        return getattr(torch, name)


class _GlooComm:
    """vLLM's ``PyNcclCommunicator`` surface the sparse engine uses, over a gloo group."""

    device = torch.device("cpu")

    def __init__(self, pg):
        self.pg = pg

    def broadcast(self, t, src, stream=None):
        assert src == 0, "vLLM's sparse worker receives from group rank 0 only (one sender a server)"
        _broadcast(self.pg, t)

    def destroy(self):
        self.pg = None


class VLLMLayoutModel(torch.nn.Module):
    """vLLM's runtime layout of a Qwen2 / Qwen3-MoE checkpoint (``state``: checkpoint names) and a
    ``load_weights`` shaped as vLLM's model loaders are: q/k/v into ``qkv_proj``, gate/up into
    ``gate_up_proj``, per-expert gate/up into ``w13_weight[e]`` and down into ``w2_weight[e]``, each by
    ONE final ``copy_`` of the (tp-sliced) checkpoint tensor into its place (the sparse loader's
    contract). Column-parallel parts split their rows over ``tp``, row-parallel ones their columns."""

    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    ROW_PARALLEL = ("o_proj", "down_proj")

    def __init__(self, state: dict[str, torch.Tensor], tp: int = 1, rank: int = 0):
        super().__init__()
        self.tp, self.rank = tp, rank
        self.place: dict[str, tuple[str, int, int, int]] = {}  # checkpoint name -> (param, dim, offset, rows)
        params: dict[str, list[torch.Tensor]] = {}
        for name, t in state.items():
            target, part = name, self._slice(name, t)
            for fused, one, _k in self.STACKED:
                if f".{one}." in name:
                    target = name.replace(f".{one}.", f".{fused}.")
            if ".experts." in name:
                head, e, proj, _w = name.rsplit(".", 3)
                target = f"{head}.{'w2_weight' if proj == 'down_proj' else 'w13_weight'}:{e}"
            params.setdefault(target, []).append((name, part))
        self._p = {}
        for target, parts in params.items():
            offset = 0
            for name, part in parts:  # q, k, v / gate, up in the checkpoint's order (the fused order)
                self.place[name] = (target, 0, offset, part.shape[0] if part.dim() else 0)
                offset += part.shape[0] if part.dim() else 0
            whole = torch.cat([p for _, p in parts]) if len(parts) > 1 else parts[0][1].clone()
            self._p[target] = torch.nn.Parameter(whole, requires_grad=False)
        self.loaded: list[str] = []

    def _slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.tp == 1 or t.dim() == 0:
            return t.clone()
        dim = 1 if any(f".{r}." in name for r in self.ROW_PARALLEL) and t.dim() == 2 else 0
        n = t.shape[dim] // self.tp
        return t.narrow(dim, self.rank * n, n).clone()

    def load_weights(self, weights):
        done = set()
        for name, w in weights:
            target, dim, off, rows = self.place[name]
            src = self._slice(name, w) if self.tp > 1 else w
            dst = self._p[target].data
            if rows and dst.shape != src.shape:
                dst = dst.narrow(dim, off, src.shape[0])
            dst.copy_(src)  # the one final copy_ (vLLM's weight_loader / default_weight_loader)
            done.add(name)
        self.loaded.extend(done)
        return done

    def checkpoint_view(self, name: str) -> torch.Tensor:
        """What this rank holds of checkpoint tensor ``name``."""
        target, dim, off, rows = self.place[name]
        t = self._p[target].data
        return t.narrow(dim, off, rows) if rows and t.shape[0] != rows else t


class FakeVLLMServer:
    """The HTTP side of a vLLM 0.33 server launched with ``sparse_nccl`` (its routes called in process),
    over vLLM's own sparse engine and update info; the communicator is gloo (device 'cpu')."""

    url = "http://vllm-sparse:1"

    def __init__(self, model, backend="sparse_nccl"):
        patch_mod, engine_mod = _vllm_sparse()
        engine_mod.torch = _CpuTorch()
        self.info_cls = engine_mod.SparseNCCLWeightTransferUpdateInfo
        self.engine = engine_mod.SparseNCCLWeightTransferEngine.__new__(engine_mod.SparseNCCLWeightTransferEngine)
        self.engine.model = model
        self.engine.model_update_group = None
        self.backend = backend
        self.patches_seen: list[list] = []  # every update's patches, as vLLM built them (for the tp 2 replay)
        real_load = engine_mod.load_checkpoint_weight_patches

        def recording_load(model, patches, **kw):
            patches = list(patches)
            self.patches_seen.append([p._replace(values=p.values.clone(), indices=p.indices.clone()) for p in patches])
            return real_load(model, patches, **kw)

        engine_mod.load_checkpoint_weight_patches = recording_load
        self.load_patches = real_load
        self.calls: list[str] = []

    def answer(self, path: str, body):
        self.calls.append(path.split("?")[0])
        if path == "/version":
            return {"version": VERSION}
        if path.startswith("/server_info"):
            par = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}
            return {"vllm_config": {"parallel_config": par, "device_config": {"device": "cpu"},
                                    "weight_transfer_config": {"backend": self.backend}},
                    "areal_fast_engine": "embedded"}
        if path == "/init_weight_transfer_engine":
            i = body["init_info"]
            pg = _join_gloo_group(i["master_address"], i["master_port"], i["world_size"], i["rank_offset"],
                                  TWIN_TRANSFER_GROUP, TIMEOUT_S)
            self.engine.model_update_group = _GlooComm(pg)
            return {}
        if path == "/update_weights":
            self.engine.receive_weights(self.info_cls(**body["update_info"]))  # vLLM's own validation
            return {}
        if path == "/shutdown_weight_transfer_engine":
            self.engine.shutdown()
            return {}
        return {}  # start / finish (the sparse engine's are no-ops), the version label


class InProcessCalls:
    """``SyncCalls``' surface, answered by a :class:`FakeVLLMServer` on threads."""

    def __init__(self, server: FakeVLLMServer):
        self.server = server
        self.pool = ThreadPoolExecutor(4)

    def submit(self, url, path, body=None, method="POST", what="") -> Future:
        return self.pool.submit(self.server.answer, path, body)

    def call(self, url, path, body=None, method="POST", what=""):
        return self.submit(url, path, body).result(TIMEOUT_S)

    def each(self, urls, path, body=None, method="POST"):
        out = []
        for u in urls:
            try:
                out.append((u, self.call(u, path, body), None))
            except Exception as e:  # noqa: BLE001 - as SyncCalls.each
                out.append((u, None, e))
        return out

    def all(self, urls, path, body=None, method="POST"):
        return [self.call(u, path, body) for u in urls]

    def close(self):
        self.pool.shutdown(wait=False)


# ----------------------------------------------------------------------------- the trainer's side


def _states(kind: str, tmp_path, n_updates: int):
    """The trainer's bf16 state (model names: fused experts) before each update: a fresh one, then
    ``CHANGED`` of the elements moved by one bf16 step per update (a norm weight never changes)."""
    build = build_tiny_qwen2 if kind == "dense" else build_tiny_qwen3_moe
    path = build(str(tmp_path / kind), num_layers=1)
    from areal_fast.data.tiny_models import load_hf

    st = {n: p.detach().to(torch.bfloat16).clone() for n, p in load_hf(path).named_parameters()}
    g = torch.Generator().manual_seed(3)
    out = [st]
    for _ in range(n_updates - 1):
        nxt = {}
        for n, t in out[-1].items():
            t = t.clone()
            if t.dim() >= 2:
                flat = t.view(-1)
                pick = torch.rand(flat.numel(), generator=g) < CHANGED
                words = flat.view(torch.int16)
                words[pick] += 1  # the next bf16 value
            nxt[n] = t
        out.append(nxt)
    return out


def _sync(calls, **cfg) -> VLLMTransferWeightSync:
    config = WeightSyncConfig(dtype="bfloat16", delta="auto", delta_full_every=3, timeout_s=TIMEOUT_S,
                              master_addr="127.0.0.1", **cfg)
    sync = VLLMTransferWeightSync([FakeVLLMServer.url], config, device=torch.device("cpu"))
    sync._http = calls
    return sync


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_deltas_through_vllm_033s_own_sparse_engine_are_bitwise(kind, tmp_path):
    states = _states(kind, tmp_path, 5)
    ckpt0 = to_checkpoint_state(states[0])
    server = FakeVLLMServer(VLLMLayoutModel({n: torch.zeros_like(t) for n, t in ckpt0.items()}))
    calls = InProcessCalls(server)
    sync = _sync(calls, bucket_bytes=1 << 30)  # one bucket per update (module docstring)
    modes, wire = [], []
    try:
        for v, st in enumerate(states, start=1):
            sync.update(st, v)
            modes.append(sync.delta.stats.mode)
            wire.append(sync.wire_bytes)
            ckpt = to_checkpoint_state(st)
            model = server.engine.model
            bad = [n for n, t in ckpt.items() if not torch.equal(model.checkpoint_view(n), t)]
            assert not bad, f"update {v} ({modes[-1]}): {bad[:3]} differ from the trainer's"
    finally:
        sync.close()
        calls.close()
    assert sync.wire == "sparse_nccl" and sync.n_inits == 1
    assert modes == ["whole", "delta", "delta", "whole", "delta"]
    numel = sum(t.numel() for t in ckpt0.values())
    assert wire[0] == wire[3] == 6 * numel, "whole: every element as (int32 index, bf16 value)"
    for w in (wire[1], wire[2], wire[4]):
        assert 0 < w < 6 * numel * 2.5 * CHANGED, f"a delta moves the changes only ({w} of {6 * numel} bytes)"
    if kind == "moe":
        assert any(".experts.0.gate_proj.weight" in n for n in server.engine.model.loaded), "per-expert names"
    # the same patches (as vLLM's engine built them) through a tp 2 loader: each rank gets its slice
    last = to_checkpoint_state(states[-1])
    for rank in (0, 1):
        m = VLLMLayoutModel({n: torch.zeros_like(t) for n, t in ckpt0.items()}, tp=2, rank=rank)
        for patches in server.patches_seen:
            server.load_patches(m, patches)
        ref = VLLMLayoutModel(last, tp=2, rank=rank)
        assert all(torch.equal(m.checkpoint_view(n), ref.checkpoint_view(n)) for n in last), f"tp rank {rank}"


def test_update_info_is_vllms_own_and_patches_keep_the_encoder_order():
    _patch, engine = _vllm_sparse()
    body = sparse_update_body(["a.weight", "b.weight"], ["bfloat16", "bfloat16"], [[2, 3], [4]], [6, 1])
    info = engine.SparseNCCLWeightTransferUpdateInfo(**body["update_info"])
    assert info.num_updates_list == [6, 1]
    with pytest.raises(ValueError, match="empty"):
        sparse_update_body([], [], [], [])
    # a whole tensor is every index; a delta its own; a NaN is refused naming the tensor
    w = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    idx, val = torch.tensor([1, 4], dtype=torch.int32), torch.tensor([7, 8], dtype=torch.bfloat16)
    b = Bucket(0, ["b.weight#delta_idx:4x2", "a.weight", "b.weight#delta_val"],
               [torch.int32, torch.bfloat16, torch.bfloat16], [(2,), (2, 3), (2,)], [0, 8, 20],
               torch.cat([idx.view(torch.uint8), w.reshape(-1).view(torch.uint8), val.view(torch.uint8)]))
    ps = bucket_patches(b)
    assert [(p.name, p.shape) for p in ps] == [("a.weight", (2, 3)), ("b.weight", (4, 2))]
    assert ps[0].indices.tolist() == list(range(6)) and torch.equal(ps[1].values, val)
    # vLLM's own trainer-side helper (SparseNCCLTrainerWeightTransferEngine) sends these patches with our body
    # and our broadcast order
    got_info, got_sends = [], []
    helper = engine.SparseNCCLTrainerWeightTransferEngine.__new__(engine.SparseNCCLTrainerWeightTransferEngine)
    helper.client = types.SimpleNamespace(update_weights=got_info.append)
    helper.model_update_group = types.SimpleNamespace(
        device=torch.device("cpu"), broadcast=lambda t, src, stream=None: got_sends.append(t))
    engine.torch = _CpuTorch()
    helper._broadcast_chunk([engine.SparseWeightPatch(p.name, p.indices, p.values, p.shape) for p in ps])
    assert got_info == [patches_body(ps)["update_info"]]
    assert [t.data_ptr() for t in got_sends] == [t.data_ptr() for p in ps for t in (p.indices, p.values)]
    b.tensor(1)[0, 0] = float("nan")
    with pytest.raises(WeightSyncError, match="a.weight: a NaN weight"):
        bucket_patches(b)


def _srv(backend="sparse_nccl", version=VERSION, url="http://s:1"):
    return VLLMServer(url, VLLMBehaviour.of(version), 1, False, "cuda", backend)


def test_what_cannot_be_served_together_is_refused_naming_the_server():
    assert choose_wire([_srv()], "auto") == "sparse_nccl"
    assert choose_wire([_srv("nccl")], "auto") == "nccl"
    with pytest.raises(WeightSyncError, match="different weight-transfer backends"):
        choose_wire([_srv(), _srv("nccl", url="http://d:2")], "auto")
    with pytest.raises(WeightSyncError, match="'off'.*http://s:1.*sparse_nccl"):
        choose_wire([_srv()], "off")
    with pytest.raises(WeightSyncError, match="'on'.*http://s:1.*sparse_nccl"):
        choose_wire([_srv("nccl")], "on")
    with pytest.raises(WeightSyncError, match=r"http://s:1 \(0.27.0\).*runtime name"):
        choose_wire([_srv(version="0.27.0")], "auto")
    with pytest.raises(WeightSyncError, match="does not speak"):
        choose_wire([_srv("nccl_m2n")], "auto")
    assert VLLMBehaviour.of("0.32.0").has_sparse_transfer and not VLLMBehaviour.of("0.31.0").has_sparse_transfer
    assert VLLMBehaviour.of("0.33.0").has_m2n_transfer and not VLLMBehaviour.of("0.32.0").has_m2n_transfer
    cmd = vllm_server_command("m", "h", 1, version="0.32.0", weight_transfer="sparse_nccl")
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "sparse_nccl"}'
    with pytest.raises(ValueError, match="sparse_nccl.*0.32.0"):
        vllm_server_command("m", "h", 1, version="0.27.0", weight_transfer="sparse_nccl")
    mine = ["--weight-transfer-config", '{"backend": "sparse_nccl"}']
    cmd = vllm_server_command("m", "h", 1, version=VERSION, weight_transfer=True, extra_args=mine)
    assert cmd.count("--weight-transfer-config") == 1, "the run's own flag wins"


# ----------------------------------------------------------------------------- the twin


class _UnregisteredGloo:
    """The sender's gloo channel (``transfer._GlooChannel``) on the same store keys, but not registered
    under the group's name: the twin in this process registers that name for its end."""

    def __init__(self, store, world_size, timeout_s):
        import datetime

        import torch.distributed as dist
        from torch.distributed.distributed_c10d import PrefixStore

        g = TWIN_TRANSFER_GROUP
        keys = PrefixStore("cpu/", PrefixStore(f"{g}/", PrefixStore(g, store.store)))
        self.pg = dist.ProcessGroupGloo(keys, 0, world_size, datetime.timedelta(seconds=timeout_s))

    def broadcast(self, t):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.pg.broadcast([t], opts)

    def close(self):
        self.pg = None


def test_the_twin_takes_the_sparse_wire_bitwise(tmp_path, monkeypatch):
    import areal_fast.backends.vllm.transfer as transfer
    from areal_fast.embedded import start_engine_in_thread

    monkeypatch.setattr(transfer, "_GlooChannel", _UnregisteredGloo)
    states = _states("moe", tmp_path, 3)
    twin = start_engine_in_thread(str(tmp_path / "moe"), api="vllm", vllm_version=VERSION, weight_version="0",
                                  dtype="bfloat16", weight_transfer_backend="sparse_nccl")
    config = WeightSyncConfig(dtype="bfloat16", delta="auto", timeout_s=TIMEOUT_S, master_addr="127.0.0.1",
                              bucket_bytes=16 << 10)  # several buckets per update
    sync = VLLMTransferWeightSync([twin.url], config, device=torch.device("cpu"))
    modes, wire = [], []
    try:
        params = twin.server.receiver._params
        for v, st in enumerate(states, start=1):
            sync.update(st, v)
            modes.append(sync.delta.stats.mode)
            wire.append(sync.wire_bytes)
            ckpt = to_checkpoint_state(st)
            bad = [n for n in ckpt if not torch.equal(params[n].detach(), ckpt[n])]
            assert not bad, f"update {v}: {bad[:3]} differ from the trainer's"
            assert twin.server.scheduler.weight_version == str(v)
    finally:
        sync.close()
        twin.stop()
    assert sync.wire == "sparse_nccl" and sync.n_inits == 1 and modes == ["whole", "delta", "delta"]
    numel = sum(t.numel() for t in ckpt.values())
    assert wire[0] == 6 * numel and 0 < wire[1] < 6 * numel * 2.5 * CHANGED


def test_the_twins_backend_flag_is_checked_at_start():
    from areal_fast.backends.vllm.compat import check_twin_transfer_backend
    from areal_fast.embedded.__main__ import parse_args

    assert check_twin_transfer_backend("nccl", None) == "nccl"
    with pytest.raises(ValueError, match="--api vllm only"):
        check_twin_transfer_backend("sparse_nccl", None)
    with pytest.raises(ValueError, match="sparse_nccl.*0.32.0"):
        check_twin_transfer_backend("sparse_nccl", VLLMBehaviour.of("0.27.0"))
    from areal_fast.embedded.vllm_routes import sparse_metas

    info = sparse_update_body(["a.w", "b.w"], ["bfloat16", "float32"], [[2, 3], [4]], [5, 0])["update_info"]
    assert [(m.name, m.dtype, m.shape) for m in sparse_metas(info)] == [
        ("a.w#delta_idx:2x3", torch.int32, (5,)), ("a.w#delta_val", torch.bfloat16, (5,)),
        ("b.w#delta_idx:4", torch.int32, (0,)), ("b.w#delta_val", torch.float32, (0,))], "vLLM's receive order"
    with pytest.raises(ValueError, match="non-negative"):
        sparse_metas({**info, "num_updates_list": [5, -1]})
    args = parse_args(["--model", "m", "--api", "vllm", "--weight-transfer-config", '{"backend": "sparse_nccl"}'])
    assert args.weight_transfer_backend == "sparse_nccl"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--api", "vllm", "--weight-transfer-config", "sparse"])
