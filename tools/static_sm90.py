"""Static sm_90a proof, no GPU needed: compile every kernel for an H100 and read the machine code.

    python tools/static_sm90.py [--fast] [--no-cuda] [--out FILE | --no-results]

* Triton: every kernel of ``kernels/`` is compiled for ``GPUTarget("cuda", 90, 32)`` (sm_90a)
  with the installed Triton, by calling its *real launcher* (``token_stats_fwd``,
  ``segment_copy``, ``unpack_rows``, the delta codec's ``count_blocks`` / ``encode`` /
  ``apply``, ...) on CPU tensors of the production shapes under a stand-in driver that
  compiles instead of launching: the block sizes, ``num_warps`` and the specialisations
  (16-divisible strides and pointers) are the ones production gets, not a copy of them. Every
  kind of packing launch is compiled, several mixed columns in one launch included.
* CUDA: every ``csrc/**/*.cu`` with ``nvcc -arch=sm_90a -Xptxas -v`` (the build's defines and
  include path).

Per kernel it records ptxas's registers, spill store/load bytes, stack and shared memory, and
from the disassembled cubin (``cuobjdump -sass``) every loop (a backward branch and its body):
instructions, local-memory instructions (STL/LDL: spills) and global bytes moved per thread.
The *hot loop* is the loop that moves the most global bytes (ties: the smaller body); its
instructions divided by the elements each thread handles per iteration is ``sass_per_element``.
A spill inside any loop is an error (exit status 1); a kernel without a loop (the delta
kernels) is measured over its whole body, where a spill is an error too. Results go to
``bench/results/static_sm90-triton<version>.json``; see docs/static_sm90.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
CAPABILITY = 90
# Production shapes: Qwen2.5-7B's lm_head (V = 151,936 rows, H = 3,584) in bf16.
VOCAB, HIDDEN = 151_936, 3_584
FAST_VOCABS = (VOCAB,)
FULL_VOCABS = (VOCAB, 152_064, 32_000)
# Packing: T tokens in B sequences; 4,097 as well, since the JIT specialises a 16-divisible T.
TOKENS, SEQS = 4096, 16
# Delta codec: the largest tensor of a 7B model (its embedding / lm_head, 544.5 M 16-bit words)
# and an update that changes 2.4 % of it (docs/weight_sync.md), a count that is not 16-divisible.
DELTA_WORDS = VOCAB * HIDDEN
DELTA_CHANGED = round(DELTA_WORDS * 0.024)


# ----------------------------------------------------------------------------------- SASS reading
@dataclass
class Loop:
    """One loop of the disassembly: the body from the branch target to the backward branch.
    ``own_*`` leave out the loops nested in it (an outer loop's own work is per-block overhead)."""
    start: int
    end: int
    instructions: int
    spill_instructions: int  # STL / LDL: local memory, i.e. spills (these kernels have no local arrays)
    ld_bytes: int  # global bytes loaded per thread per pass through the body
    st_bytes: int
    own_instructions: int = 0
    own_ld_bytes: int = 0
    own_st_bytes: int = 0
    own_vector_bytes: int = 0  # of those, moved by 16- or 32-byte accesses (data, not indices)


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_WIDTH = re.compile(r"\.(?:U|S)?(8|16|32|64|128)\b")


def _mem_bytes(op: str) -> int:
    """Bytes per thread of a LDG/STG/LDL/STL (32-bit when the opcode names no width)."""
    m = _WIDTH.search(op)
    return int(m.group(1)) // 8 if m else 4


def parse_sass(text: str) -> dict[str, list[tuple[int, str]]]:
    """``{function: [(address, instruction), ...]}`` of ``cuobjdump -sass`` output (no NOPs)."""
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        if "Function :" in line:
            cur = funcs.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        m = _INSN.search(line)
        if m and cur is not None and not m.group(2).startswith("NOP"):
            cur.append((int(m.group(1), 16), m.group(2)))
    return funcs


def _opcode(insn: str) -> str:
    parts = insn.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def _region(body: list[str], start: int, end: int) -> Loop:
    """A stretch of instructions as a :class:`Loop` (its ``own_*`` still counting nested loops)."""
    ops = [_opcode(x) for x in body]
    return Loop(
        start=start, end=end, instructions=len(ops),
        spill_instructions=sum(o.startswith(("STL", "LDL")) for o in ops),
        ld_bytes=sum(_mem_bytes(o) for o in ops if o.startswith("LDG")),
        st_bytes=sum(_mem_bytes(o) for o in ops if o.startswith("STG")),
        own_instructions=len(ops),
        own_vector_bytes=sum(_mem_bytes(o) for o in ops if o.startswith(("LDG", "STG")) and _mem_bytes(o) >= 16))


def straight_body(insns: list[tuple[int, str]]) -> Loop | None:
    """A kernel without loops (one block per program: the delta kernels) as one region, from its
    first instruction to its last EXIT: there the body is the hot path, run once by every program."""
    exits = [i for i, (_, x) in enumerate(insns) if _opcode(x) == "EXIT"]
    if not insns or not exits:
        return None
    body = insns[: exits[-1] + 1]
    lp = _region([x for _, x in body], body[0][0], body[-1][0])
    lp.own_ld_bytes, lp.own_st_bytes = lp.ld_bytes, lp.st_bytes
    return lp


def find_loops(insns: list[tuple[int, str]]) -> list[Loop]:
    """Every backward branch (``BRA`` to a lower address, not the self-branch after EXIT)."""
    loops = []
    for i, (addr, insn) in enumerate(insns):
        m = re.search(r"\bBRA\S*\s+(0x[0-9a-f]+)", insn)
        if not m or not _opcode(insn).startswith("BRA"):
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        loops.append(_region([x for a, x in insns[: i + 1] if a >= target], target, addr))
    for lp in loops:
        inner = [c for c in loops if c is not lp and lp.start <= c.start and c.end <= lp.end]
        children = [c for c in inner if not any(o is not c and o.start <= c.start and c.end <= o.end for o in inner)]
        lp.own_instructions = lp.instructions - sum(c.instructions for c in children)
        lp.own_ld_bytes = lp.ld_bytes - sum(c.ld_bytes for c in children)
        lp.own_st_bytes = lp.st_bytes - sum(c.st_bytes for c in children)
    totals = {id(lp): lp.own_vector_bytes for lp in loops}  # still the whole body's here
    for lp in loops:
        inner = [c for c in loops if c is not lp and lp.start <= c.start and c.end <= lp.end]
        children = [c for c in inner if not any(o is not c and o.start <= c.start and c.end <= o.end for o in inner)]
        lp.own_vector_bytes = totals[id(lp)] - sum(totals[id(c)] for c in children)
    return loops


def hot_loop(loops: list[Loop]) -> Loop | None:
    """Where the work is: the loop with the largest (own instructions) x (own global bytes), so an
    outer loop's per-block overhead or an index search does not win over the data loop; counting
    only 16/32-byte accesses when some loop has them (scalar loads are then indices and tables)."""
    if not loops:
        return None
    vector = any(lp.own_vector_bytes for lp in loops)

    def work(lp):
        moved = lp.own_vector_bytes if vector else lp.own_ld_bytes + lp.own_st_bytes
        return lp.own_instructions * moved, -lp.instructions

    return max(loops, key=work)


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Compiling entry function '(\S+)'.*?Used (\d+) registers(?:, used \d+ barriers)?"
                         r"(?:, (\d+) bytes smem)?", re.S)


