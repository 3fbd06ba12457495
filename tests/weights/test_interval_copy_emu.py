"""The CUDA interval-copy kernel's own code, run on the CPU against the C++ CPU routine.

``csrc/reshard/interval_copy_kernel.cuh`` is compiled with the host C++ compiler behind
``tests/weights/cuda_emu/cuda_shim.h`` (a handful of CUDA names: thread indices as globals, vector types,
``__ldg``/``__stcg`` that abort on a vector access not aligned to its size, as the device would
fault); ``tests/weights/cuda_emu/interval_copy_emu.cpp`` runs every thread of every block in turn over
every dtype pair, both sides' element offsets through a whole vector period, short, multi-chunk
and strided runs, and a many-interval plan with fewer blocks than chunks, comparing with
``interval_copy_cpu`` (NaN payloads excepted). What it cannot check: the device's conversion
intrinsics (the shim rounds like the CPU routine) and anything about speed.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler (c++, g++ or clang++) on PATH")
def test_kernel_code_matches_cpu_routine(tmp_path):
    exe = tmp_path / "interval_copy_emu"
    build = subprocess.run([CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unknown-pragmas",
                            f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'tests' / 'weights' / 'cuda_emu'}",
                            str(ROOT / "tests" / "weights" / "cuda_emu" / "interval_copy_emu.cpp"),
                            str(ROOT / "csrc" / "reshard" / "interval_copy_cpu.cpp"), "-o", str(exe), "-lpthread"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "warning" not in build.stderr, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("OK"), run.stdout[-2000:] + run.stderr[-2000:]
    assert int(run.stdout.split()[1]) > 2000, "fewer cases than planned: the loops were cut short"
