"""Frozen settings dataclasses read from environment variables, one parser for all of them.

Each settings class names its variables (``{field: "APC_..."}``); values are parsed by the type
of the field's default: booleans (1/0, true/false, yes/no, on/off), ints, floats, tuples
(comma-separated), and byte sizes for fields ending in ``_bytes`` (``48G``, ``512M``, plain
bytes). A bad value is a ``ValueError`` naming the variable, never a silent default.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bool(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{key}={raw!r} is not a boolean (use 1/0)")


def parse_bytes(key: str, raw: str) -> int:
    """Plain integers are bytes; a K/M/G/T suffix is binary units (``48G``)."""
    text = raw.strip().upper().removesuffix("B")
    scale = _UNITS.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a size (bytes, or a number with K/M/G/T)") from None


def parse_value(key: str, raw: str, default: Any, field_name: str = "") -> Any:
    """``raw`` as the type of ``default``."""
    if isinstance(default, bool):
        return parse_bool(key, raw)
    if isinstance(default, tuple):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if field_name.endswith("_bytes"):
        return parse_bytes(key, raw)
    try:
        return type(default)(raw.strip())
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise ValueError(f"{key}={raw!r} is not {kind}") from None


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
