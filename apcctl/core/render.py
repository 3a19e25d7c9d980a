"""Human output: sizes, durations and aligned rich tables. ``--json`` output never comes here."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterable, Mapping, Sequence, TextIO

import click
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from apcctl.core.sanitize import printable, printable_lines  # noqa: F401  (render.printable: the one cleaner)


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


def anchors_line(b: Any) -> str:
    """Pinned anchors wherever they are, against the cap, and what they hold in RAM (a ``Budgets``):
    ``2 / 8 pinned (2 only on disk), 0 B / 1.0 GiB in RAM`` after a restart, as ``anchors list`` shows."""
    on_disk = f" ({b.pinned_on_disk} only on disk)" if b.pinned_on_disk else ""
    return (f"{b.pinned} / {b.anchor_count_limit} pinned{on_disk}, "
            f"{human_bytes(b.anchor_bytes)} / {human_bytes(b.anchor_bytes_limit)} in RAM")


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
    warm turn copied no KV), ``entry/staged`` when its copy was made off the generation thread
    while it was queued (``integration.staging``)."""
    from server_patch.lineage.model import KVAdmission  # (numpy: only for a table of requests)

    kind = str(record.get("restore_kind", "?"))
    suffix = {KVAdmission.LENT: "/lent", KVAdmission.STAGED: "/staged"}.get(record.get("kv_admission"), "")
    return kind + suffix


# The short names of ``lineage.misses.Lost`` in the LOST columns of ``apcctl requests`` and the
# dashboard (kept as strings: neither loads numpy; tests/tui/test_tui_units.py keeps them equal;
# docs/dashboard.md lists them).
LOST_SHORT = {"ram budget": "ram", "anchor cap": "anchors", "disk cap": "disk cap", "operator": "evicted",
              "thinning": "thinned", "no restore point": "no point", "disk rejected": "disk bad",
              "disk not used": "no disk", "canary": "canary", "loan": "loan", "reply not re-rendered": "reply",
              "restart": "restart", "other": "other"}


def largest_first(lost: Mapping[str, int] | None) -> list[tuple[int, str]]:
    """(tokens, reason) of the reasons that lost any, the most tokens first."""
    return sorted(((int(n), str(reason)) for reason, n in (lost or {}).items() if n),
                  key=lambda item: (-item[0], item[1]))


def lost_label(record: Any) -> str:
    """A request's LOST cell: its top reason and tokens, ``+`` when there were more reasons
    ("ram 48+"); blank when nothing was lost, ``-`` from a server before issue 26."""
    if record.get("oracle") is None:
        return "-"
    lost = largest_first(record.get("lost"))
    if not lost:
        return ""
    n, reason = lost[0]
    return f"{LOST_SHORT.get(reason, reason)} {n:,}" + ("+" if len(lost) > 1 else "")


def wait_label(record: Any) -> str:
    """A request's WAIT cell: the time it waited for other requests' work on the generation
    thread (``integration.waits``, ms) and what most of it was, ``+`` when other work added to it
    ("2,914 prefill+"); blank when it waited for nothing, ``-`` from a server before issue 29's
    waits. A row still running may wait more (``ended`` false)."""
    total = record.get("waited_ms")
    if total is None:
        return "-"
    waited = [(float(ms), str(kind)) for kind, ms in (record.get("waited") or {}).items() if ms]
    if not waited or float(total) <= 0:
        return ""
    top = max(waited, key=lambda item: (item[0], item[1]))[1]
    return f"{float(total):,.0f} {top}" + ("+" if len(waited) > 1 else "")


def gap_label(record: Any) -> str:
    """A request's GAP cell: its longest inter-token gap while decoding (ms) and what most of it
    was (``integration.waits``: another's "join", "prefill", ..., its own "step", or
    "unattributed"), as "734 join"; blank before a second token of a decode step, ``-`` from a
    server before issue 40's gaps."""
    gap = record.get("worst_gap")
    if gap is None:
        return "-"
    parts = [(float(ms), str(part)) for part, ms in (gap.get("parts") or {}).items()]
    if not gap or not parts:
        return ""
    return f"{float(gap.get('ms', 0.0)):,.0f} {max(parts)[1]}"


def console() -> Console:
    """A console on click's stdout; wide in pipes, so tables are never cut to fit 80 columns, and
    without the padding that would fill every piped line to the table's width."""
    if sys.stdout.isatty():
        return Console(file=sys.stdout, soft_wrap=False, highlight=False)
    width = max(PIPE_WIDTH, int(os.environ.get("COLUMNS", "0") or 0))
    return Console(file=_Unpadded(sys.stdout), width=width, soft_wrap=False, highlight=False)


