"""Hugging Face <-> SGLang weight layouts for Qwen2/Qwen2.5, Qwen3 and Llama.

Two layouts matter for weight sync (``docs/weight_sync.md``):

* **HF layout** (broadcast and disk paths): full tensors named as in the checkpoint; SGLang
  stacks and splits them itself. :meth:`ModelSpec.hf_shapes` lists them in sending order,
  without ``lm_head.weight`` when embeddings are tied and without rotary buffers.
* **SGLang layout** (colocated "direct" path): per TP rank, ``qkv_proj`` = [q heads of rank r;
  its k heads; its v heads] (kv heads replicated when ``kv_heads < tp``: rank r takes head
  ``r // (tp // kv_heads)``), ``gate_up_proj`` = [gate rows of r; up rows of r], ``o_proj`` and
  ``down_proj`` split by columns, embeddings and lm_head split by rows of the padded vocabulary
  (:func:`padded_vocab_size`; padding rows are zero), norms replicated.

Every SGLang parameter is described by :class:`Piece` s (2-D blocks of HF tensors, 1-D
tensors seen as ``[n, 1]``), so the same description drives the reference conversion here and
the C++ planner (``areal_fast.weights.plan.plan_tp_shards``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

VOCAB_PAD = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE
SKIPPED_RE = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
# Wrappers that prefix parameter names (torch.compile, activation checkpointing, FSDP1).
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
FAMILIES = ("qwen2", "qwen3", "llama")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of SGLang's vocab-parallel embedding / lm_head over ``tp`` ranks: the vocabulary is
    padded to a multiple of 64, and to a multiple of ``64 * tp`` only when that first size does
    not split evenly over ``tp`` ranks (Qwen's 151,936 stays 151,936 at tp 8; 64 * tp would give
    152,064). Each rank holds ``padded // tp`` rows."""
    if vocab_size < 1 or tp < 1:
        raise ValueError(f"vocab_size={vocab_size} and tp={tp} must be >= 1")
    pad = VOCAB_PAD
    if -(-vocab_size // pad) * pad % tp:
        pad *= tp
    return -(-vocab_size // pad) * pad


def clean_name(name: str) -> str:
    """Strip wrapper prefixes (``_orig_mod.`` etc.) from a parameter name."""
    for p in WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def is_skipped(name: str) -> bool:
    """Rotary caches are recomputed by the server and never sent."""
    return SKIPPED_RE.search(name) is not None


@dataclass(frozen=True)
class Piece:
    """Rows [row0, row0+n_rows) x cols [col0, col0+n_cols) of HF tensor ``hf_name`` land at
    row ``dst_row0`` (cols 0..n_cols) of the SGLang parameter."""

    hf_name: str
    row0: int
    col0: int
    n_rows: int
    n_cols: int
    dst_row0: int


@dataclass(frozen=True)
class SGLangParam:
    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def rows_cols(self) -> tuple[int, int]:
        return _rows_cols(self.shape)


def _rows_cols(shape) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    cols = 1
    for s in shape[1:]:
        cols *= s
    return shape[0], cols


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only model of one of the supported families."""

    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True; Llama/Qwen3: config.attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    mlp_bias: bool = False  # Llama mlp_bias
    qk_norm: bool = False  # Qwen3
    _shapes: dict = field(default=None, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelSpec.family={self.family!r}; supported: {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_hf_config(cls, cfg) -> ModelSpec:
        """Build from a ``transformers`` config (``Qwen2Config``, ``Qwen3Config``, ``LlamaConfig``)."""
        mt = getattr(cfg, "model_type", "")
        if mt not in FAMILIES:
            raise ValueError(f"model_type {mt!r} is not supported; supported: {FAMILIES}")
        nh = cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            family=mt,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=nh,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or nh,
            head_dim=hd,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else attn_bias,
            o_bias=False if mt == "qwen2" else attn_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)) if mt == "llama" else False,
            qk_norm=mt == "qwen3",
        )

    # ----------------------------------------------------------------------------- HF layout
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names -> shapes in state-dict order (lm_head omitted when tied)."""
        if self._shapes is not None:
            return self._shapes
        h, i_, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for li in range(self.num_layers):
            p = f"model.layers.{li}."
            for n, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                s[f"{p}self_attn.{n}.weight"] = (rows, h)
                if self.qkv_bias:
                    s[f"{p}self_attn.{n}.bias"] = (rows,)
            s[f"{p}self_attn.o_proj.weight"] = (h, q)
            if self.o_bias:
                s[f"{p}self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                s[f"{p}self_attn.q_norm.weight"] = (hd,)
                s[f"{p}self_attn.k_norm.weight"] = (hd,)
            for n, shape in (("gate_proj", (i_, h)), ("up_proj", (i_, h)), ("down_proj", (h, i_))):
                s[f"{p}mlp.{n}.weight"] = shape
                if self.mlp_bias:
                    s[f"{p}mlp.{n}.bias"] = shape[:1]
            s[f"{p}input_layernorm.weight"] = (h,)
            s[f"{p}post_attention_layernorm.weight"] = (h,)
        s["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (self.vocab_size, h)
        object.__setattr__(self, "_shapes", s)
        return s

    def check_hf_state(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise ValueError naming the first missing, extra or mis-shaped tensor."""
        want = self.hf_shapes()
        for n, shp in shapes.items():
            if n not in want:
                raise ValueError(f"tensor {n!r} is not part of a {self.family} model of this spec")
            if tuple(shp) != want[n]:
                raise ValueError(f"tensor {n!r} has shape {tuple(shp)}, the spec says {want[n]}")
        missing = [n for n in want if n not in shapes]
        if missing:
            raise ValueError(f"{len(missing)} tensors missing, first {missing[0]!r}")

    # ------------------------------------------------------------------------- SGLang layout
    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp)

    def kv_heads_on_rank(self, tp: int, rank: int) -> tuple[int, int]:
        """(first kv head, number of kv heads) held by TP rank ``rank``."""
        kv = self.num_kv_heads
        if kv >= tp:
            if kv % tp:
                raise ValueError(f"num_kv_heads={kv} is not divisible by tp={tp}")
            return rank * (kv // tp), kv // tp
        if tp % kv:
            raise ValueError(f"tp={tp} is not a multiple of num_kv_heads={kv} (kv heads cannot be replicated)")
        return rank // (tp // kv), 1

    def sglang_params(self, tp: int, rank: int) -> list[SGLangParam]:
        """SGLang parameters of TP rank ``rank`` with the HF pieces that fill them."""
        if not 0 <= rank < tp:
            raise ValueError(f"rank={rank} is not in [0, tp={tp})")
        for what, n in (("num_heads", self.num_heads), ("intermediate_size", self.intermediate_size)):
            if n % tp:
                raise ValueError(f"{what}={n} is not divisible by tp={tp}")
        hf = self.hf_shapes()
        h, hd = self.hidden_size, self.head_dim
        nq = self.num_heads // tp * hd
        kv0, nkv = self.kv_heads_on_rank(tp, rank)
        ni = self.intermediate_size // tp
        vp = self.padded_vocab(tp) // tp
        out: list[SGLangParam] = []

        def full(name):
            r, c = _rows_cols(hf[name])
            out.append(SGLangParam(name, hf[name], (Piece(name, 0, 0, r, c, 0),)))

        def vocab(name):
            v0 = min(rank * vp, self.vocab_size)
            n = min(vp, self.vocab_size - v0)
            out.append(SGLangParam(name, (vp, h), (Piece(name, v0, 0, n, h, 0),) if n > 0 else ()))

        def stacked(name, parts):  # parts: (hf_name, row0, n_rows), stacked along rows
            pieces, row = [], 0
            cols = _rows_cols(hf[parts[0][0]])[1]
            for src, r0, n in parts:
                pieces.append(Piece(src, r0, 0, n, cols, row))
                row += n
            shape = (row, cols) if len(hf[parts[0][0]]) == 2 else (row,)
            out.append(SGLangParam(name, shape, tuple(pieces)))

        def col_split(name, c0, n):
            rows = hf[name][0]
            out.append(SGLangParam(name, (rows, n), (Piece(name, 0, c0, rows, n, 0),)))

        vocab("model.embed_tokens.weight")
        for li in range(self.num_layers):
            a, m = f"model.layers.{li}.self_attn.", f"model.layers.{li}.mlp."
            for suf in ("weight", "bias") if self.qkv_bias else ("weight",):
                stacked(
                    f"{a}qkv_proj.{suf}",
                    [(f"{a}q_proj.{suf}", rank * nq, nq), (f"{a}k_proj.{suf}", kv0 * hd, nkv * hd),
                     (f"{a}v_proj.{suf}", kv0 * hd, nkv * hd)],
                )
            col_split(f"{a}o_proj.weight", rank * nq, nq)
            if self.o_bias:
                full(f"{a}o_proj.bias")
            if self.qk_norm:
                full(f"{a}q_norm.weight")
                full(f"{a}k_norm.weight")
            for suf in ("weight", "bias") if self.mlp_bias else ("weight",):
                stacked(f"{m}gate_up_proj.{suf}",
                        [(f"{m}gate_proj.{suf}", rank * ni, ni), (f"{m}up_proj.{suf}", rank * ni, ni)])
            col_split(f"{m}down_proj.weight", rank * ni, ni)
            if self.mlp_bias:
                full(f"{m}down_proj.bias")
            full(f"model.layers.{li}.input_layernorm.weight")
            full(f"model.layers.{li}.post_attention_layernorm.weight")
        full("model.norm.weight")
        if not self.tie_word_embeddings:
            vocab("lm_head.weight")
        return out


def sendable(state: dict, spec: ModelSpec) -> dict:
    """The entries of an HF state dict that are sent: no rotary caches, no tied lm_head."""
    return {
        n: t
        for n, t in state.items()
        if not is_skipped(n) and not (spec.tie_word_embeddings and n == "lm_head.weight")
    }


def hf_to_sglang(state: dict[str, torch.Tensor], spec: ModelSpec, tp: int) -> list[dict[str, torch.Tensor]]:
    """Reference: full HF tensors -> one SGLang-layout state dict per TP rank (padding rows zero)."""
    spec.check_hf_state({n: tuple(t.shape) for n, t in sendable(state, spec).items()})
    shards = []
    for r in range(tp):
        d = {}
        for p in spec.sglang_params(tp, r):
            ref = state[p.pieces[0].hf_name] if p.pieces else state["model.embed_tokens.weight"]
            t = torch.zeros(p.shape, dtype=ref.dtype)
            t2 = t.view(p.rows_cols)
            for pc in p.pieces:
                src = state[pc.hf_name].reshape(_rows_cols(state[pc.hf_name].shape))
                t2[pc.dst_row0 : pc.dst_row0 + pc.n_rows, : pc.n_cols] = src[
                    pc.row0 : pc.row0 + pc.n_rows, pc.col0 : pc.col0 + pc.n_cols
                ]
            d[p.name] = t
        shards.append(d)
    return shards


def sglang_to_hf(shards: list[dict[str, torch.Tensor]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Reference inverse of :func:`hf_to_sglang`. Replicated pieces (kv heads, norms) must agree
    across ranks; a disagreement raises ValueError naming the tensor."""
    tp = len(shards)
    hf = spec.hf_shapes()
    dtype = next(iter(shards[0].values())).dtype
    out = {n: torch.empty(s, dtype=dtype) for n, s in hf.items()}
    written: dict[str, torch.Tensor] = {n: torch.zeros(_rows_cols(s), dtype=torch.bool) for n, s in hf.items()}
    for r in range(tp):
        for p in spec.sglang_params(tp, r):
            t = shards[r][p.name]
            if tuple(t.shape) != p.shape:
                raise ValueError(f"TP rank {r}: {p.name} has shape {tuple(t.shape)}, expected {p.shape}")
            t2 = t.reshape(p.rows_cols)
            for pc in p.pieces:
                dst = out[pc.hf_name].view(_rows_cols(hf[pc.hf_name]))
                sl = (slice(pc.row0, pc.row0 + pc.n_rows), slice(pc.col0, pc.col0 + pc.n_cols))
                val = t2[pc.dst_row0 : pc.dst_row0 + pc.n_rows, : pc.n_cols]
                w = written[pc.hf_name][sl]
                if w.any() and not torch.equal(dst[sl][w], val[w]):
                    raise ValueError(f"replicas of {pc.hf_name} disagree (seen again on TP rank {r} in {p.name})")
                dst[sl] = val
                w.fill_(True)
    for n, w in written.items():
        if not bool(w.all()):
            raise ValueError(f"{n} is not fully covered by the TP shards")
    return out
