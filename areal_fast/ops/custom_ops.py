"""torch.library registration of the [T, V] parts of the decoupled-PPO loss.

Custom ops (namespace ``areal_fast``), each with a fake kernel so ``torch.compile`` traces
through them, and autograd registered on the differentiable ones:

  * ``ppo_token_stats(logits, labels, temperature, grad_inplace, backend) -> (logp, entropy, lse)``
  * ``ppo_token_stats_bwd(grad_out!, logits, labels, lse, entropy, grad_logp, grad_entropy,
    temperature, backend)`` writes dloss/dlogits into ``grad_out`` (which may be ``logits``)
  * ``fused_linear_token_stats(hidden, weight, bias, labels, temperature, chunk_size, backend)``
  * ``fused_linear_token_stats_bwd(...) -> (grad_hidden, grad_weight, grad_bias)``
  * ``fused_linear_ppo_single_pass(..., *op_args(config)) -> (logp, entropy, grad_hidden,
    grad_weight, grad_bias)`` (token-level objectives: the gradients during the forward, no
    recompute); call it through the Python function of the same name, which takes a
    :class:`PPOLossConfig` (``op_args`` is the one place that flattens it)
  * ``attach_grads(value, hidden, weight, bias, gh, gw, gb) -> value`` (its backward hands the
    precomputed gradients, scaled by the incoming one, to hidden / weight / bias)

``backend`` is 'triton' / 'interpret' (the kernels of ``areal_fast.kernels.ppo_loss``) or
'reference' (row-chunked PyTorch, bounded memory, same formulas). The public functions in
``ppo_loss.py``/``fused_linear.py`` choose it with ``areal_fast.dispatch.select``.

Dtypes: the [T] outputs (logp, entropy, lse) and the math behind them are fp32 for fp32, bf16 and
fp16 inputs and fp64 for fp64 inputs (``ppo_loss_ref.math_dtype``), as in docs/objective.md. The
Triton kernels compute in fp32 only, so fp64 logits (or hidden states) take the reference formulas
on every backend; the fused-linear weight and bias gradients accumulate in fp64 then too.
"""

# No `from __future__ import annotations` here: torch.library.custom_op reads the annotations
# at runtime to infer the op schemas.
import contextlib
import logging
import typing
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .loss_config import LOSS_OPTION_NAMES, PPOLossConfig
from .objective import per_token_grads, token_constants
from .ppo_loss_ref import math_dtype, row_stats_ref

_log = logging.getLogger(__name__)

# Reference backend: rows per chunk so one fp32 chunk is ~64 Mi elements (256 MiB) at most.
_REF_CHUNK_ELEMS = 1 << 26


