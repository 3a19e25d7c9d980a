"""The dashboard's GAP ms cell (issue 40): a request's longest inter-token gap and what most of
it was, yellow when another's work was the most of it."""

from __future__ import annotations

from rich.text import Text

from tui.columns import gap_cell, request_columns


def test_the_gap_cell_names_the_largest_part_and_marks_anothers_work() -> None:
    joined = {"worst_gap": {"ms": 734.4, "parts": {"join": 420.0, "step": 300.0, "unattributed": 14.4}}}
    cell = gap_cell(joined)
    assert isinstance(cell, Text) and cell.plain == "734 join" and cell.style == "yellow"
    assert gap_cell({"worst_gap": {"ms": 90.0, "parts": {"step": 88.0, "unattributed": 2.0}}}) == "90 step"
    assert gap_cell({"worst_gap": {}}) == "" and gap_cell({}) == "-"
    assert [c.label for c in request_columns()][-2:] == ["WAIT ms", "GAP ms"]
