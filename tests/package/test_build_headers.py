"""A source install on a machine without the Python development headers says what to install.

CMake's own message for a missing ``Python.h`` ("Could NOT find Python (missing:
Python_INCLUDE_DIRS Development.Module)") names neither the file nor the package that brings it;
the project's CMakeLists.txt turns it into one that does. Configured here with an include
directory that holds no ``Python.h``, as on a machine without python3-dev.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake on PATH")
def test_a_missing_python_h_names_the_headers_and_the_package(tmp_path):
    empty = tmp_path / "include"
    empty.mkdir()
    r = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"),
                        f"-DPython_EXECUTABLE={sys.executable}", f"-DPython_INCLUDE_DIR={empty}",
                        "-DAREAL_FAST_CUDA=OFF"], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-2000:]
    assert "Python.h" in out and "python3-dev" in out and "python3-devel" in out, out[-2000:]
