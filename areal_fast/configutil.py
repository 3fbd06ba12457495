"""What the config sections and the checks share: the error type, the declarative field rules
(:func:`option`, :func:`check_rules`), the one dict-to-dataclass loader (:class:`Loader`) and the
value rules a config and a JSON record share (a device list, a finite number).

The lowest layer of the configuration: every section module (``rollout/config.py``,
``reward/config.py``, ``launch_config.py`` ...), the machine checks (``preflight.py``) and the
loader (``config.py``) import from here, and this module imports none of them, so no section
needs the loader and no import goes back up.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

__all__ = ["ConfigError", "Loader", "check_rules", "device_indices", "finite_number", "from_dict", "option"]


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


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


# ----------------------------------------------------------------------------- declarative rules


def finite_number(value) -> bool:
    """A JSON number that a float holds finitely (not a bool, NaN, an infinity, nor an integer too
    large for a float: ``math.isfinite`` would raise OverflowError on one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def option(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, ge=None, gt=None, le=None,
           lt=None, choices: tuple | None = None, nonempty: bool = False):
    """A section field with its rules, checked by :func:`check_rules` (so at load and on construction):
    ``ge``/``gt``/``le``/``lt`` bound a number, ``choices`` lists the allowed values, ``nonempty``
    refuses an empty string or list. ``None`` passes where the field's type allows it (``| None``).

        lr: float = option(1e-6, ge=0)
        lr_schedule: str = option("constant", choices=LR_SCHEDULES)
    """
    rules = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt), ("choices", choices)) if v is not None}
    if nonempty:
        rules["nonempty"] = True
    return dataclasses.field(default=default, default_factory=factory, metadata={RULES: rules})


RULES = "areal_fast.rules"
"""The metadata key of a field's rules (:func:`option`)."""

_BOUNDS = (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b), ("le", "<=", lambda v, b: v <= b),
           ("lt", "<", lambda v, b: v < b))


def _fields(cls) -> tuple:
    """(name, rules, allows None, is an integer, is a float) per field of ``cls``; cached per class."""
    cached = _FIELD_CACHE.get(cls)
    if cached is None:
        rows = []
        hints = typing.get_type_hints(cls)  # the annotations resolved (the modules use postponed ones)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            members = typing.get_args(t) if _is_union(t) else (t,)
            first = members[0]
            rows.append((f.name, f.metadata.get(RULES, {}), type(None) in members, first is int, first is float))
        cached = _FIELD_CACHE[cls] = tuple(rows)
    return cached


_FIELD_CACHE: dict = {}


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def allowed(rules: dict, nullable: bool = False) -> str:
    """The rules in words ('>= 1', 'one of (...)', '> 0 or null'), as docs/config.md shows them."""
    parts = [f"{sym} {rules[k]!r}" for k, sym, _ in _BOUNDS if k in rules]
    text = " and ".join(parts) if parts else ""
    if "choices" in rules:
        text = f"one of {tuple(rules['choices'])!r}"
    if rules.get("nonempty"):
        text = "not empty"
    return f"{text} or null" if nullable and text else text


def check_rules(obj) -> None:
    """Check every field of the dataclass ``obj`` against its :func:`option` rules, and every float
    field for a finite number; raises ``ValueError("name: must be ..., got value")``."""
    for name, rules, nullable, is_int, is_float in _fields(type(obj)):
        value = getattr(obj, name)
        if value is None:
            if nullable or not rules:
                continue
            raise ValueError(f"{name}: must not be null")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if is_float and number and not math.isfinite(value):
            raise ValueError(f"{name}: must be a finite number, got {value!r}")
        if not rules:
            continue
        must = f"{name}: must be {allowed(rules, nullable)}, got {value!r}"
        if "choices" in rules and value not in rules["choices"]:
            raise ValueError(must)
        if rules.get("nonempty") and (not value or isinstance(value, str) and not value.strip()):
            raise ValueError(f"{name}: must not be empty")
        _check_bounds(name, value, rules, nullable, is_int, must)


