"""A cancelled request's record: the TimingBook rules and the journal report's reading of it."""

from __future__ import annotations

from apcctl.journal_report import summarize
from server_patch.integration.timings import CANCELLED, DECODE, PREFILL, TimingBook


def book_with_listener() -> tuple[TimingBook, list]:
    book, seen = TimingBook(), []
    book.listeners.append(seen.append)
    return book, seen


def test_a_request_cancelled_before_its_first_token_ends_in_the_ring_and_the_listeners():
    book, seen = book_with_listener()
    record = book.open("key", prompt_tokens=5000)
    book.bind("uid-1", "key")
    assert book.cancelled("uid-1", "req-1") is record
    assert (record.outcome, record.phase, record.stored, record.request_id) == (CANCELLED, PREFILL, "nothing", "req-1")
    assert seen == [record] and [r["seq"] for r in book.since()] == [record.seq]
    assert book.by_uid("uid-1") is None  # finished: a late first token finds nothing
    book.first_token("uid-1", "req-1", 0.5)
    assert seen == [record] and record.ttft_ms == 0


def test_a_request_cancelled_while_decoding_is_marked_where_it_lies():
    book, seen = book_with_listener()
    record = book.open("key", prompt_tokens=100)
    book.bind("uid-2", "key")
    record.commit_ms, record.reply_tokens = 1.5, 12  # committed at its prompt end, then its reply kept
    book.first_token("uid-2", "req-2", 0.1)
    assert seen == [record] and record.outcome == ""
    assert book.cancelled("uid-2", "req-2") is record
    assert (record.outcome, record.phase, record.stored) == (CANCELLED, DECODE, "reply")
    assert seen == [record] and len(book.since()) == 1  # one record, not two
    assert book.since()[0]["outcome"] == CANCELLED


def test_an_unknown_request_is_not_invented():
    book, seen = book_with_listener()
    assert book.cancelled("nobody", "req") is None and seen == [] and book.since() == []


def test_the_report_counts_prefill_cancels_but_takes_no_latency_from_them():
    done = {"type": "request", "restore_kind": "entry", "restored_tokens": 90, "prompt_tokens": 100,
            "ttft_ms": 40.0, "prefill_ms": 10.0, "outcome": "", "phase": ""}
    cancelled = {**done, "restore_kind": "cold", "restored_tokens": 0, "prompt_tokens": 5000,
                 "ttft_ms": 0.0, "prefill_ms": 0.0, "outcome": "cancelled", "phase": "prefill"}
    report = summarize([done, cancelled], since=0.0, until=1.0)
    assert report["requests"]["count"] == 2 and report["requests"]["cancelled_in_prefill"] == 1
    assert report["latency_ms"]["ttft"]["p50"] == 40.0
