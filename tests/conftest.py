import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    skip_interp = pytest.mark.skip(reason="needs Triton and TRITON_INTERPRET=1 (set by tests/conftest.py)")
    for item in items:
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and (not _has_triton() or os.environ.get("TRITON_INTERPRET") != "1"):
            item.add_marker(skip_interp)


# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before any kernel
# module is imported. Without a GPU every Triton test runs in the interpreter.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