class _Unpadded:
    """A text stream that drops the spaces at the end of each line (rich pads table rows)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        if lines:
            self.out.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self.pending.strip(" "):
            self.out.write(self.pending)
            self.pending = ""
        self.out.flush()

    def isatty(self) -> bool:
        return False


# Columns never cut or wrapped (an id is copied whole into the next command); the others wrap.
WHOLE = ("ID", "ENTRY", "SEQ")
LONGEST_WORD = 40  # a longer word (a path) may still be folded, so one cell cannot push every other out


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
          numeric: Iterable[str] = (), header: bool = True, whole: Iterable[str] = WHOLE) -> "Fitted":
    """A table whose ``numeric`` columns are right-aligned, so digits line up; on a narrow terminal
    ids and numbers keep their full width and text columns wrap between words, and when even that
    does not fit, each row is printed as a block of ``column  value`` lines: no cell is cut and no
    column dropped."""
    cells = [[Text("") if cell is None else plain(cell) for cell in row] for row in rows]
    return Fitted(_table(columns, cells, title, set(numeric), header, set(whole)), columns, cells, title, header)


class Fitted:
    """A table, or, where it cannot fit the width it is drawn at, one block per row."""

    def __init__(self, wide: Table, columns: Sequence[str], cells: list[list[Text]], title: str | None,
                 header: bool) -> None:
        self.wide, self.columns, self.cells, self.title, self.header = wide, columns, cells, title, header

    def add_row(self, *cells: Any) -> None:
        """One more row, as ``rich.table.Table.add_row`` takes it (a ``Text`` cell keeps its style)."""
        row = [cell if isinstance(cell, Text) else Text("") if cell is None else plain(cell) for cell in cells]
        self.cells.append(row)
        self.wide.add_row(*row)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        needed = sum(c.min_width or 1 for c in self.wide.columns) + 2 * (len(self.wide.columns) - 1)  # 2: padding
        if needed <= options.max_width or not self.header:
            yield self.wide
            return
        if self.title:
            yield Text.from_markup(self.title)
        for n, row in enumerate(self.cells):
            if n:
                yield Text("")
            yield _table(("field", "value"), [[Text(name), cell] for name, cell in zip(self.columns, row)],
                         None, set(), False, {"field"})


def _table(columns: Sequence[str], cells: list[list[Text]], title: str | None, right: set[str], header: bool,
           kept: set[str]) -> Table:
    out = Table(title=title, title_justify="left", header_style="bold", box=None, pad_edge=False,
                show_header=header)
    for n, name in enumerate(columns):
        column = [row[n].plain for row in cells if n < len(row)]
        fixed = name in kept or name in right
        # Whole cells for ids and numbers; elsewhere whole words (a line breaks between words only).
        widest = max((cell_len(part) for cell in column for part in ([cell] if fixed else cell.split())),
                     default=0)
        out.add_column(name, justify="right" if name in right else "left", no_wrap=fixed, overflow="fold",
                       min_width=min(max(widest, *(cell_len(w) for w in name.split() or [""])), LONGEST_WORD))
    for row in cells:
        out.add_row(*row)
    return out


def plain(cell: Any) -> Text:
    """A table cell as plain text: never read as rich markup (a label may hold ``[red]`` or ``[/]``)."""
    return Text(printable(cell))


def key_values(pairs: Iterable[tuple[str, Any]], *, title: str | None = None) -> Fitted:
    """Two aligned columns for a status screen: the keys whole, a long value wrapped beside them."""
    return table((KEY, ""), pairs, title=title, header=False, whole=(KEY,))


KEY = "key"  # the key column of ``key_values`` (its header is not shown)


def emit_json(value: Any) -> None:
    """Machine output: one JSON document on stdout."""
    click.echo(json.dumps(value, indent=2, default=_as_json))


def emit_json_line(value: Any) -> None:
    """One compact JSON object per line, for ``--follow`` streams."""
    click.echo(json.dumps(value, separators=(",", ":"), default=_as_json))


def _as_json(value: Any) -> Any:
    """An admin answer (``server_patch.admin.schema``) as the JSON the server sent; else its text."""
    to_json = getattr(value, "to_json", None)
    return to_json() if callable(to_json) else str(value)