def parse_ptxas_log(log: str) -> dict[str, dict]:
    """``{function: {registers, stack_bytes, spill_store_bytes, spill_load_bytes, smem_bytes}}``."""
    out: dict[str, dict] = {}
    for m in _PTXAS_FUNC.finditer(log):
        out.setdefault(m.group(1), {}).update(stack_bytes=int(m.group(2)), spill_store_bytes=int(m.group(3)),
                                              spill_load_bytes=int(m.group(4)))
    for block in re.split(r"(?=ptxas[-\w]* info\s+: Compiling entry function)", log):
        m = _PTXAS_REGS.search(block)
        if m:
            out.setdefault(m.group(1), {}).update(registers=int(m.group(2)), smem_bytes=int(m.group(3) or 0))
    return out


def res_usage(cuobjdump: str, binary: Path) -> dict[str, dict]:
    """``cuobjdump -res-usage``: registers, stack, shared and local bytes per function, from the
    binary itself (the cross-check of the ptxas log)."""
    text = subprocess.run([cuobjdump, "-res-usage", str(binary)], capture_output=True, text=True,
                          check=True).stdout
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and cur:
            out[cur] = dict(zip(("registers", "stack_bytes", "shared_bytes", "local_bytes"), map(int, m.groups())))
    return out


def sass_of(cuobjdump: str, binary: Path) -> dict[str, list[tuple[int, str]]]:
    text = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True, check=True).stdout
    return parse_sass(text)


