"""The weight-update process group: trainer rank 0 (rank 0 of the group) plus every TP rank of
every server (ranks ``rank_offset + tp_rank``), and the choice of its backend.

Both sides must agree on the store keys: the servers join with a ``tcp://`` rendezvous (a
client ``TCPStore``), wrap it in ``PrefixStore(group_name)`` and build the group with
``_new_process_group_helper``; :func:`init_custom_process_group` is that server side (our test
receivers use it). The trainer side, :func:`host_weight_group`, hosts the store itself:

* explicitly (``is_master=True``), because torch's ``tcp://`` rendezvous creates a client-only
  store when ``TORCHELASTIC_USE_AGENT_STORE=True``, which torchrun sets for every trainer
  rank; nobody would host the weight group's store and the rendezvous would hang;
* on the requested address only: torch's own server socket listens on every interface, so
  the socket is bound here and handed to the store (``master_listen_fd``).

Backend (:func:`choose_backend`): NCCL only when the tensors to send are on CUDA and no
server shares the trainer's GPU (NCCL refuses two ranks of one group on one device); gloo
for CPU tensors, even when a GPU is visible; an explicit choice that cannot work is refused.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_fast.netutil import address_family, bare_host, find_free_port
from areal_fast.weights.errors import WeightSyncError

__all__ = ["ServerFacts", "init_custom_process_group", "host_weight_group", "bind_listen_socket",
           "choose_backend", "HostedStore", "rendezvous"]

log = logging.getLogger(__name__)
_BIND_ATTEMPTS = 20  # find_free_port checks by binding, but another process may take the port before we do


@dataclass(kw_only=True)
class ServerFacts:
    """What weight sync needs to know about one server, read from ``/server_info``."""

    url: str
    version: str
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    device: str | None = None
    gpu_ids: tuple[int, ...] | None = None  # the GPUs of its TP ranks on its host, when it says
    engine: str | None = None  # "areal_fast.embedded" for our engine (it applies delta updates)
    dp_attention: bool = False  # enable_dp_attention: the dp_size replicas share ONE TP group of tp_size ranks

    @classmethod
    def from_info(cls, url: str, info: dict) -> ServerFacts:
        def num(key: str) -> int:
            v = info.get(key, 1)
            try:
                return int(v if v is not None else 1)
            except (TypeError, ValueError):
                raise WeightSyncError(f"{url}/server_info: {key}={v!r} is not an integer") from None

        tp = num("tp_size")
        gpu_ids = None
        if info.get("base_gpu_id") is not None:
            step = int(info.get("gpu_id_step") or 1)
            gpu_ids = tuple(int(info["base_gpu_id"]) + step * r for r in range(tp))
        return cls(url=url, version=str(info.get("version") or ""), tp_size=tp, dp_size=num("dp_size"),
                   pp_size=num("pp_size"), device=info.get("device"), gpu_ids=gpu_ids,
                   engine=info.get("engine") if isinstance(info.get("engine"), str) else None,
                   dp_attention=info.get("enable_dp_attention") is True)

    def check_layout(self, dp_attention_ok: bool = True) -> None:
        """``init_weights_update_group`` gives each TP worker the group rank ``rank_offset + tp_rank``
        (SGLang 0.5.6 and 0.5.23 read; docs/sglang.md). With DP attention (``enable_dp_attention``,
        how MoE models are served) the ``dp_size`` attention replicas live inside ONE TP group: the
        server's workers are tp_rank ``0 .. tp_size-1`` (``tp_size`` is the server's total), every one
        gets each control request once, so the server joins as ``tp_size`` distinct ranks and loads the
        full tensors through its own loaders (attention sliced by its attention-TP rank): served, except
        where the sender builds SGLang's TP layout itself (``dp_attention_ok`` False: the colocated
        transport). Plain data parallelism (``dp_size > 1`` without it) starts ``dp_size`` replicas whose
        workers each count tp_rank from 0: they would take the same ranks; pipeline stages hold part of
        the model. Both are refused here, naming the server."""
        if self.tp_size < 1:
            raise WeightSyncError(f"{self.url}: tp_size={self.tp_size} must be >= 1")
        if self.dp_size != 1 and not (self.dp_attention and dp_attention_ok):
            if self.dp_attention:
                raise WeightSyncError(f"{self.url}: dp_size={self.dp_size} with DP attention; this transport builds "
                                      "SGLang's TP layout itself (attention split over tp, not tp/dp). Use "
                                      "weights.method=distributed")
            raise WeightSyncError(f"{self.url}: dp_size={self.dp_size} without DP attention; SGLang starts "
                                  f"{self.dp_size} replicas whose TP workers each join the weight group as "
                                  "rank_offset + tp_rank (tp_rank from 0 in every replica), so they would share "
                                  "ranks. Launch one server per replica (dp_size=1), serve with "
                                  "--enable-dp-attention, or use weights.method=disk")
        if self.pp_size != 1:
            raise WeightSyncError(f"{self.url}: pp_size={self.pp_size}; distributed weight sync supports one "
                                  "pipeline stage per server. Use pp_size=1 or weights.method=disk")


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 600.0):
    """A process group outside the default one, joined the way SGLang's servers join the weight
    group (``tcp://`` rendezvous, ``PrefixStore(group_name)``, ``_new_process_group_helper``)."""
    from torch.distributed.distributed_c10d import PrefixStore, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    _gloo_loopback(backend, init_method.removeprefix("tcp://").rsplit(":", 1)[0])
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return _new_group(backend, PrefixStore(group_name, store), world_size, rank, group_name, timeout)


def _gloo_loopback(backend: str, host: str) -> None:
    if backend == "gloo" and host.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback rendezvous: gloo must bind lo too


def _new_group(backend: str, store, world_size: int, rank: int, group_name: str, timeout):
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def bind_listen_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (``port`` 0: a free port from
    :func:`areal_fast.netutil.find_free_port`)."""
    host = bare_host(host)
    family = address_family(host)
    last: OSError | None = None
    for _ in range(_BIND_ATTEMPTS if port == 0 else 1):
        p = port or find_free_port(host)
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, p))
            s.listen(1024)
            return s
        except OSError as e:
            s.close()
            last = e
            if e.errno != errno.EADDRINUSE:
                break
    raise WeightSyncError(f"cannot listen on {host}:{port or '<free port>'} for the weight update group's "
                          f"store: {last}")


class HostedStore:
    """A master ``TCPStore`` listening on one address (see the module docstring)."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float):
        host = bare_host(host)
        sock = bind_listen_socket(host, port)
        self.host, self.port = host, sock.getsockname()[1]
        try:
            self.store = dist.TCPStore(host, self.port, world_size, is_master=True,
                                       timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                       master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns (and closes) the descriptor now

    def close(self) -> None:
        """Drop our reference; the server stops when the group that uses it is gone too."""
        self.store = None


def rendezvous(open_end: Callable[[], object], inits: list[tuple[str, Future]], store: HostedStore,
               timeout_s: float, what: str, own_end: str = "the trainer end"):
    """Rank 0's side of a rendezvous: run ``open_end()`` (rank 0's end of the group, on ``store``) in a
    thread while the servers' init calls ``inits`` (``(url, future)``) are in flight; both must finish
    within ``timeout_s``, and ``open_end()``'s result is returned. A server that refuses is raised at
    once; a failure of rank 0's end is raised as a WeightSyncError naming ``what`` (the group). On any
    failure the store is closed, once rank 0's end no longer runs (it may still read the store)."""
    box: dict = {}

    def run():
        try:
            box["end"] = open_end()
        except Exception as e:  # noqa: BLE001 - raised below
            box["err"] = e

    th = threading.Thread(target=run, name=f"{what} init".replace(" ", "-"), daemon=True)
    th.start()
    deadline = time.monotonic() + timeout_s
    try:
        while th.is_alive() or not all(f.done() for _, f in inits):
            for _u, f in inits:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            if time.monotonic() > deadline:
                late = [u for u, f in inits if not f.done()]
                raise WeightSyncError(f"{what} rendezvous timed out after {timeout_s}s "
                                      f"(store {store.host}:{store.port}; waiting for {late or own_end})")
            time.sleep(0.005)
        if "err" in box:
            err = box["err"]
            if isinstance(err, WeightSyncError):
                raise err
            raise WeightSyncError(f"trainer end of the {what} failed: {err}") from err
        for _u, f in inits:
            f.result()
    except BaseException:
        if not th.is_alive():
            store.close()
        raise
    return box["end"]


def host_weight_group(backend: str, store: HostedStore, world_size: int, group_name: str, timeout_s: float):
    """Trainer rank 0's side of the weight group (rank 0), on a store it hosts. Blocks until every
    server rank joined; run it concurrently with the servers' ``/init_weights_update_group``."""
    from torch.distributed.distributed_c10d import PrefixStore

    _gloo_loopback(backend, store.host)
    timeout = datetime.timedelta(seconds=timeout_s)
    return _new_group(backend, PrefixStore(group_name, store.store), world_size, 0, group_name, timeout)


def _is_local(url: str) -> bool:
    from urllib.parse import urlparse

    host = (urlparse(url).hostname or "").lower()
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return host in (socket.gethostname().lower(), socket.getfqdn().lower()) or \
            host in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False


def shared_gpu(servers: list[ServerFacts], device: torch.device) -> ServerFacts | None:
    """The first server on this host whose GPUs include ``device`` (a CUDA device of trainer rank 0).
    A server that does not report its GPUs counts as sharing when this host has one GPU only."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    for s in servers:
        if not _is_local(s.url) or (s.device not in (None, "cuda")):
            continue
        if s.gpu_ids is not None:
            if index in s.gpu_ids:
                return s
        elif torch.cuda.device_count() == 1:
            return s
    return None


def choose_backend(requested: str | None, tensor_device: torch.device, servers: list[ServerFacts]) -> str:
    """The weight group's backend from where the tensors and the ranks really are (module docstring)."""
    tensor_device = torch.device(tensor_device)
    if tensor_device.type != "cuda":
        if requested == "nccl":
            raise WeightSyncError(f"weights.collective='nccl' but the tensors to send are on {tensor_device}; "
                                  "NCCL only moves CUDA tensors. Use backend=gloo (or null)")
        return "gloo"
    clash = shared_gpu(servers, tensor_device)
    if clash is not None:
        msg = (f"trainer rank 0 and server {clash.url} share GPU {tensor_device}; NCCL cannot hold two ranks of "
               "one group on one device")
        if requested == "nccl":
            raise WeightSyncError(msg + ". Use ColocatedWeightSync (CUDA IPC), weights.collective=gloo or "
                                        "weights.method=disk")
        log.warning("%s: using gloo (copies through host memory); ColocatedWeightSync avoids that copy", msg)
        return "gloo"
    return requested or "nccl"
