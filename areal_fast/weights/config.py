"""The one weight-sync configuration: the ``weights:`` section of a run's YAML and the argument of
every transport in :mod:`areal_fast.weights`. Torch-free, so loading a config does not import torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, option

__all__ = ["WeightSyncConfig", "METHODS", "default_method", "DISK_LOAD_FORMATS", "API_KEY_ENV", "HOST_ENV"]

METHODS = ("distributed", "disk")


def default_method(lora: bool) -> str:
    """``weights.method`` when the run leaves it null: a LoRA run's adapters travel as files."""
    return "disk" if lora else "distributed"
# What /update_weights_from_disk may name as ``load_format`` for an HF-layout safetensors
# directory (SGLang's LoadFormat values that read such a directory); never null, which would
# mean "the launch format" and fails on servers launched with ``--load-format dummy``.
DISK_LOAD_FORMATS = ("auto", "safetensors")
API_KEY_ENV = "AREAL_FAST_API_KEY"
HOST_ENV = "AREAL_FAST_HOST"  # the address servers on other machines reach trainer rank 0 at
_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How new weights reach the inference servers after each trainer step."""

    method: str | None = option(None, choices=METHODS)
    """'distributed' (NCCL / gloo broadcast of flattened buckets; when the servers change, a server
    dies or joins, the group is formed again over the new ones: docs/elastic.md) or 'disk'
    (safetensors + /update_weights_from_disk). null: 'disk' in a LoRA run (an adapter travels as a
    PEFT directory), 'distributed' otherwise (``default_method``); a LoRA run refuses 'distributed'."""
    bucket_bytes: int = option(256 << 20, ge=1 << 10)
    """Largest flattened bucket (bytes); a larger tensor travels alone."""
    dtype: str | None = "auto"
    """Floating tensors are sent in this dtype ('bfloat16', 'float16', 'float32'); 'auto': bfloat16
    when the trainer runs on CUDA, as stored otherwise; null: always as stored."""
    load_format: str | None = option("flattened_bucket", choices=("flattened_bucket",))
    """Distributed path: 'flattened_bucket' (one broadcast per bucket) or null (one per tensor)."""
    disk_load_format: str = option("auto", choices=DISK_LOAD_FORMATS)
    """``load_format`` sent with /update_weights_from_disk: 'auto' or 'safetensors'."""
    group_name: str = option("weight_update_group", nonempty=True)
    """Name of the weight-update process group on the servers."""
    master_addr: str | None = None
    """Address of the group's store on trainer rank 0; null: $AREAL_FAST_HOST, else 127.0.0.1.
    The store listens on this address only. IPv6 as ``::1`` or ``[::1]``."""
    master_port: int = option(0, ge=0, le=65535)
    """Port of that store; 0 picks a free one."""
    collective: str | None = option(None, choices=("nccl", "gloo"))
    """The process-group library of the broadcast: 'nccl' or 'gloo'; null: chosen from where the tensors
    are (see docs/weight_sync.md)."""
    timeout_s: float = option(600.0, gt=0)
    """Limit for each HTTP call, the group rendezvous and each broadcast."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token for the servers; null: $AREAL_FAST_API_KEY when set. A run config does not set it:
    the run's one key is the top-level ``api_key`` (``areal_fast.config.DERIVED``)."""
    flush_cache: bool | None = None
    """Ask the servers to flush their prefix cache with each update; null: yes, unless
    ``rollout.pause_mode`` is 'in_place' (kept requests hold their KV, a flush would fail). true with
    'in_place' is refused at load."""
    save_root: str | None = None
    """Disk path: parent directory of the temporary checkpoint (null: the system temp dir)."""
    shared_fs: bool = True
    """The servers see trainer rank 0's files at the same paths: one machine, or several nodes with
    a shared file system. false: the disk path is refused (``docs/multinode.md``)."""
    senders: str = option("rank", choices=("rank", "node", "one"))
    """Which trainer ranks send a distributed update: 'rank' (every rank sends its own share of the
    tensors, each over its own group to every server), 'node' (local rank 0 of each node), 'one'
    (trainer rank 0 gathers and sends everything). The default where the servers allow it: SGLang 0.5.6
    on (``compat.keeps_weight_groups_by_name``) and the embedded engine; a server outside that (an older or
    unnamed release), vLLM's transfer (one sender per group in 0.16-0.33) and a quantised update
    (``quantize``) get 'one' whatever this says; the disk and colocated transports do not use it
    (docs/weight_sync.md)."""
    delta: str = option("auto", choices=("auto", "on", "off"))
    """Delta updates (``docs/weight_sync.md``): after a whole update, send only the elements that
    changed. 'auto': to servers that apply them: the embedded engine from a CUDA trainer, and vLLM
    servers launched with ``--weight-transfer-config '{"backend": "sparse_nccl"}'`` (0.32.0 on: vLLM's
    own sparse path, whole anchors as every index and value); SGLang servers get whole updates, because
    a stock SGLang skips the delta entries (it would keep stale weights), and a CPU trainer too (its
    encode costs more than the bytes it saves); 'on': to every server (SGLang launched with
    ``SGLANG_EXTERNAL_MODEL_PACKAGE=areal_fast.backends.sglang.models``); 'off': never (refused for
    ``sparse_nccl`` servers, which take patches only). The copy of the sent weights (in the sent dtype)
    is kept in host memory: by trainer rank 0 for the whole model on the one-sender path (pinned where
    CUDA is available), by every rank for its own rows (1/N) with many senders (``weights.senders``);
    each piece is staged to the GPU for its compare."""
    delta_full_every: int = option(10, ge=1)
    """With deltas: every N-th update is sent whole (also the first, and the one after a failure)."""
    delta_max_changed: float = option(0.25, ge=0, le=1)
    """With deltas: a tensor with a larger fraction of changed elements is sent whole (a delta costs
    6 bytes per change against 2 per element whole: even at 1/3)."""
    quantize: str | None = option(None, choices=("fp8",))
    """Servers that serve in FP8: 'fp8' sends every linear weight as blockwise E4M3 (blocks of 128 by
    128 elements, one fp32 ``weight_scale_inv`` per block; embeddings, norms, LM head and routers as they
    are), quantised from the bf16-rounded weights (``weights/fp8.py``, ``docs/mismatch.md``); the servers
    load a checkpoint with the matching ``quantization_config``. Deltas are off ('auto' resolves to 'off')."""

    def __post_init__(self):
        if self.dtype is not None and not isinstance(self.dtype, str):  # a torch.dtype from Python callers
            self.dtype = str(self.dtype).removeprefix("torch.")
        check_rules(self)
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {_DTYPES} or null, got {self.dtype!r}")
        if self.master_addr is not None and (not isinstance(self.master_addr, str) or not self.master_addr
                                             or any(c.isspace() or c in "/@" for c in self.master_addr)):
            raise ValueError(f"master_addr: expected a host name or an address (e.g. 10.0.0.7, ::1), got "
                             f"{self.master_addr!r}")
        if self.quantize is not None and self.delta == "on":
            raise ValueError("delta: 'on' with quantize 'fp8': a delta carries the changed elements of the "
                             "unquantised weights, but FP8 servers hold quantised blocks (one changed element "
                             "can move its block's scale and so every element of the block); set delta 'off'")
        if self.quantize is not None:
            self.delta = "off"  # 'auto' resolves to off for quantised servers
        if self.method == "disk" and not self.shared_fs:
            raise ValueError("method: 'disk' needs the servers to read the files trainer rank 0 writes, and "
                             "shared_fs is false; use method 'distributed' (no file crosses nodes) or put the "
                             "output directory on a shared file system and set shared_fs true")

    @property
    def flushes(self) -> bool:
        """Whether an update flushes the servers' prefix cache (``flush_cache``; null: yes)."""
        return self.flush_cache is not False

    @property
    def resolved_master_addr(self) -> str:
        return self.master_addr or os.environ.get(HOST_ENV) or "127.0.0.1"

    @property
    def resolved_api_key(self) -> str | None:
        return self.api_key if self.api_key is not None else (os.environ.get(API_KEY_ENV) or None)

    def send_dtype(self, device_type: str):
        """The torch dtype floating tensors are sent in (None: as stored) on a trainer on ``device_type``."""
        import torch

        if self.dtype is None or (self.dtype == "auto" and device_type != "cuda"):
            return None  # fp32 on CPU: the CPU engine computes in fp32, behaviour log-probs must match
        return torch.bfloat16 if self.dtype == "auto" else getattr(torch, self.dtype)


FP8_BLOCK = (128, 128)
"""Rows x columns of one FP8 weight block (one ``weight_scale_inv`` each): ``weights.quantize: fp8``."""


def check_fp8_served_model(moe_intermediate_size: int | None, where: str) -> None:
    """``weights.quantize: fp8`` with launched SGLang or vLLM servers: both load block-FP8 MoE experts
    only when an expert's width is a whole number of blocks (SGLang refuses the layer; vLLM 0.32 on one
    rank shrinks its blocks and then cannot load one scale a 128 x 128 block). Dense models pass."""
    if moe_intermediate_size and moe_intermediate_size % FP8_BLOCK[0]:
        raise ValueError(f"weights.quantize 'fp8': {where} has moe_intermediate_size {moe_intermediate_size}, not a "
                         f"multiple of {FP8_BLOCK[0]}: SGLang and vLLM load FP8 experts only in whole "
                         f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks (the embedded engine serves it: rollout.server "
                         f"'embedded')")