@dataclass
class KernelReport:
    """What the static proof says about one compiled kernel."""
    name: str
    source: str  # the file, and for Triton the launcher call and its meta-parameters
    config: dict
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    loops: list[dict] = field(default_factory=list)
    hot_loop: dict | None = None
    elements_per_iteration: float | None = None  # per thread and source-level iteration of the hot loop
    element: str = ""  # what an element is
    element_bytes: int | None = None  # when the hot loop moves only elements: detects ptxas's unrolling
    unroll: int = 1  # source-level iterations per pass through the hot loop's body
    sass_per_element: float | None = None
    hot_loop_spills: int = 0  # STL/LDL instructions in any loop (in the body of a loop-free kernel)
    loop_free: bool = False  # no loop: hot_loop is the whole body (straight_body)
    warnings: list[str] = field(default_factory=list)


def analyse(report: KernelReport, usage: dict, ptxas: dict, insns: list[tuple[int, str]]) -> KernelReport:
    report.registers = ptxas.get("registers", usage.get("registers"))
    report.stack_bytes = ptxas.get("stack_bytes", usage.get("stack_bytes"))
    report.spill_store_bytes = ptxas.get("spill_store_bytes")
    report.spill_load_bytes = ptxas.get("spill_load_bytes")
    report.shared_bytes = usage.get("shared_bytes", ptxas.get("smem_bytes"))
    if usage.get("registers") is not None and ptxas.get("registers") not in (None, usage["registers"]):
        report.warnings.append(f"ptxas log says {ptxas['registers']} registers, the cubin {usage['registers']}")
    loops = find_loops(insns)
    report.loops = [asdict(lp) for lp in loops]
    report.hot_loop_spills = sum(lp.spill_instructions for lp in loops)
    hot = hot_loop(loops)
    if hot is None and insns:  # no loop: the whole body is the hot path, and a spill in it counts
        hot = straight_body(insns)
        report.loop_free = hot is not None
        report.hot_loop_spills = hot.spill_instructions if hot is not None else 0
    if hot is not None:
        report.hot_loop = asdict(hot)
        if report.element_bytes and report.elements_per_iteration:
            moved = hot.own_ld_bytes or hot.own_st_bytes  # the element stream: loads, else stores
            report.unroll = max(1, round(moved / (report.elements_per_iteration * report.element_bytes)))
        if report.elements_per_iteration:
            report.sass_per_element = round(hot.own_instructions / (report.elements_per_iteration * report.unroll), 2)
    return report


# ------------------------------------------------------------------------------------------ Triton
def _tools() -> tuple[str, str]:
    """(ptxas, cuobjdump) that the installed Triton uses for sm_90."""
    from triton.backends.nvidia import compiler as nv

    return str(nv.get_ptxas(CAPABILITY).path), find_cuobjdump()


def find_cuobjdump(near: str | None = None) -> str:
    """cuobjdump beside ``near`` (nvcc), else the one Triton's NVIDIA backend bundles, else PATH's."""
    import triton

    dirs = ([str(Path(near).parent)] if near else []) + [str(Path(triton.__file__).parent / "backends" / "nvidia"
                                                             / "bin")]
    for d in dirs:
        found = shutil.which("cuobjdump", path=d)
        if found:
            return found
    found = shutil.which("cuobjdump")
    if not found:
        raise FileNotFoundError("cuobjdump: not beside nvcc, not in Triton's backends/nvidia/bin, not on PATH")
    return found


