"""A decoding stream's gaps on the real patched server (issue 40): when another session's
request joins its batch and leaves it, the gap the join fell in names the join among its parts,
and every kept gap's parts add up to the gap the server measured between the stream's tokens.
The tolerance is the rounding of the record's own figures, never a wall time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_request_waits import decoded_beside, records
from tests.server_harness import PatchedServer, text

ROUNDING_MS = 0.001  # each part and the gap are rounded to the microsecond


def _adds_up(gap: dict) -> None:
    """The gap's parts add up to it, none is negative but what no unit timed, and that is never
    below zero by more than the rounding (no work counted twice); its span is its server times'."""
    parts, tolerance = gap["parts"], ROUNDING_MS * (len(gap["parts"]) + 1)
    assert sum(parts.values()) == pytest.approx(gap["ms"], abs=tolerance), gap
    assert (gap["to"] - gap["from"]) * 1000 == pytest.approx(gap["ms"], abs=tolerance), gap
    assert all(ms >= 0 for part, ms in parts.items() if part != "unattributed"), gap
    assert parts["unattributed"] >= -tolerance, gap
    assert parts.get("step", 0) > 0, gap  # every gap ends with the stream's own step


@pytest.mark.server
def test_a_join_and_a_leave_are_parts_of_the_decoding_streams_gaps(tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, log_dir=tmp_path) as server:
        other = [{"role": "system", "content": text(30, 4011)}, {"role": "user", "content": text(200, 4012)}]
        stream = decoded_beside(server, other, "other", max_tokens=400)
        streaming = max(records(server), key=lambda r: r.gap_count)
        assert streaming.gap_count >= stream.tokens - 3, streaming  # a gap per token of a decode step
        joined = [g for g in streaming.gaps if "join" in g["parts"]]
        left = [g for g in streaming.gaps if "leave" in g["parts"]]
        assert joined and left, streaming.gaps
        assert joined[0]["parts"]["join"] > 0 and left[0]["parts"]["leave"] > 0
        for gap in [*streaming.gaps, streaming.worst_gap]:
            _adds_up(gap)
        assert streaming.worst_gap["ms"] >= max(g["ms"] for g in streaming.gaps)
        # What the stream waited for in all includes the join and the leave, never its own step.
        assert streaming.waited.get("join", 0) > 0 and streaming.waited.get("leave", 0) > 0
        assert "step" not in streaming.waited
