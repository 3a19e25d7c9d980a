"""Human output: sizes, durations and aligned rich tables. ``--json`` output never comes here."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterable, Sequence

import click
from rich.console import Console
from rich.table import Table

from server_patch.lineage.model import KVAdmission

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
PIPE_WIDTH = 240


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``1.5 KiB``; ``None`` -> ``-``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float | None) -> str:
    """``3725`` -> ``1h 2m``; short spans keep one decimal."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f}s"
    minutes, sec = divmod(int(s), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {sec}s"


def ago(timestamp: float | None, now: float | None = None) -> str:
    if timestamp is None:
        return "-"
    return human_duration((now or time.time()) - timestamp) + " ago"


def clock(timestamp: float | None) -> str:
    return "-" if timestamp is None else time.strftime("%H:%M:%S", time.localtime(timestamp))


def percent(part: float, whole: float) -> str:
    return "-" if not whole else f"{100 * part / whole:.1f}%"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def restore_label(record: dict[str, Any]) -> str:
    """A request's restore kind; ``entry/lent`` when the entry lent it its own KV buffer (the
    warm turn copied no KV)."""
    kind = str(record.get("restore_kind", "?"))
    return kind + ("/lent" if record.get("kv_admission") == KVAdmission.LENT else "")


def console() -> Console:
    """A console on click's stdout; wide in pipes, so tables are never cut to fit 80 columns."""
    width = None if sys.stdout.isatty() else max(PIPE_WIDTH, int(os.environ.get("COLUMNS", "0") or 0))
    return Console(file=sys.stdout, width=width, soft_wrap=False, highlight=False)


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
          numeric: Iterable[str] = (), header: bool = True) -> Table:
    """A table whose ``numeric`` columns are right-aligned, so digits line up."""
    right = set(numeric)
    out = Table(title=title, title_justify="left", header_style="bold", box=None, pad_edge=False,
                show_header=header)
    for name in columns:
        out.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    for row in rows:
        out.add_row(*("" if cell is None else str(cell) for cell in row))
    return out


def key_values(pairs: Iterable[tuple[str, Any]], *, title: str | None = None) -> Table:
    """Two aligned columns for a status screen."""
    return table(("", ""), pairs, title=title, header=False)


def emit_json(value: Any) -> None:
    """Machine output: one JSON document on stdout."""
    click.echo(json.dumps(value, indent=2, default=str))


def emit_json_line(value: Any) -> None:
    """One compact JSON object per line, for ``--follow`` streams."""
    click.echo(json.dumps(value, separators=(",", ":"), default=str))
