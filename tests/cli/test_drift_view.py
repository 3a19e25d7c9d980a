"""The DRIFT cell and the ``apcctl requests ID`` lines (``apcctl.core.drift_view``)."""

from __future__ import annotations

from apcctl.core.drift_view import SHORT, describe_drift, detail_lines, drift_label, drift_lines, drift_summary
from server_patch.drift import Cause


def test_every_cause_has_a_short_name() -> None:
    assert set(SHORT) == {str(c) for c in Cause}
    assert len(set(SHORT.values())) == len(SHORT)


def test_the_cell() -> None:
    assert drift_label({}) == "-"  # a server before issue 37
    assert drift_label({"drift": {}}) == ""
    assert drift_label({"drift": {"cause": "date/time changed", "position": 1204}}) == "date @1,204"


def test_the_detail_has_no_escape_and_says_when_text_is_off() -> None:
    drift = {"cause": "history rebuilt on resume", "segment": "message 2 (user)", "position": 40, "tokens": 900,
             "earlier_tokens": 1000, "context": "<|user|>\x1b[2J", "removed": "date\x07 block", "added": ""}
    lines = detail_lines({"seq": 3, "request_id": "abc\x1b]0;x\x07", "drift": drift})
    assert all(not any(ord(c) < 32 or c == "\x7f" for c in line) for line in lines)
    assert any(line.startswith("drift: history rebuilt on resume in message 2 (user) at token 40") for line in lines)
    assert "  - date block" in lines
    quiet = drift_lines({k: v for k, v in drift.items() if k not in ("context", "removed", "added")})
    assert quiet[-1] == "  (text diff off: APC_DRIFT_TEXT=0)"


def test_the_reports_top_causes() -> None:
    requests = [{"drift": {"cause": "date/time changed", "tokens": 900}}, {"drift": {}},
                {"drift": {"cause": "date/time changed", "tokens": 100}}, {"seq": 4},
                {"drift": {"cause": "reply dropped on retry", "tokens": 3}}]
    summary = drift_summary(requests)
    assert summary["requests"] == 3 and summary["tokens"] == 1003
    assert [c["cause"] for c in summary["top_causes"]] == ["date/time changed", "reply dropped on retry"]
    assert describe_drift(summary) == ("3 requests (1,003 tokens): date/time changed 2 (1,000 tokens), "
                                       "reply dropped on retry 1 (3 tokens)")
    assert describe_drift(drift_summary([])) == "none"
