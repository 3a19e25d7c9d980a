"""A cancelled request's record: the row book's rules and the journal report's reading of it."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.journal_report import read_journal, summarize
from server_patch.integration.journal import Journal, JournalRecorder
from server_patch.integration.pending import Pending
from server_patch.integration.session import SessionBook
from server_patch.integration.timings import CANCELLED, DECODE, PREFILL, QUEUED, RequestTiming, TimingBook
from server_patch.lineage import COLD, RestorePlan
from server_patch.lineage.summary import CANCELLED_QUEUED, hit_summary, hits_key


def book_with_listener() -> tuple[SessionBook, list]:
    timings, seen = TimingBook(), []
    timings.listeners.append(seen.append)
    return SessionBook(timings), seen


def bound(book: SessionBook, uid: str, prompt_tokens: int) -> RequestTiming:
    """A request looked up (its row admitted, its record opened), then bound to ``uid``."""
    tokens = np.full(prompt_tokens, len(book), dtype=np.int32)  # a prompt of its own
    row = book.admit(Pending(tokens, "0", RestorePlan(0, COLD, prompt_len=prompt_tokens)),
                     book.timings.open(prompt_tokens))
    book.bind(row.key, uid)
    return row.record


def test_a_request_cancelled_before_its_first_token_ends_in_the_ring_and_the_listeners():
    book, seen = book_with_listener()
    record = bound(book, "uid-1", prompt_tokens=5000)
    assert book.cancelled("uid-1", "req-1") is record
    assert (record.outcome, record.phase, record.stored, record.request_id) == (CANCELLED, PREFILL, "nothing", "req-1")
    assert seen == [record] and [r["seq"] for r in book.timings.since()] == [record.seq]
    assert book.by_uid("uid-1").timed  # finished: a late first token finds nothing
    book.first_token("uid-1", "req-1", 0.5)
    assert seen == [record] and record.ttft_ms == 0


def test_a_request_cancelled_while_decoding_is_marked_where_it_lies():
    book, seen = book_with_listener()
    record = bound(book, "uid-2", prompt_tokens=100)
    record.commit_ms, record.reply_tokens = 1.5, 12  # committed at its prompt end, then its reply kept
    book.first_token("uid-2", "req-2", 0.1)
    assert seen == [record] and record.outcome == ""
    assert book.cancelled("uid-2", "req-2") is record
    assert (record.outcome, record.phase, record.stored) == (CANCELLED, DECODE, "reply")
    assert seen == [record] and len(book.timings.since()) == 1  # one record, not two
    assert book.timings.since()[0]["outcome"] == CANCELLED


def test_a_decode_cancel_is_told_to_the_outcome_listeners_once():
    book, seen = book_with_listener()
    outcomes: list = []
    book.timings.outcome_listeners.append(outcomes.append)
    prefill = bound(book, "uid-a", prompt_tokens=10)
    book.cancelled("uid-a", "req-a")  # cancelled in prefill: a record, no outcome line
    decode = bound(book, "uid-b", prompt_tokens=10)
    book.first_token("uid-b", "req-b", 0.1)
    book.cancelled("uid-b", "req-b")
    assert seen == [prefill, decode] and outcomes == [decode]


def test_a_request_cancelled_while_queued_gets_the_next_record():
    book, seen = book_with_listener()
    first = book.timings.open(prompt_tokens=10)
    queued = book.timings.cancelled_queued("req-q", prompt_tokens=42)
    assert queued.seq == first.seq + 1 and seen == [queued]
    assert (queued.outcome, queued.phase, queued.stored, queued.prompt_tokens, queued.request_id) == (
        CANCELLED, QUEUED, "nothing", 42, "req-q")
    assert queued.ttft_ms == 0 and queued.copies == {}


def test_requests_in_status_count_the_queued_cancels_but_not_as_hits():
    stats = {hits_key("cold"): 3, hits_key("entry"): 1, CANCELLED_QUEUED: 2}
    summary = hit_summary(stats)
    assert (summary["requests"], summary["hits"], summary["cancelled_queued"]) == (6, 1, 2)
    assert summary["hit_rate"] == 1 / 6


def test_the_journal_follows_a_decode_cancel_with_its_outcome_and_the_report_applies_it(tmp_path):
    book = SessionBook(TimingBook())
    journal = Journal(tmp_path)
    recorder = JournalRecorder(journal, runtime=None, snapshot_s=float("inf"))
    recorder._last_snapshot = float("inf")  # no runtime to sample budgets from: never due
    book.timings.listeners.append(recorder.on_request)
    book.timings.outcome_listeners.append(recorder.on_outcome)
    record = bound(book, "uid", prompt_tokens=100)
    record.reply_tokens = 7
    book.first_token("uid", "req", 0.1)
    book.cancelled("uid", "req")
    journal.close()
    lines = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert [line["type"] for line in lines] == ["request", "request_outcome"]
    assert lines[0]["outcome"] == "" and lines[1]["seq"] == lines[0]["seq"]
    assert (lines[1]["outcome"], lines[1]["phase"], lines[1]["stored"]) == (CANCELLED, DECODE, "reply")
    report = summarize(read_journal(tmp_path), since=0.0, until=float("inf"))
    assert report["requests"]["count"] == 1 and report["requests"]["cancelled_in_decode"] == 1
    assert report["latency_ms"]["ttft"]["p50"] == 100.0  # it had a first token: its latency counts


def test_an_outcome_line_names_its_request_in_its_own_server_run():
    line = {"type": "request", "seq": 1, "restore_kind": "cold", "ttft_ms": 5.0, "outcome": "", "phase": ""}
    records = [{"type": "start"}, dict(line), {"type": "start"}, dict(line),
               {"type": "request_outcome", "seq": 1, "outcome": "cancelled", "phase": "decode", "stored": "prompt"},
               {"type": "request_outcome", "seq": 9, "outcome": "cancelled", "phase": "decode"}]
    report = summarize(records, since=0.0, until=1.0)
    assert report["requests"]["count"] == 2 and report["requests"]["cancelled_in_decode"] == 1


def test_an_unknown_request_is_not_invented():
    book, seen = book_with_listener()
    assert book.cancelled("nobody", "req") is None and seen == [] and book.timings.since() == []


def test_the_report_counts_prefill_cancels_but_takes_no_latency_from_them():
    done = {"type": "request", "restore_kind": "entry", "restored_tokens": 90, "prompt_tokens": 100,
            "ttft_ms": 40.0, "prefill_ms": 10.0, "outcome": "", "phase": ""}
    cancelled = {**done, "restore_kind": "cold", "restored_tokens": 0, "prompt_tokens": 5000,
                 "ttft_ms": 0.0, "prefill_ms": 0.0, "outcome": "cancelled", "phase": "prefill"}
    report = summarize([done, cancelled], since=0.0, until=1.0)
    assert report["requests"]["count"] == 2 and report["requests"]["cancelled_in_prefill"] == 1
    assert report["requests"]["cancelled_in_queued"] == 0
    assert report["latency_ms"]["ttft"]["p50"] == 40.0


def test_the_report_command_says_where_requests_were_cancelled(tmp_path):
    journal = Journal(tmp_path)
    base = {"type": "request", "time": 2.0, "seq": 1, "restore_kind": "cold", "ttft_ms": 9.0, "outcome": "", "phase": ""}
    for line in ({"type": "start", "time": 1.0}, base,
                 {**base, "seq": 2, "ttft_ms": 0.0, "outcome": "cancelled", "phase": "queued", "stored": "nothing"},
                 {"type": "request_outcome", "time": 3.0, "seq": 1, "outcome": "cancelled", "phase": "decode"}):
        journal.append(line)
    journal.close()
    human = CliRunner().invoke(main, ["report", "--journal", str(tmp_path), "--since", "1970-01-01"])
    assert human.exit_code == 0, human.output
    assert "2 requests" in human.output
    queued_out = summarize(read_journal(tmp_path), since=0.0, until=10.0)["requests"]
    assert queued_out["by_kind"] == {"cold": {"requests": 1, "reused_tokens": 0, "prompt_tokens": 0}}
    assert "cancelled by their client: in queued 1, in prefill 0, in decode 1" in human.output
