"""What the config sections and the checks share: the error type and two small value rules.

The lowest layer of the configuration: every section module (``rollout/config.py``,
``reward/config.py``, ``launch_config.py`` ...), the machine checks (``preflight.py``) and the
loader (``config.py``) import from here, and this module imports none of them, so no section
needs the loader and no import goes back up.
"""

from __future__ import annotations

__all__ = ["ConfigError", "device_indices", "positive_seconds"]


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


def positive_seconds(name: str, value: float) -> None:
    """Refuse a duration that is not > 0 seconds, naming the field."""
    if not value > 0:  # NaN and infinity never get here: the loader refuses non-finite numbers
        raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")


def device_indices(text: str) -> list[int] | None:
    """'4,5' -> [4, 5]; None when the list names devices by UUID (not checkable by index)."""
    parts = [p.strip() for p in str(text).split(",")]
    if any(not p for p in parts):
        raise ValueError(f"empty entry in the device list {text!r}")
    if all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    if all(p.startswith(("GPU-", "MIG-")) for p in parts):
        return None
    raise ValueError(f"expected comma-separated GPU indices (e.g. '0,1') or GPU UUIDs, got {text!r}")
