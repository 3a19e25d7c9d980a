"""``apcctl requests``' GAP column (issue 40): a stream's longest inter-token gap and what most of
it was, from the record's ``worst_gap`` (the parts add up to it: ``integration.waits``)."""

from __future__ import annotations

from apcctl.commands.requests import COLUMNS, format_request, row
from apcctl.core import render

RECORD = {"seq": 4, "started": 0.0, "prompt_tokens": 50, "ttft_ms": 9.0, "entry_id": "abc", "waited_ms": 300.0,
          "waited": {"join": 300.0}, "ended": True, "gap_count": 12,
          "worst_gap": {"ms": 734.4, "from": 1.0, "to": 1.7344,
                        "parts": {"join": 420.0, "prefill": 200.0, "step": 100.0, "unattributed": 14.4}}}


def test_the_gap_column_is_the_longest_gap_and_its_largest_part() -> None:
    assert row(RECORD)[COLUMNS.index("GAP ms")] == "734 join"
    assert format_request(RECORD).split()[-3:] == ["734", "join", "abc"]
    own = dict(RECORD, worst_gap={"ms": 90.0, "parts": {"step": 88.0, "unattributed": 2.0}})
    assert row(own)[COLUMNS.index("GAP ms")] == "90 step"


def test_no_gap_yet_is_blank_and_a_server_before_gaps_is_a_dash() -> None:
    assert row(dict(RECORD, worst_gap={}, gap_count=0))[COLUMNS.index("GAP ms")] == ""
    assert render.gap_label({"seq": 1}) == "-"  # the raw record of an older server (the dashboard's)