class _FakeDriver:
    """Just enough of a driver for ``JITFunction.warmup`` to compile for sm_90a without a GPU."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", CAPABILITY, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        import torch
        return torch.cuda

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_benchmarker(self):
        return None


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel inside its module: ``kernel[grid](*args, **meta)``
    compiles (``warmup``) instead of launching and keeps the compiled kernel and the meta."""

    def __init__(self, jit):
        self.jit, self.compiled = jit, []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.compiled.append((self.jit.warmup(*args, grid=grid, **meta), meta))
        return launch


@dataclass
class TritonCase:
    """One production launch: ``call()`` runs the real launcher on CPU tensors of the shape."""
    module: str  # attribute path of the kernels module, e.g. "ppo_loss"
    kernel: str  # the @triton.jit function's name in it
    label: str
    call: Callable[[object], None]  # (module) -> None
    elements: Callable[[dict], float]  # meta -> elements per thread per iteration of the hot loop
    element: str
    element_bytes: int | None = None  # set when the hot loop moves nothing but these elements


def _threads(meta: dict) -> int:
    return 32 * int(meta.get("num_warps", 4))  # Triton's default num_warps is 4


def triton_cases(fast: bool) -> list[TritonCase]:
    import torch

    cases = []
    dtypes = (torch.bfloat16,) if fast else (torch.bfloat16, torch.float16, torch.float32)
    for V in FAST_VOCABS if fast else FULL_VOCABS:
        for dt in dtypes:
            tag = f"V={V} {str(dt).removeprefix('torch.')}"

            def fwd(K, V=V, dt=dt):
                z, y = torch.zeros(2, V, dtype=dt), torch.zeros(2, dtype=torch.int64)
                K.token_stats_fwd(z, y, 1.0)

            def bwd(K, V=V, dt=dt):
                z, y, r = torch.zeros(2, V, dtype=dt), torch.zeros(2, dtype=torch.int64), torch.zeros(2)
                K.token_stats_bwd(z, z, y, r, r, r, r, 1.0)

            per_elem = lambda meta: meta["BLOCK_V"] / _threads(meta)  # noqa: E731
            size = torch.empty((), dtype=dt).element_size()
            cases.append(TritonCase("ppo_loss", "_ppo_token_stats_fwd_kernel", f"loss fwd {tag}", fwd, per_elem,
                                    "logit", size))
            cases.append(TritonCase("ppo_loss", "_ppo_token_stats_bwd_kernel", f"loss bwd {tag}", bwd, per_elem,
                                    "logit", size))

    cases += packing_cases(fast) + delta_cases()
    return cases


def _tile(meta: dict) -> float | None:
    """Words per thread of one tile; None for a launch of several tensors (tiles differ)."""
    if meta["N_TENSORS"] != 1:
        return None
    return meta["BLOCK_TS"][0] * meta["BLOCK_WS"][0] / _threads(meta)


def _cu(T: int, B: int):
    import torch
    return (torch.arange(B + 1) * T // B).to(torch.int32)


def per_token_columns(T: int):
    """What a trainer reorders per token (bench/bench_packing_kernels.py): ids int64, log-probs and
    advantages fp32, versions int32, loss mask bool."""
    import torch
    return [torch.zeros(T, dtype=torch.int64), torch.zeros(T), torch.zeros(T), torch.zeros(T, dtype=torch.int32),
            torch.zeros(T, dtype=torch.bool)]


def mixed_columns(T: int):
    """Widths that are not 16-word multiples next to 1-word columns (tests/packing's launch of six:
    int64, int32, fp32 [T, 5], bf16 [T, 3], bf16, int64 [T, 3, 5]): every tile shape in one launch."""
    import torch
    return [torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int32), torch.zeros(T, 5),
            torch.zeros(T, 3, dtype=torch.bfloat16), torch.zeros(T, dtype=torch.bfloat16),
            torch.zeros(T, 3, 5, dtype=torch.int64)]