def _ref_rows(V: int) -> int:
    return max(1, _REF_CHUNK_ELEMS // max(V, 1))


# ----------------------------------------------------------------------------------------------
# implementations on a [T, V] block of logits


def _kernels(backend: str, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels run: asked for, and the math is fp32 (they have no fp64 path)."""
    return backend in ("triton", "interpret") and math_dtype(dtype) == torch.float32


def _stats_impl(logits: Tensor, labels: Tensor, temperature: float, backend: str):
    if _kernels(backend, logits.dtype):
        from areal_fast.kernels.ppo_loss import token_stats_fwd

        return token_stats_fwd(logits, labels.contiguous(), temperature)
    T, V = logits.shape
    logp = torch.empty(T, dtype=math_dtype(logits.dtype), device=logits.device)
    ent, lse = torch.empty_like(logp), torch.empty_like(logp)
    step = _ref_rows(V)
    with torch.no_grad():  # the op's backward is its own (closed form), not autograd of this
        for a in range(0, T, step):
            b = min(T, a + step)
            logp[a:b], ent[a:b], lse[a:b] = row_stats_ref(logits[a:b], labels[a:b], temperature)
    return logp, ent, lse


def _bwd_impl(grad_out, logits, labels, lse, ent, grad_logp, grad_ent, temperature: float, backend: str) -> None:
    if _kernels(backend, logits.dtype):
        from areal_fast.kernels.ppo_loss import token_stats_bwd

        token_stats_bwd(grad_out, logits, labels.contiguous(), lse, ent, grad_logp.float(), grad_ent.float(),
                        temperature)
        return
    T, V = logits.shape
    step = _ref_rows(V)
    md = math_dtype(logits.dtype)
    for a in range(0, T, step):
        b = min(T, a + step)
        x = logits[a:b].to(md) / temperature
        logP = x - lse[a:b, None].to(md)
        P = logP.exp()
        g = grad_logp[a:b, None].to(md)
        e = grad_ent[a:b, None].to(md)
        onehot = torch.zeros_like(P).scatter_(1, labels[a:b].clamp(0, V - 1).long()[:, None], 1.0)
        onehot = onehot * ((labels[a:b] >= 0) & (labels[a:b] < V))[:, None]
        ent_term = torch.where(P > 0, P * (logP + ent[a:b, None].to(md)), torch.zeros_like(P))
        dz = (g * (onehot - P) - e * ent_term) / temperature
        # rows with g = e = 0 (prompt, padding and dropped tokens) get exact zeros whatever their
        # logits hold, as from the Triton kernel (0 * NaN would put NaN there for a NaN logit)
        live = (g != 0) | (e != 0)
        grad_out[a:b] = torch.where(live, dz, torch.zeros_like(dz)).to(grad_out.dtype)


# ----------------------------------------------------------------------------------------------
# ops on logits


@torch.library.custom_op("areal_fast::ppo_token_stats", mutates_args=())
def ppo_token_stats(logits: Tensor, labels: Tensor, temperature: float, grad_inplace: bool,
                    backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse), [T] in ``math_dtype(logits.dtype)`` (fp32; fp64 for fp64 logits); lse is
    of logits / temperature (for the backward)."""
    return _stats_impl(logits, labels, temperature, backend)


@ppo_token_stats.register_fake
def _(logits, labels, temperature, grad_inplace, backend):
    T = logits.shape[0]
    return tuple(logits.new_empty(T, dtype=math_dtype(logits.dtype)) for _ in range(3))


@torch.library.custom_op("areal_fast::ppo_token_stats_bwd", mutates_args=("grad_out",))
def ppo_token_stats_bwd(grad_out: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, ent: Tensor,
                        grad_logp: Tensor, grad_ent: Tensor, temperature: float, backend: str) -> None:
    """dloss/dlogits = (g (onehot - P) - e P (log P + H)) / tau, written into ``grad_out``."""
    _bwd_impl(grad_out, logits, labels, lse, ent, grad_logp, grad_ent, temperature, backend)


@ppo_token_stats_bwd.register_fake
def _(grad_out, logits, labels, lse, ent, grad_logp, grad_ent, temperature, backend):
    return None


def _token_stats_setup(ctx, inputs, output):
    logits, labels, temperature, grad_inplace, backend = inputs
    _, ent, lse = output
    ctx.save_for_backward(logits, labels, lse, ent)
    ctx.temperature, ctx.grad_inplace, ctx.backend = temperature, grad_inplace, backend
    ctx.mark_non_differentiable(lse)


def _token_stats_backward(ctx, grad_logp, grad_ent, _grad_lse):
    logits, labels, lse, ent = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    if grad_ent is None:
        grad_ent = torch.zeros_like(lse)
    grad = logits if ctx.grad_inplace else torch.empty_like(logits)
    torch.ops.areal_fast.ppo_token_stats_bwd(grad, logits, labels, lse, ent, grad_logp, grad_ent,
                                             ctx.temperature, ctx.backend)
    return grad, None, None, None, None


ppo_token_stats.register_autograd(_token_stats_backward, setup_context=_token_stats_setup)


# ----------------------------------------------------------------------------------------------
# fused-linear ops: logits = hidden @ weight.T (+ bias), one chunk of rows at a time


def _chunks(T: int, chunk_size: int):
    for a in range(0, T, chunk_size):
        yield a, min(T, a + chunk_size)


@torch.library.custom_op("areal_fast::fused_linear_token_stats", mutates_args=())
def fused_linear_token_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                             temperature: float, chunk_size: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse) of softmax((hidden @ weight.T + bias) / tau), in ``math_dtype(hidden.dtype)``;
    peak extra memory one chunk."""
    T = hidden.shape[0]
    logp = hidden.new_empty(T, dtype=math_dtype(hidden.dtype))
    ent, lse = torch.empty_like(logp), torch.empty_like(logp)
    for a, b in _chunks(T, chunk_size):
        z = F.linear(hidden[a:b], weight, bias)
        logp[a:b], ent[a:b], lse[a:b] = _stats_impl(z, labels[a:b], temperature, backend)
    return logp, ent, lse


@fused_linear_token_stats.register_fake
def _(hidden, weight, bias, labels, temperature, chunk_size, backend):
    T = hidden.shape[0]
    return tuple(hidden.new_empty(T, dtype=math_dtype(hidden.dtype)) for _ in range(3))


# Whether torch.addmm(acc_fp32, a_lowp, b_lowp, out_dtype=float32, out=acc_fp32) runs on a device
# type and input dtype (cuBLAS does on CUDA for bf16/fp16 since torch 2.8; CPU does not in 2.13),
# and, where it does not, what the probe said.
_FP32_ADDMM_OK: dict[tuple[str, torch.dtype], bool] = {}
_FP32_ADDMM_WHY: dict[tuple[str, torch.dtype], str] = {}
# (device type, dtype) pairs already warned about the fp32 fallback: one warning per process each.
_FALLBACK_WARNED: set[tuple[str, torch.dtype]] = set()
# (device type, dtype) pairs whose grad_weight path was already logged.
_PATH_LOGGED: set[tuple[str, torch.dtype]] = set()

# The three ways grad_weight += dz^T @ h can run (recorded in the benchmark rows).
PATH_FP32_INPUTS = "fp32 inputs: fp32 GEMM"
PATH_FP32_OUT = "low-precision GEMM, fp32 accumulation inside it (out_dtype=float32)"
PATH_UPCAST = "FALLBACK: inputs upcast to fp32, fp32 GEMM (TF32 allowed on CUDA: exact for bf16/fp16 inputs)"
# The first torch whose addmm takes out_dtype=float32 for bf16/fp16 inputs on CUDA.
OUT_DTYPE_TORCH = "2.8"


def fp32_addmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per (device type, dtype) whether the GEMM can accumulate low-precision inputs
    into an fp32 output itself; cached, so the cost is one tiny GEMM per process."""
    key = (device.type, dtype)
    if key not in _FP32_ADDMM_OK:
        ok, why = False, "fp32 inputs"
        if dtype != torch.float32:
            try:
                acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
                a = torch.ones(2, 2, dtype=dtype, device=device)
                torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
                ok = bool(acc[0, 0] == 2.0)
                why = "" if ok else f"torch.addmm(..., out_dtype=torch.float32) gave {float(acc[0, 0])}, not 2.0"
            except (RuntimeError, NotImplementedError, TypeError) as e:
                first_line = (str(e).strip().splitlines() or [""])[0][:200]
                ok, why = False, f"torch.addmm(..., out_dtype=torch.float32) raised {type(e).__name__}: {first_line}"
        _FP32_ADDMM_OK[key] = ok
        _FP32_ADDMM_WHY[key] = why
    return _FP32_ADDMM_OK[key]


def weight_grad_path(device: torch.device, dtype: torch.dtype) -> str:
    """Which GEMM ``addmm_fp32_`` runs for inputs of ``dtype`` on ``device`` (one of PATH_*)."""
    if dtype in (torch.float32, torch.float64):
        return PATH_FP32_INPUTS
    return PATH_FP32_OUT if fp32_addmm_supported(device, dtype) else PATH_UPCAST


class GradPath(typing.NamedTuple):
    """The fused-linear weight-gradient GEMM: ``name`` is 'addmm_out_dtype' (bf16/fp16 GEMM
    accumulating into the fp32 accumulator itself), 'fp32_fallback' (inputs upcast to fp32, an fp32
    GEMM, TF32 allowed on CUDA), 'fp32_inputs' or 'fp64_inputs'; ``reason`` says why, in words."""
    name: str
    reason: str


def fused_linear_grad_path(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> GradPath:
    """Which GEMM accumulates the fused-linear grad_weight for inputs of ``dtype`` on ``device``
    (default: the current CUDA device if there is one, else the CPU), and why. Probes once."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype in (torch.float32, torch.float64):
        name = "fp32_inputs" if dtype == torch.float32 else "fp64_inputs"
        return GradPath(name, f"{dtype} inputs: the GEMM runs in {dtype}, accumulating into the {dtype} "
                              "accumulator; no low-precision product to widen")
    key = (device.type, dtype)
    if fp32_addmm_supported(device, dtype):
        return GradPath("addmm_out_dtype", f"torch {torch.__version__} accumulates {dtype} GEMMs into an fp32 "
                                           f"output on {device.type} (torch.addmm(..., out_dtype=torch.float32))")
    why = _FP32_ADDMM_WHY.get(key) or "the capability check said no"
    if device.type == "cuda":
        gemm = ("an fp32 GEMM with TF32 allowed for it (exact for bf16/fp16 inputs; about half the bf16 "
                "tensor-core rate, plus the fp32 copies)")
        fix = f"Install torch >= {OUT_DTYPE_TORCH} (CUDA build) for the fast path."
    else:
        gemm = "an fp32 GEMM"
        fix = f"The fast path is torch >= {OUT_DTYPE_TORCH} on a CUDA device."
    return GradPath("fp32_fallback", f"torch {torch.__version__} cannot accumulate {dtype} GEMMs in fp32 on "
                                     f"{device.type} ({why}), so each grad_weight chunk upcasts dz and h to fp32 "
                                     f"and runs {gemm}. {fix}")


@contextlib.contextmanager
def tf32_matmul(device: torch.device):
    """Allow TF32 for the fp32 GEMMs of this block on CUDA (yields whether it applies), then put
    the process's setting back exactly. For fp32 copies of bf16/fp16 values TF32 changes nothing:
    their significands (8 and 11 bits) fit TF32's 11, the products are exact and the sums fp32, as
    in the bf16 GEMM with an fp32 output; only the speed differs (~7x the plain fp32 rate on an
    H100). Uses the API the process used: torch >= 2.9 raises when the legacy flag is read after
    only the new one (``fp32_precision``) was set. The setting is process-wide while the block
    runs: a GEMM launched by another thread meanwhile may use TF32 too."""
    if device.type != "cuda":
        yield False
        return
    m = torch.backends.cuda.matmul
    new = getattr(m, "fp32_precision", None)
    try:
        legacy = m.allow_tf32
    except RuntimeError:  # set through the new API only: stay with it
        legacy = None
    if legacy is True or (legacy is None and new == "tf32"):
        yield True  # already on
        return
    try:
        if legacy is None:
            m.fp32_precision = "tf32"
        else:
            m.allow_tf32 = True  # sets the legacy and the new flag together (consistent)
        yield True
    finally:
        if legacy is not None:
            m.allow_tf32 = False
        if new is not None:
            m.fp32_precision = new  # e.g. back to 'none' (inherit) rather than the 'ieee' set above


def _say_path_once(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """Log once per process and (device type, dtype) which grad_weight GEMM runs; the fallback
    also warns (RuntimeWarning and log.warning), with the reason and what to install."""
    key = (device.type, dtype)
    fallback = not fp32_addmm_supported(device, dtype)  # cached: no probe after the first call
    said = _FALLBACK_WARNED if fallback else _PATH_LOGGED
    if key in said:
        return
    said.add(key)
    path = fused_linear_grad_path(device, dtype)
    if not fallback:
        _log.info("areal_fast fused-linear grad_weight GEMM: %s (%s)", path.name, path.reason)
        return
    m, k, n = shape
    msg = (f"areal_fast fused-linear loss, grad_weight GEMM path '{path.name}': {path.reason} "
           f"(chunks of dz [{k}, {m}] and h [{k}, {n}]; without TF32 the fp32 GEMM cost ~0.7 s a step "
           "at T = 32k, H = 3584, V = 151,936 on an H100). areal_fast.ops.fused_linear_grad_path() says "
           "which path runs.")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    _log.warning(msg)


def addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and the products summed in fp32, with no rounding of the
    partial product to the inputs' dtype. Uses the GEMM's fp32 output where the installed torch
    supports it (no extra traffic); else upcasts the inputs and runs an fp32 GEMM with TF32
    allowed on CUDA (``tf32_matmul``: exact for bf16/fp16 values, at the cost of the fp32 copies),
    and says so once per process and (device type, dtype), loudly."""
    path = weight_grad_path(acc.device, a.dtype)
    if path == PATH_FP32_INPUTS:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
        return
    _say_path_once(acc.device, a.dtype, (a.shape[0], a.shape[1], b.shape[1]))
    if path == PATH_FP32_OUT:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        a32, b32 = a.float(), b.float()
        with tf32_matmul(acc.device):
            acc.addmm_(a32, b32)


class _LinearGrads:
    """grad_hidden, grad_weight and grad_bias of z = h W^T + bias, accumulated chunk by chunk from
    dz (written into the chunk's logits buffer). grad_weight is accumulated in fp32 *inside* the
    GEMM (``addmm_fp32_``): rounding each chunk's [V, H] product to bf16 before adding it cost
    ~2^-9 relative error per chunk and a full extra read/write of [V, H]; grad_bias is a column sum
    with an fp32 accumulator (no fp32 copy of the chunk). Both accumulate in fp64 for fp64 weights.
    Unneeded outputs are [0]."""

    def __init__(self, hidden, weight, bias, need_hidden: bool, need_weight: bool, need_bias: bool):
        self.weight, self.bias = weight, bias
        acc = math_dtype(weight.dtype)
        self.gh = torch.empty_like(hidden) if need_hidden else None
        self.gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        self.gb = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_bias else None

    def add_chunk(self, a: int, b: int, h: Tensor, dz: Tensor) -> None:
        if self.gh is not None:
            torch.mm(dz, self.weight, out=self.gh[a:b])
        if self.gw is not None:
            addmm_fp32_(self.gw, dz.t(), h)
        if self.gb is not None:
            self.gb += dz.sum(0, dtype=self.gb.dtype)

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        # a fresh [0] per missing output: custom ops may not return aliased tensors
        empty = self.weight.new_empty
        return (empty(0) if self.gh is None else self.gh,
                empty(0) if self.gw is None else self.gw.to(self.weight.dtype),
                empty(0) if self.gb is None else self.gb.to(self.bias.dtype))


@torch.library.custom_op("areal_fast::fused_linear_token_stats_bwd", mutates_args=())
def fused_linear_token_stats_bwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, lse: Tensor,
                                 ent: Tensor, grad_logp: Tensor, grad_ent: Tensor, temperature: float,
                                 chunk_size: int, backend: str, need_hidden: bool, need_weight: bool,
                                 need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias); each is empty [0] when not needed.

    Recomputes each chunk of logits, writes dz into it in place, then grad_hidden = dz @ W and
    grad_weight += dz^T @ h (see ``_LinearGrads`` for the fp32 accumulation).
    """
    T = hidden.shape[0]
    grads = _LinearGrads(hidden, weight, bias, need_hidden, need_weight, need_bias)
    for a, b in _chunks(T, chunk_size):
        h = hidden[a:b]
        z = F.linear(h, weight, bias)
        _bwd_impl(z, z, labels[a:b], lse[a:b], ent[a:b], grad_logp[a:b], grad_ent[a:b], temperature, backend)
        grads.add_chunk(a, b, h, z)
    gh, gw, gb = grads.result()
    return gh, gw, gb


@fused_linear_token_stats_bwd.register_fake
def _(hidden, weight, bias, labels, lse, ent, grad_logp, grad_ent, temperature, chunk_size, backend,
      need_hidden, need_weight, need_bias):
    gh = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    gb = weight.new_empty(weight.shape[0], dtype=bias.dtype) if need_bias else weight.new_empty(0)
    return gh, gw, gb


def _fl_setup(ctx, inputs, output):
    hidden, weight, bias, labels, temperature, chunk_size, backend = inputs
    _, ent, lse = output
    ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
    ctx.args = (temperature, chunk_size, backend)
    ctx.mark_non_differentiable(lse)


def _fl_backward(ctx, grad_logp, grad_ent, _grad_lse):
    hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    if grad_ent is None:
        grad_ent = torch.zeros_like(lse)
    nh, nw, nb = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
    gh, gw, gb = torch.ops.areal_fast.fused_linear_token_stats_bwd(
        hidden, weight, bias, labels, lse, ent, grad_logp, grad_ent, *ctx.args, nh, nw, nb)
    return (gh if nh else None), (gw if nw else None), (gb if nb else None), None, None, None, None


fused_linear_token_stats.register_autograd(_fl_backward, setup_context=_fl_setup)


# ----------------------------------------------------------------------------------------------
# fused-linear single pass: when every token's loss depends on its own l_t and H_t only
# (importance_level="token"), g_t = dloss/dl_t and e_t = dloss/dH_t are known as soon as a chunk's
# statistics are, so the gradients are computed in the forward: 3 GEMMs instead of 4.


def op_args(config: PPOLossConfig) -> tuple:
    """The one place a :class:`PPOLossConfig` becomes custom-op arguments (torch.library schemas
    take scalars, not dataclasses), in the order of ``PPOLossConfig``'s fields."""
    return tuple(getattr(config, name) for name in LOSS_OPTION_NAMES)


def _config_from_op_args(args) -> PPOLossConfig:
    return PPOLossConfig(**dict(zip(LOSS_OPTION_NAMES, args)))


def _options_schema() -> str:
    """The op-schema text of ``op_args``, derived from PPOLossConfig's annotations (no list of the
    options is written out here)."""
    kinds = {float: "float", float | None: "float?", str: "str", int: "int", bool: "bool"}
    hints = typing.get_type_hints(PPOLossConfig)
    return ", ".join(f"{kinds[hints[name]]} {name}" for name in LOSS_OPTION_NAMES)


_SINGLE_PASS = "areal_fast::fused_linear_ppo_single_pass"
torch.library.define(
    _SINGLE_PASS,
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor behav_logprobs, Tensor adv, Tensor mask, "
    "Tensor? prox, Tensor? ref, Tensor? cu_seqlens, Tensor coef, SymInt chunk_size, str backend, bool need_hidden, "
    f"bool need_weight, bool need_bias, {_options_schema()}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.impl(_SINGLE_PASS, "CompositeExplicitAutograd")
def _fused_linear_ppo_single_pass(hidden, weight, bias, labels, behav_logprobs, adv, mask, prox, ref, cu_seqlens,
                                  coef, chunk_size, backend, need_hidden, need_weight, need_bias, *options):
    cfg = _config_from_op_args(options)  # the trailing scalars are op_args(config)
    T = hidden.shape[0]
    md = math_dtype(hidden.dtype)
    C = token_constants(behav_logprobs, adv, mask, prox, ref, md, hidden.device, cfg, cu_seqlens)
    coef = coef.to(md)
    logp = hidden.new_empty(T, dtype=md)
    ent = torch.empty_like(logp)
    grads = _LinearGrads(hidden, weight, bias, need_hidden, need_weight, need_bias)
    for a, b in _chunks(T, chunk_size):
        h = hidden[a:b]
        z = F.linear(h, weight, bias)
        lp_c, ent_c, lse_c = _stats_impl(z, labels[a:b], cfg.temperature, backend)
        logp[a:b], ent[a:b] = lp_c, ent_c
        g, e = per_token_grads(lp_c, ent_c, C.slice(a, b), cfg)
        g, e = coef[a:b] * g, coef[a:b] * e
        _bwd_impl(z, z, labels[a:b], lse_c, ent_c, g, e, cfg.temperature, backend)
        grads.add_chunk(a, b, h, z)
    gh, gw, gb = grads.result()
    return logp, ent, gh, gw, gb


@torch.library.register_fake(_SINGLE_PASS)
def _(hidden, weight, bias, labels, behav_logprobs, adv, mask, prox, ref, cu_seqlens, coef, chunk_size, backend,
      need_hidden, need_weight, need_bias, *options):
    T = hidden.shape[0]
    gh = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    gb = weight.new_empty(weight.shape[0], dtype=bias.dtype) if need_bias else weight.new_empty(0)
    md = math_dtype(hidden.dtype)
    return hidden.new_empty(T, dtype=md), hidden.new_empty(T, dtype=md), gh, gw, gb


def fused_linear_ppo_single_pass(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                                 behav_logprobs: Tensor, adv: Tensor, mask: Tensor, prox: Tensor | None,
                                 ref: Tensor | None, coef: Tensor, config: PPOLossConfig, chunk_size: int,
                                 backend: str, need_hidden: bool, need_weight: bool, need_bias: bool,
                                 cu_seqlens: Tensor | None = None):
    """(logp, entropy, grad_hidden, grad_weight, grad_bias) of loss = sum_t coef_t L_t, through the
    custom op ``areal_fast::fused_linear_ppo_single_pass``.

    ``config`` must be token-level; ``coef`` the aggregation weights
    (``objective.aggregation_weights``). g and e come from ``objective.per_token_grads``
    (the closed-form derivative of ``per_token_loss``, the function the loss value comes from;
    autograd is not available below the dispatcher's autograd layer, where the op runs).
    Gradients not needed are empty [0]. ``cu_seqlens`` is needed for sequence-level MIS (a
    constant per token, so the single pass still applies).
    """
    if config.importance_level != "token":
        raise ValueError("the single pass needs importance_level='token' (sequence-level ratios couple tokens)")
    return torch.ops.areal_fast.fused_linear_ppo_single_pass(
        hidden, weight, bias, labels, behav_logprobs, adv, mask, prox, ref, cu_seqlens, coef, chunk_size, backend,
        need_hidden, need_weight, need_bias, *op_args(config))


@torch.library.custom_op("areal_fast::attach_grads", mutates_args=())
def attach_grads(value: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None, grad_hidden: Tensor,
                 grad_weight: Tensor, grad_bias: Tensor) -> Tensor:
    """``value`` (a copy), whose backward hands ``grad_out * grad_*`` to hidden, weight and bias.

    Makes the loss of the single-pass path differentiable with gradients computed in advance.
    """
    return value.clone()


@attach_grads.register_fake
def _(value, hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
    return torch.empty_like(value)


def _attach_setup(ctx, inputs, output):
    _, _, _, bias, gh, gw, gb = inputs
    ctx.save_for_backward(gh, gw, gb)
    ctx.has_bias = bias is not None


def _attach_backward(ctx, grad):
    gh, gw, gb = ctx.saved_tensors
    nh, nw = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    nb = ctx.has_bias and ctx.needs_input_grad[3]
    return (None, grad * gh if nh else None, grad * gw if nw else None, grad * gb if nb else None, None, None, None)


attach_grads.register_autograd(_attach_backward, setup_context=_attach_setup)
