"""The static sm_90a proof (tools/static_sm90.py): its SASS/ptxas readers, a run of it, and the
committed results.

A spill inside a loop of any kernel fails: the script exits 1 and the committed results must be
spill-free for every Triton version they were made with (3.6, the GPU image's, and the installed
one). They must also cover every kernel that ``kernels/*.py`` launches (found in the source, so a
new kernel left out of the proof fails) and every kind of launch ``areal_fast.packing`` makes.
See docs/static_sm90.md.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "static_sm90.py"
RESULTS = sorted((ROOT / "bench" / "results").glob("static_sm90*.json"))


def _script():
    spec = importlib.util.spec_from_file_location("static_sm90", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("static_sm90", mod)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules["static_sm90"])
    return sys.modules["static_sm90"]


# A loop (0x0040 .. 0x00a0) holding a 16-byte load, a spill store and a reload, then the EXIT and
# the self-branch that ends every function (not a loop).
SASS = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;            /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                /* 0x0000000000007919 */
        /*0040*/                   LDG.E.128 R4, desc[UR4][R2.64] ;  /* 0x0000000402047981 */
        /*0050*/                   STL [R1], R4 ;                    /* 0x0000000401007387 */
        /*0060*/                   FADD R8, R4, R5 ;                 /* 0x0000000504087221 */
        /*0070*/                   LDL R4, [R1] ;                    /* 0x0000000001047983 */
        /*0080*/                   NOP ;                             /* 0x0000000000007918 */
        /*0090*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ; /* 0x000000100000780c */
        /*00a0*/              @!P0 BRA 0x40 ;                        /* 0xfffffff000008947 */
        /*00b0*/                   EXIT ;                            /* 0x000000000000794d */
        /*00c0*/                   BRA 0xc0;                         /* 0xfffffffc00fc7947 */
"""


def test_sass_reader_finds_the_loop_and_its_spills():
    S = _script()
    insns = S.parse_sass(SASS)["k"]
    assert len(insns) == 10  # the NOP is not counted
    (loop,) = S.find_loops(insns)
    assert (loop.start, loop.end, loop.instructions) == (0x40, 0xa0, 6)
    assert loop.spill_instructions == 2 and loop.ld_bytes == 16 and loop.own_vector_bytes == 16
    assert S.hot_loop([loop]) is loop


def test_a_spill_in_a_loop_is_a_problem():
    S = _script()
    rep = S.KernelReport(name="k", source="x", config={}, elements_per_iteration=8, element_bytes=2)
    ptxas = {"registers": 40, "spill_store_bytes": 4, "spill_load_bytes": 4}
    S.analyse(rep, {"registers": 40, "shared_bytes": 0}, ptxas, S.parse_sass(SASS)["k"])
    assert rep.hot_loop_spills == 2 and rep.unroll == 1 and rep.sass_per_element == 6 / 8
    result = {"kernels": [vars(rep)]}
    assert S.problems(result) == ["k: 2 spill instruction(s) (STL/LDL) inside a loop"]
    rep2 = S.KernelReport(name="k2", source="x", config={})
    ptxas = {"registers": 40, "spill_store_bytes": 0, "spill_load_bytes": 0}
    S.analyse(rep2, {"registers": 40}, ptxas, S.parse_sass(SASS.replace("STL", "FMUL").replace("LDL", "FMUL"))["k"])
    assert S.problems({"kernels": [vars(rep2)]}) == []
    rep3 = S.KernelReport(name="k3", source="x", config={})  # no ptxas -v figures: not proven
    S.analyse(rep3, {"registers": 40}, {}, S.parse_sass(SASS)["k"])
    assert "k3: no register or spill figures (no ptxas -v log)" in S.problems({"kernels": [vars(rep3)]})


def test_a_kernel_without_loops_is_measured_over_its_body():
    """The delta kernels have no loop (one block per program): the body is the hot path, and a
    spill anywhere in it is a problem."""
    S = _script()
    straight = "\n".join(line for line in SASS.splitlines() if "BRA 0x40" not in line)
    insns = S.parse_sass(straight)["k"]
    assert S.find_loops(insns) == []
    rep = S.KernelReport(name="k", source="x", config={}, elements_per_iteration=16)
    S.analyse(rep, {"registers": 30}, {"registers": 30, "spill_store_bytes": 4, "spill_load_bytes": 4}, insns)
    assert rep.loop_free and rep.hot_loop["instructions"] == 8  # up to the EXIT, not the self-branch
    assert rep.hot_loop["ld_bytes"] == 16 and rep.hot_loop_spills == 2 and rep.sass_per_element == 8 / 16
    assert S.problems({"kernels": [vars(rep)]}) == ["k: 2 spill instruction(s) (STL/LDL) in its body (no loop)"]


def test_hot_loop_is_the_data_loop_not_the_outer_or_index_loop():
    S = _script()
    outer = S.Loop(0, 1000, 300, 0, 64, 0, own_instructions=100, own_ld_bytes=16, own_st_bytes=0)
    search = S.Loop(100, 200, 20, 0, 8, 0, own_instructions=20, own_ld_bytes=8, own_st_bytes=0)
    data = S.Loop(300, 800, 180, 0, 32, 32, own_instructions=180, own_ld_bytes=32, own_st_bytes=32,
                  own_vector_bytes=64)
    assert S.hot_loop([outer, search, data]) is data


def test_ptxas_log_reader():
    S = _script()
    log = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_fwd' for 'sm_90a'
