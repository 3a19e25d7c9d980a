"""``requests --follow`` lines (``FollowLines``): as wide as what arrives, so rows ``requests``
fits as a table do not wrap when followed (issue 36.14); the header lines up with the rows."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from apcctl.commands.requests import COLUMNS, FOLLOW_WIDTHS, NUMERIC, format_request, row
from apcctl.core import render
from apcctl.core.follow_lines import FollowLines

RECORDING = Path(__file__).parents[1] / "tui" / "snapshots" / "recording-tiny.json"


def records() -> list[dict]:
    return [data for name, data in json.loads(RECORDING.read_text())["events"] if name == "request"]


def test_followed_rows_are_as_narrow_as_the_table_of_the_same_rows_allows() -> None:
    rows = [row(r) for r in records()]
    out = io.StringIO()
    Console(file=out, width=400).print(render.table(COLUMNS, rows, numeric=NUMERIC))
    table_width = max(len(line.rstrip()) for line in out.getvalue().splitlines())
    lines = FollowLines(COLUMNS, NUMERIC, FOLLOW_WIDTHS)
    followed = [line for r in rows for line in lines.lines(r)]
    # Two spaces between columns as the table has, and the common widths a follower cannot learn
    # ahead (a clock, "entry/staged", milliseconds to 1,234.5): never the old fixed format's width.
    slack = sum(max(0, width - len(name)) for name, width in FOLLOW_WIDTHS.items())
    assert max(len(line) for line in followed) <= table_width + slack
    assert max(len(line) for line in followed) < min(len(format_request(r)) for r in records())


def test_the_header_lines_up_with_the_rows_and_is_printed_once() -> None:
    lines = FollowLines(("SEQ", "KIND", "ENTRY"), ("SEQ",), {"KIND": 12})
    first = lines.lines((7, "entry/staged", "abc"))
    second = lines.lines((12345, "cold", "-"))
    assert first[0] == "SEQ  KIND          ENTRY" and first[1] == "  7  entry/staged  abc"
    assert second == ["12345  cold          -"]  # a wider value widens its column from then on