def packing_cases(fast: bool) -> list[TritonCase]:
    """Every launch of ``kernels/packing.py`` that ``areal_fast.packing`` makes: one column
    (gather / scatter, pack with position ids, positions only), several columns in one launch
    (gather_segments / scatter_segments of a list), unpack with and without a pad row."""
    import torch

    cases = []
    T, B = TOKENS, SEQS
    # one column: 1-word rows, a hidden row (H = 3584 bf16: 896 words, 16-byte accesses) and rows
    # of widths that are not 16-word multiples (scalar accesses: the tile that once took 255 registers)
    columns = [("int64 [T]", torch.zeros(T, dtype=torch.int64)), ("fp32 [T]", torch.zeros(T)),
               (f"bf16 [T, {HIDDEN}]", torch.zeros(T, HIDDEN, dtype=torch.bfloat16)),
               ("fp32 [T, 5]", torch.zeros(T, 5)), ("int64 [T, 3, 5]", torch.zeros(T, 3, 5, dtype=torch.int64))]
    if fast:
        columns = [columns[0], columns[2], columns[4]]
    for what, col in columns:
        def gather(K, col=col):
            K.segment_copy([col], [torch.empty_like(col)], _cu(T, B), torch.zeros(B, dtype=torch.int64), scatter=False)

        def unpack(K, col=col, pad=True):
            out = torch.empty((B, T // B) + tuple(col.shape[1:]), dtype=col.dtype)
            pad_row = torch.ones(col.shape[1:] or (1,), dtype=col.dtype) if pad else None
            K.unpack_rows(col, out, _cu(T, B), T // B, pad_row=pad_row)

        per_row = lambda meta: meta["BLOCK_T"] * meta["BLOCK_W"] / _threads(meta)  # noqa: E731
        cases.append(TritonCase("packing", "_segment_copy_kernel", f"segment copy {what}", gather, _tile, "word"))
        cases.append(TritonCase("packing", "_unpack_kernel", f"unpack {what}", unpack, per_row, "word"))
        if not fast or what == "int64 [T]":
            cases.append(TritonCase("packing", "_unpack_kernel", f"unpack {what} zero pad",
                                    lambda K, u=unpack: u(K, pad=False), per_row, "word"))

    def pack(K, rest=(), dtype=torch.int64):
        padded = torch.zeros((B * (T // B),) + rest, dtype=dtype)  # [B, L, ...] viewed as [B * L, ...]
        out = torch.empty((T,) + rest, dtype=dtype)
        K.segment_copy([padded], [out], _cu(T, B), torch.arange(B) * (T // B), scatter=False,
                       pos=torch.empty(T, dtype=torch.int64))

    cases.append(TritonCase("packing", "_segment_copy_kernel", "pack int64 [B, L] (+ position ids)", pack, _tile,
                            "word"))
    if not fast:
        cases.append(TritonCase("packing", "_segment_copy_kernel", "pack [B, L, 0] (position ids only)",
                                lambda K: pack(K, (0,), torch.bfloat16), _tile, "word"))

    # several columns in one launch, both directions, at a 16-divisible T and at one that is not
    sets = [("5 per-token columns", per_token_columns), ("mixed widths, 6 columns", mixed_columns)]
    if not fast:
        sets.append((f"5 per-token columns + bf16 [T, {HIDDEN}]",
                     lambda T: per_token_columns(T) + [torch.zeros(T, HIDDEN, dtype=torch.bfloat16)]))
    for what, make in sets:
        for n_tok in (T, T + 1):
            for scatter in (False, True):
                def launch(K, make=make, n_tok=n_tok, scatter=scatter):
                    cols = make(n_tok)
                    K.segment_copy(cols, [torch.empty_like(c) for c in cols], _cu(n_tok, B),
                                   torch.zeros(B, dtype=torch.int64), scatter=scatter)

                label = f"{'scatter' if scatter else 'gather'} {what}, T={n_tok}"
                cases.append(TritonCase("packing", "_segment_copy_kernel", label, launch, _tile, "word"))
    return cases


def delta_cases() -> list[TritonCase]:
    """The delta codec's three launches (``count_blocks``, ``encode``, ``apply``) on the 7B
    embedding. The 16-bit word views are stride-0 expansions of one word: the JIT reads only the
    data pointer and the dtype, so the shapes are production's without 2 x 1.1 GB on the host."""
    import torch

    def words(n, dtype=torch.int16):
        return torch.zeros(1, dtype=dtype).expand(n)

    def count(K):
        K.count_blocks(words(DELTA_WORDS), words(DELTA_WORDS))

    def encode(K):
        counts = torch.zeros(-(-DELTA_WORDS // K.BLOCK), dtype=torch.int32)
        K.encode(words(DELTA_WORDS), words(DELTA_WORDS), counts, DELTA_CHANGED)

    def apply(K):
        K.apply(words(DELTA_WORDS), words(DELTA_CHANGED, torch.int32), words(DELTA_CHANGED))

    per_block = lambda meta: meta["BLOCK"] / _threads(meta)  # noqa: E731
    what = f"{VOCAB} x {HIDDEN} bf16"
    return [TritonCase("delta", "_count_kernel", f"delta count {what}", count, per_block, "16-bit word"),
            TritonCase("delta", "_encode_kernel", f"delta encode {what}", encode, per_block, "16-bit word"),
            TritonCase("delta", "_apply_kernel", f"delta apply {what}, {DELTA_CHANGED} changes", apply, per_block,
                       "change")]


def compile_triton(fast: bool) -> list[KernelReport]:
    import importlib

    from triton import knobs
    from triton.runtime import driver

    ptxas, cuobjdump = _tools()
    driver.set_active(_FakeDriver())
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v of every compile, printed by Triton
    reports, ptxas_of = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in triton_cases(fast):
            K = importlib.import_module(f"areal_fast.kernels.{case.module}")
            jit = getattr(K, case.kernel)
            rec = _Recorder(jit)
            setattr(K, case.kernel, rec)
            log = io.StringIO()
            try:
                with contextlib.redirect_stdout(log):
                    case.call(K)
            finally:
                setattr(K, case.kernel, jit)
            for ck, meta in rec.compiled:
                name = ck.metadata.name
                cubin = Path(tmp) / f"{name}.cubin"
                cubin.write_bytes(ck.asm["cubin"])
                shown = {k: (list(v) if isinstance(v, tuple) else v) for k, v in meta.items()}
                rep = KernelReport(name=f"{case.label}: {name}", source=f"kernels/{case.module}.py", config=shown,
                                   elements_per_iteration=case.elements(meta), element=case.element,
                                   element_bytes=case.element_bytes)
                # a launch that specialises like an earlier one reuses its binary (no ptxas run)
                ptxas_of[ck.metadata.hash] = parse_ptxas_log(log.getvalue()).get(name) or ptxas_of.get(
                    ck.metadata.hash, {})
                analyse(rep, res_usage(cuobjdump, cubin).get(name, {}), ptxas_of[ck.metadata.hash],
                        sass_of(cuobjdump, cubin).get(name, []))
                if not ptxas_of[ck.metadata.hash]:
                    rep.warnings.append("no ptxas log captured: spill bytes unknown")
                reports.append(rep)
    return reports


# -------------------------------------------------------------------------------------------- CUDA
def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


def compile_cuda(nvcc: str) -> list[KernelReport]:
    """Every ``csrc/**/*.cu`` as the build compiles it (AREAL_FAST_WITH_CUDA, -Icsrc, C++17)."""
    cuobjdump = find_cuobjdump(nvcc)
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sorted((ROOT / "csrc").rglob("*.cu")):
            rel = cu.relative_to(ROOT).as_posix()
            obj = Path(tmp) / (cu.stem + ".o")
            cmd = [nvcc, "-arch=sm_90a", "-Xptxas", "-v", "-O3", "-std=c++17", "-DAREAL_FAST_WITH_CUDA=1",
                   f"-I{ROOT / 'csrc'}", "-c", str(cu), "-o", str(obj)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed on {rel}:\n{proc.stderr[-3000:]}")
            ptx_log = parse_ptxas_log(proc.stderr + proc.stdout)
            usage = res_usage(cuobjdump, obj)
            sass = sass_of(cuobjdump, obj)
            for name in sorted(set(ptx_log) | set(usage)):
                # the CUDA kernels copy bytes: an element is 16 bytes loaded, counted from the loop
                rep = KernelReport(name=f"{cu.name}: {name}", source=rel, config={"nvcc": " ".join(cmd[1:6])},
                                   element="16 bytes loaded", element_bytes=16, elements_per_iteration=1)
                analyse(rep, usage.get(name, {}), ptx_log.get(name, {}), sass.get(name, []))
                reports.append(rep)
    return reports


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


# -------------------------------------------------------------------------------------------- main
def problems(result: dict) -> list[str]:
    """Why ``result`` fails the proof: a spill inside a loop (or a kernel without ptxas figures)."""
    out = []
    for k in result["kernels"]:
        if k["hot_loop_spills"]:
            where = "in its body (no loop)" if k.get("loop_free") else "inside a loop"
            out.append(f"{k['name']}: {k['hot_loop_spills']} spill instruction(s) (STL/LDL) {where}")
        if k["registers"] is None or k["spill_store_bytes"] is None:
            out.append(f"{k['name']}: no register or spill figures (no ptxas -v log)")
    return out


def run(fast: bool, cuda: bool) -> dict:
    import triton

    ptxas, _ = _tools()
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    kernels = compile_triton(fast)
    nvcc = find_nvcc() if cuda else None
    if nvcc:
        kernels += compile_cuda(nvcc)
    result = dict(
        target=f"sm_{CAPABILITY}a", triton=triton.__version__,
        triton_ptxas=ptxas_version[-1] if ptxas_version else None,
        nvcc=nvcc_version(nvcc) if nvcc else None, python=platform.python_version(), fast=fast,
        shapes=dict(vocab=list(FAST_VOCABS if fast else FULL_VOCABS), hidden=HIDDEN, tokens=TOKENS, seqs=SEQS,
                    delta_words=DELTA_WORDS, delta_changed=DELTA_CHANGED),
        kernels=[asdict(k) for k in kernels])
    result["problems"] = problems(result)
    return result


def summary(result: dict) -> str:
    lines = [f"Triton {result['triton']} ({result['triton_ptxas']}), nvcc {result['nvcc']}, {result['target']}",
             f"{'kernel':<72} {'regs':>4} {'spill':>7} {'smem':>6} {'loop':>5} {'/elem':>6}"]
    for k in result["kernels"]:
        spill = f"{k['spill_store_bytes']}/{k['spill_load_bytes']}"
        loop = k["hot_loop"]["instructions"] if k["hot_loop"] else "-"
        per = k["sass_per_element"] if k["sass_per_element"] is not None else "-"
        lines.append(f"{k['name'][:72]:<72} {k['registers']!s:>4} {spill:>7} {k['shared_bytes']!s:>6} {loop!s:>5} "
                     f"{per!s:>6}")
    lines += [f"PROBLEM: {p}" for p in result["problems"]]
    return "\n".join(lines)


def _compile_env(cache_dir: str) -> None:
    """Before Triton is imported: compile for real (not the interpreter), with FP fusion as the JIT
    default, and into a private cache so that ptxas runs (and logs) for every kernel."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ["TRITON_CACHE_DIR"] = cache_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="bf16 at V = 151,936 and two packing widths only")
    ap.add_argument("--no-cuda", action="store_true", help="skip the csrc/**/*.cu files")
    ap.add_argument("--out", type=Path, help="JSON file (default bench/results/static_sm90-triton<version>.json)")
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="static_sm90_") as cache:
        _compile_env(cache)
        result = run(args.fast, not args.no_cuda)
    print(summary(result))
    if not args.no_results:
        out = args.out or RESULTS_DIR / f"static_sm90-triton{result['triton']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
