"""The one parser behind every ``APC_*`` setting: value types, sizes, and settings dataclasses.

Each settings class names its variables (``{field: "APC_..."}``); values are parsed by the type
of the field's default (``type_for``): booleans (1/0, true/false, yes/no, on/off), ints, floats,
tuples (comma-separated), and byte sizes for fields ending in ``_bytes``. A size is plain bytes
or a number with a binary unit: ``64M``, ``1.5G``, ``48GiB``, ``512KB`` (K/M/G/T, each 1024 times
the one before, with or without ``i`` and ``B``). A bad value is a ``ValueError`` naming the
variable, never a silent default. The registry of every setting is ``server_patch.settings``.
"""

from __future__ import annotations

import re
from dataclasses import fields
from enum import StrEnum
from typing import Any, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


class ValueType(StrEnum):
    """How a setting's text is read."""

    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    SIZE = "size"  # bytes: 64M, 1.5G, 48GiB, 4096
    FRACTION = "fraction"  # 0.05 or 5%
    TEXT = "text"
    PATH = "path"
    LIST = "list"  # comma-separated


def parse_bool(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{key}={raw!r} is not a boolean (use 1/0)")


def parse_size(key: str, raw: str) -> int:
    """Bytes: plain, or a number with K/M/G/T (binary units; ``GiB``, ``GB`` and ``G`` alike)."""
    match = _SIZE.match(raw)
    if not match:
        raise ValueError(f"{key}={raw!r} is not a size (bytes, or a number with K/M/G/T, e.g. 64M, 48GiB)")
    number, unit, suffix = match.groups()
    if suffix and suffix.upper() == "IB" and not unit:
        raise ValueError(f"{key}={raw!r} is not a size (\"iB\" needs a unit: KiB, MiB, GiB, TiB)")
    scale = _UNITS[unit.upper()]
    return int(number) * scale if number.isdigit() else int(float(number) * scale)


parse_bytes = parse_size  # the name older callers use


def parse_fraction(key: str, raw: str) -> float:
    """``5%`` or ``0.05`` -> 0.05, in [0, 1)."""
    text = raw.strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise ValueError(f"{key}={raw!r} must be a fraction in [0, 1) or a percent below 100 (e.g. 0.05 or 5%)")
    return value


def parse_typed(kind: ValueType, key: str, raw: str) -> Any:
    """``raw`` read as ``kind``; a ``ValueError`` naming ``key`` when it cannot be."""
    if kind is ValueType.BOOL:
        return parse_bool(key, raw)
    if kind is ValueType.SIZE:
        return parse_size(key, raw)
    if kind is ValueType.FRACTION:
        return parse_fraction(key, raw)
    if kind is ValueType.LIST:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind in (ValueType.INT, ValueType.FLOAT):
        try:
            return (int if kind is ValueType.INT else float)(raw.strip())
        except ValueError:
            noun = "an integer" if kind is ValueType.INT else "a number"
            raise ValueError(f"{key}={raw!r} is not {noun}") from None
    return raw.strip() if kind is ValueType.TEXT else raw


def type_for(default: Any, field_name: str = "") -> ValueType:
    """The type a settings dataclass field is read as, from its default and name."""
    if isinstance(default, bool):
        return ValueType.BOOL
    if isinstance(default, tuple):
        return ValueType.LIST
    if field_name.endswith("_bytes"):
        return ValueType.SIZE
    if isinstance(default, int):
        return ValueType.INT
    if isinstance(default, float):
        return ValueType.FLOAT
    return ValueType.TEXT


def parse_value(key: str, raw: str, default: Any, field_name: str = "") -> Any:
    """``raw`` as the type of ``default``."""
    return parse_typed(type_for(default, field_name), key, raw)


def env_values(cls: type, names: Mapping[str, str], env: Mapping[str, str]) -> dict[str, Any]:
    """Field values for dataclass ``cls`` from the variables ``names`` maps its fields to."""
    defaults = {f.name: f.default for f in fields(cls)}
    values: dict[str, Any] = {}
    for field_name, key in names.items():
        raw = env.get(key)
        if raw is None or raw.strip() == "":
            continue
        values[field_name] = parse_value(key, raw, defaults[field_name], field_name)
    return values