ptxas info    : Function properties for _fwd
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Compiling entry function '_bwd' for 'sm_90a'
ptxas info    : Function properties for _bwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 1024 bytes smem
"""
    got = S.parse_ptxas_log(log)
    assert got["_fwd"] == dict(stack_bytes=8, spill_store_bytes=4, spill_load_bytes=4, registers=64, smem_bytes=0)
    assert got["_bwd"]["registers"] == 32 and got["_bwd"]["smem_bytes"] == 1024


@pytest.mark.slow
def test_static_proof_runs_and_finds_no_spill_in_a_loop(tmp_path):
    """The script itself, fast mode: the Triton kernels with the installed Triton, and the .cu
    files when nvcc is present."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton wheel without the NVIDIA backend's ptxas: nothing can be compiled for sm_90a")
    S = _script()
    args = ["--fast", "--out", str(tmp_path / "static.json")]
    if S.find_nvcc() is None:
        args.append("--no-cuda")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "static.json").read_text())
    _check_result(result, "fresh run")
    if "--no-cuda" not in args:
        assert any(k["source"].endswith(".cu") for k in result["kernels"]), "no CUDA kernel compiled"


def _dotted(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def launched_kernels() -> set[tuple[str, str]]:
    """(``kernels/<file>.py``, name) of every ``@triton.jit`` function of ``kernels/`` that some code
    of its module launches (``name[grid](...)``); helpers called from other kernels are not."""
    found = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        jitted = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  and any(_dotted(d).rsplit(".", 1)[-1] in ("jit", "autotune", "heuristics") for d in f.decorator_list)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                name = _dotted(node.func.value)
                if name in jitted:
                    found.add((f"kernels/{path.name}", name))
    return found


def test_launched_kernels_are_found_in_the_source():
    got = launched_kernels()
    assert {("kernels/ppo_loss.py", "_ppo_token_stats_fwd_kernel"),
            ("kernels/ppo_loss.py", "_ppo_token_stats_bwd_kernel"),
            ("kernels/packing.py", "_segment_copy_kernel"), ("kernels/packing.py", "_unpack_kernel"),
            ("kernels/delta.py", "_count_kernel"), ("kernels/delta.py", "_encode_kernel"),
            ("kernels/delta.py", "_apply_kernel")} <= got, got
    assert not any(name in ("_segment_of", "_segment_copy_one") for _, name in got), got  # helpers, not launches


# Registers past this are one ptxas decision from the 255 cap, where the spills start (the mixed-width
# segment copy sat at 254-255 and spilled 16 bytes in its loop under Triton 3.9).
MAX_REGISTERS = 200


def _check_coverage(result: dict, where: str) -> None:
    """Every launched kernel is in ``result``, and every kind of packing launch: several columns in
    one launch (mixed dtypes and tile shapes) both ways, pack with position ids, unpack with and
    without a pad row."""
    kernels = result["kernels"]
    for source, kernel in sorted(launched_kernels()):
        assert any(k["source"] == source and k["name"].endswith(f": {kernel}") for k in kernels), \
            f"{where}: {source}'s {kernel} is launched by the code but not compiled by the static proof"
    seg = [k["config"] for k in kernels if k["name"].endswith(": _segment_copy_kernel")]
    for scatter in (False, True):
        assert any(c["N_TENSORS"] >= 5 and c["SCATTER"] is scatter for c in seg), \
            f"{where}: no {'scatter' if scatter else 'gather'} of 5+ columns in one launch"
        assert any(len(set(zip(c["BLOCK_TS"], c["BLOCK_WS"]))) >= 3 and c["SCATTER"] is scatter for c in seg), \
            f"{where}: no {'scatter' if scatter else 'gather'} launch mixing 3+ tile shapes"
    assert any(c["WRITE_POS"] for c in seg), f"{where}: no pack (segment copy with position ids)"
    pads = {k["config"]["HAS_PAD"] for k in kernels if k["name"].endswith(": _unpack_kernel")}
    assert pads == {False, True}, f"{where}: unpack with a pad row and without expected, got HAS_PAD {pads}"


def _check_result(result: dict, where: str) -> None:
    assert result["target"] == "sm_90a", where
    assert result["problems"] == [], (where, result["problems"])
    _check_coverage(result, where)
    for k in result["kernels"]:
        assert isinstance(k["registers"], int) and 0 < k["registers"] <= MAX_REGISTERS, \
            (where, k["name"], k["registers"])
        assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (where, k["name"])
        assert k["hot_loop_spills"] == 0, (where, k["name"])
        assert k["hot_loop"] is not None and k["hot_loop"]["instructions"] > 0, (where, k["name"])
        assert k["sass_per_element"] is None or k["sass_per_element"] > 0, (where, k["name"])
        if "ppo_token_stats" in k["name"]:
            assert k["config"]["BLOCK_V"] >= 2048 and k["unroll"] >= 1, (where, k["name"])


def test_committed_results_are_well_formed_and_spill_free():
    versions = {}
    for path in RESULTS:
        result = json.loads(path.read_text())
        assert path.name == f"static_sm90-triton{result['triton']}.json", path.name
        _check_result(result, path.name)
        versions[result["triton"].rsplit(".", 1)[0]] = path.name
    # the GPU image's Triton and the one this project installs
    assert {"3.6", "3.9"} <= set(versions), f"static_sm90 results for Triton 3.6 and 3.9 expected, got {versions}"
