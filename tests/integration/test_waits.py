"""Waits for another request's work (issue 29): a unit of one row's work on the generation
thread is charged to every other live row, by kind, until the row ends.

The real ``SessionBook``, ``TimingBook`` and ``Waits`` over ``Pending`` prompts; time is the module's
clock, stepped by the test (``Clock``), so every amount asserted is exact and none is a wall time.
"""

from __future__ import annotations

import numpy as np
import pytest

from server_patch.integration import waits
from server_patch.integration.pending import Pending
from server_patch.integration.session import SessionBook, SessionState
from server_patch.integration.timings import TimingBook
from server_patch.integration.waits import Owners, Work
from server_patch.lineage import COLD, RestorePlan


class Clock:
    """``clock.monotonic`` as the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(waits.clock, "monotonic", fake)
    return fake


def admitted(book: SessionBook, seed: int, uid: object = None):
    """A looked-up prompt's row and record; bound to ``uid`` (PREFILLING) when one is given."""
    tokens = np.random.default_rng(seed).integers(0, 1000, size=16 + seed, dtype=np.int32)
    row = book.admit(Pending(tokens, "", RestorePlan(0, COLD, prompt_len=len(tokens))), book.timings.open(len(tokens)))
    if uid is not None:
        book.bind(row.key, uid)
    return row


def work(book: SessionBook, clock: Clock, kind: Work, seconds: float, owners: Owners) -> None:
    book.waits.begin(kind, owners)
    clock.now += seconds
    book.waits.end()


@pytest.fixture
def book() -> SessionBook:
    return SessionBook(TimingBook())


def test_one_rows_work_is_charged_to_the_others_and_not_to_itself(book: SessionBook, clock: Clock) -> None:
    a, b, c = admitted(book, 1, uid="a"), admitted(book, 2, uid="b"), admitted(book, 3)
    work(book, clock, Work.PREFILL, 0.5, Owners(uids=("a",)))
    assert a.record.waited_ms == 0 and a.record.waited == {}
    assert b.record.waited == {"prefill": 500.0} and b.record.waited_ms == 500.0
    assert c.record.waited == {"prefill": 500.0}  # admitted, not yet in a batch: it waited too
    work(book, clock, Work.RESTORE, 0.25, Owners(keys=(c.key,)))  # c's lookup and merge, by its key
    assert c.record.waited == {"prefill": 500.0}
    assert a.record.waited == {"restore": 250.0} and b.record.waited == {"prefill": 500.0, "restore": 250.0}
    work(book, clock, Work.COMMIT, 0.125, Owners(rows=(b,)))
    assert a.record.waited == {"restore": 250.0, "commit": 125.0} and a.record.waited_ms == 375.0
    assert b.record.waited_ms == 750.0


def test_a_unit_inside_another_is_its_own_kind_and_the_outer_one_only_the_rest(book: SessionBook, clock: Clock) -> None:
    a, b = admitted(book, 1, uid="a"), admitted(book, 2, uid="b")
    book.waits.begin(Work.PREFILL, Owners(uids=("a",)))
    clock.now += 0.5
    waits.run(Work.LOAD, lambda: setattr(clock, "now", clock.now + 0.25))  # inherits the owners: a's
    book.waits.begin(Work.COMMIT, Owners(rows=(a,)))  # its prompt-end commit, reached by the chunk
    clock.now += 0.125
    book.waits.end()
    book.waits.end()
    assert b.record.waited == {"prefill": 500.0, "load": 250.0, "commit": 125.0}
    assert a.record.waited == {}
    assert waits.run(Work.LOAD, lambda: 7) == 7  # no unit open: called, not timed


def test_decoding_rows_count_each_delayed_step_once_and_ended_rows_nothing(book: SessionBook, clock: Clock) -> None:
    a, b = admitted(book, 1, uid="a"), admitted(book, 2, uid="b")
    b.move(SessionState.DECODING, "prefill end")
    work(book, clock, Work.PREFILL, 0.1, Owners(uids=("a",)))
    work(book, clock, Work.COMMIT, 0.1, Owners(rows=(a,)))  # the same step pushed back again
    book.decoded(["b"], [5])
    work(book, clock, Work.PREFILL, 0.1, Owners(uids=("a",)))
    assert b.record.delayed_steps == 2 and a.record.delayed_steps == 0  # a is not decoding
    book.end(b, "leaving")
    work(book, clock, Work.PREFILL, 0.1, Owners(uids=("a",)))
    assert b.record.waited == pytest.approx({"prefill": 200.0, "commit": 100.0})
    assert b.record.ended and not a.record.ended


def test_the_row_end_makes_the_record_final_for_the_event_stream_and_the_histogram(book: SessionBook,
                                                                                   clock: Clock) -> None:
    timings = book.timings
    admitted(book, 1, uid="a")  # another row open while b finishes
    b = admitted(book, 2, uid="b")
    b.move(SessionState.DECODING, "prefill end")
    book.first_token("b", "req-b", 0.01)  # finished at its first token: in the ring, still waiting
    assert timings.since(0)[0]["ended"] is False and timings.ended_since(0) == []
    work(book, clock, Work.PREFILL, 2.0, Owners(uids=("a",)))  # after its first token: still charged
    assert timings.since(0)[0]["waited"] == {"prefill": 2000.0}
    book.end(b, "leaving")
    [(n, final)] = timings.ended_since(0)
    assert final["seq"] == b.record.seq and final["ended"] and final["waited_ms"] == 2000.0
    assert "delay_mark" not in final and "finished" not in final
    assert timings.ended_since(n) == []
    book.end(b, "removed")  # told once
    assert len(timings.ended_since(0)) == 1
    waited = {s.labels["work"]: s.value for m in timings.metrics.waited.collect() for s in m.samples
              if s.name.endswith("_sum")}
    assert waited == {"prefill": 2.0, **{kind: 0.0 for kind in waits.WORK_KINDS if kind != "prefill"}}


def test_a_row_that_ends_before_its_first_token_is_final_when_finished(book: SessionBook, clock: Clock) -> None:
    a, b = admitted(book, 1, uid="a"), admitted(book, 2, uid="b")
    b.move(SessionState.DECODING, "prefill end")
    work(book, clock, Work.COMMIT, 0.5, Owners(rows=(a,)))
    book.end(b, "leaving")  # a one-token reply: its row left before the server reported the token
    assert book.timings.ended_since(0) == []
    book.first_token("b", "req-b", 0.01)
    [record] = book.timings.since(0)
    assert record["ended"] and record["waited"] == {"commit": 500.0}
    assert book.timings.ended_since(0) == []  # its first record is already final


def test_a_unit_that_cannot_name_its_owners_runs_untimed(book: SessionBook, clock: Clock) -> None:
    a = admitted(book, 1, uid="a")

    def broken(*_):
        raise AttributeError("no lineage")

    @waits.unit(Work.PREFILL, broken)
    def step() -> int:
        clock.now += 1.0
        return 3

    assert step() == 3 and a.record.waited_ms == 0


def test_the_held_up_states_are_row_states() -> None:
    assert waits.HELD_UP == {SessionState.ADMITTED, SessionState.PREFILLING, SessionState.DECODING}
    assert waits.DECODING == SessionState.DECODING
