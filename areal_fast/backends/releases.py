"""The supported-release check both backends' compat tables share (``backends/sglang/compat.py``
for SGLang, ``backends/vllm/compat.py`` for vLLM): a version given as text, parsed and kept inside
the range whose behaviours the table knows."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

__all__ = ["parse_supported_version"]


def parse_supported_version(value: str | Version, option: str, product: str, oldest: Version, newest: Version,
                            see: str = "") -> Version:
    """``value`` as a Version; ValueError naming ``option`` and the value when it does not parse
    (the example given is ``newest``) or is outside ``oldest`` .. ``newest`` (``see`` is appended)."""
    try:
        v = value if isinstance(value, Version) else Version(str(value))
    except InvalidVersion:
        raise ValueError(f"{option} {value!r} is not a version like {newest}") from None
    if not oldest <= v <= newest:
        raise ValueError(f"{option} {value}: supported {product} releases are {oldest} to {newest}{see}")
    return v
