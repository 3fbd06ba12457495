"""Datasets, tokenizers and the shipped synthetic task.

Imports are lazy: reward worker processes import ``areal_fast.data.tiny_task`` and must not pay
for torch or the config tree (a cold import of torch takes seconds and counts against the
reward timeout).
"""

_EXPORTS = {
    "PromptRow": "areal_fast.data.datasets", "PromptStream": "areal_fast.data.datasets",
    "build_prompts": "areal_fast.data.datasets", "load_split": "areal_fast.data.datasets",
    "read_rows": "areal_fast.data.datasets", "CharTokenizer": "areal_fast.data.tokenizer",
    "HFTokenizer": "areal_fast.data.tokenizer", "load_tokenizer": "areal_fast.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'areal_fast.data' has no attribute {name!r}")