def _check_bounds(name: str, value, rules: dict, nullable: bool, is_int: bool, must: str) -> None:
    bounds = [(k, test) for k, _, test in _BOUNDS if k in rules]
    if not bounds:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or is_int and not isinstance(value, int):
        raise ValueError(f"{name}: must be {'an integer' if is_int else 'a number'} {allowed(rules, nullable)}, "
                         f"got {value!r}")
    if not all(test(value, rules[k]) for k, test in bounds):
        raise ValueError(must)


# ----------------------------------------------------------------------------- the one loader


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class Loader:
    """Builds a section dataclass from plain data (YAML, JSON, dotted overrides): every value checked
    against the field's type, every error a :class:`ConfigError` naming the dotted key.

    ``derived``: dotted keys filled from another key (refused in the data, naming that key);
    ``renamed``: old dotted keys and the key that replaced each (refused, naming the new key)."""

    def __init__(self, derived: dict[str, str] | None = None, renamed: dict[str, str] | None = None):
        self.derived = derived or {}
        self.renamed = renamed or {}

    def build(self, cls, data: dict | None, prefix: str = ""):
        """``cls`` from the nested mapping ``data`` (its dotted position ``prefix``)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        kwargs = {k: self.value(v, hints.get(k), self._key(prefix, k), k in names, names) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            raise ConfigError(with_prefix(str(e), prefix)) from e

    @staticmethod
    def _key(prefix: str, k) -> str:
        return f"{prefix}.{k}" if prefix else str(k)

    def _check_key(self, key: str, known: bool, names: list[str]) -> None:
        if key in self.renamed:
            raise ConfigError(f"{key}: renamed to {self.renamed[key]}; write {self.renamed[key]} instead")
        if key in self.derived:
            raise ConfigError(f"{key}: set from {self.derived[key]} (one setting per value); set "
                              f"{self.derived[key]} instead")
        if not known:
            prefix = key.rpartition(".")[0]
            valid = [n for n in names if self._key(prefix, n) not in self.derived]
            raise ConfigError(f"unknown key '{key}' (valid keys{' under ' + repr(prefix) if prefix else ''}: "
                              f"{', '.join(valid)})")

    def value(self, value, tp, key: str, known: bool, names: list[str]):
        self._check_key(key, known, names)
        return self.coerce(value, tp, key)

    def coerce(self, value, tp, key: str):
        """Check ``value`` against the annotation ``tp``; returns the (possibly converted) value."""
        origin = typing.get_origin(tp)
        if tp is Any:
            return value
        if _is_union(tp):
            return self._union(value, tp, key)
        if value is None:
            raise ConfigError(f"{key}: must not be null")
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                return value
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping (section {tp.__name__}), got {value!r}")
            return self.build(tp, value, prefix=key)
        if origin in (list, tuple):
            return self._sequence(value, tp, key)
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping, got {value!r}")
            return dict(value)
        scalar = _SCALARS.get(tp)
        if scalar is None:
            raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")
        return scalar(value, key)

    def _union(self, value, tp, key: str):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return self.coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {_type_name(tp)}")

    def _sequence(self, value, tp, key: str):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if typing.get_origin(tp) is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(self.coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [self.coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if typing.get_origin(tp) is tuple else out


def _bool(value, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def _int(value, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _float(value, key: str) -> float:
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # YAML reads '1e-5' (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if not math.isfinite(number):  # "no limit" is written null where a field allows it
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return number


def _str(value, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")


_SCALARS = {bool: _bool, int: _int, float: _float, str: _str}


def with_prefix(msg: str, prefix: str) -> str:
    """A section's error ("lr: must be ...") with the section's dotted path in front."""
    if not prefix or msg.startswith(prefix + ".") or msg.startswith(prefix + ":"):
        return msg
    return f"{prefix}.{msg}"


def from_dict(cls, data: dict | None, prefix: str = ""):
    """``cls`` (a section, or a whole config tree) from plain data, with no derived or renamed keys
    (the run config's loader, ``areal_fast.config.from_dict``, adds its own)."""
    return Loader().build(cls, data, prefix)
