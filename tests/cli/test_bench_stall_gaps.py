"""``bench stall``'s read of the victim's gap record (``apcctl.lab.bench.stall_gaps``): what it
takes from the patched server's ``/admin/requests``, and that a server whose records carry no
gaps at all (an older tree under ``--against``) is answered at once instead of waited out."""

from __future__ import annotations

from typing import Any

from apcctl.lab.bench import stall_gaps


class RecordsServer:
    """The one call ``victim_gaps`` makes of a bench server, answering fixed records."""

    patched = True

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.calls = 0

    def get_json(self, path: str) -> dict[str, Any]:
        assert path.startswith("/admin/requests")
        self.calls += 1
        return {"requests": self.records}


def test_the_newest_ended_record_with_enough_gaps_is_the_victims() -> None:
    records = [
        {"seq": 1, "gap_count": 40, "ended": True, "worst_gap": {"ms": 90}, "gaps": [1], "waited": {}},
        {"seq": 2, "gap_count": 3, "ended": True, "worst_gap": {"ms": 5}},  # the event's own short reply
        {"seq": 3, "gap_count": 41, "ended": True, "worst_gap": {"ms": 700, "parts": {"join": 600}},
         "gaps": [2], "waited": {"join": 600}},
    ]
    found = stall_gaps.victim_gaps(RecordsServer(records), min_gaps=10)  # type: ignore[arg-type]
    assert found is not None
    assert found["worst_gap"]["ms"] == 700 and found["gap_count"] == 41 and found["ended"]
    assert stall_gaps.parts_text(found["worst_gap"]) == "700 ms: join 600"


def test_older_reads_the_stream_before_the_newest_and_parts_keep_their_names() -> None:
    """``short-visits`` reads the long stream alone too: the record before the newest long one;
    a part's name is printed as the server gave it (``grow`` or any other)."""
    records = [
        {"seq": 4, "gap_count": 30, "ended": True, "worst_gap": {"ms": 80}, "waited": {}},
        {"seq": 5, "gap_count": 15, "ended": True, "worst_gap": {"ms": 9}},  # a visit
        {"seq": 6, "gap_count": 30, "ended": True, "worst_gap": {"ms": 300}, "waited": {"join": 5}},
    ]
    alone = stall_gaps.victim_gaps(RecordsServer(records), min_gaps=27, older=1)  # type: ignore[arg-type]
    assert alone is not None and alone["worst_gap"]["ms"] == 80 and alone["waited"] == {}
    assert stall_gaps.largest({"grow": 40.4, "step": 90, "join": 0.2}) == "step 90, grow 40"


def test_a_server_that_records_no_gaps_is_not_waited_out() -> None:
    server = RecordsServer([{"seq": 1, "ended": True}, {"seq": 2, "ended": True}])  # no gap_count: older
    assert stall_gaps.victim_gaps(server, min_gaps=10) is None  # type: ignore[arg-type]
    assert server.calls == 1, "answered from the first read, not polled until RECORD_WAIT_S"
